"""`tunelab data stats|verify|coverage` on the demo config (embedded tiny model, chatml, demo_reverse): exit codes
and the key lines of the output."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tunelab.cli import main
from tunelab.data.run_data import RunData, batch_order
from tunelab.preflight import load_config, plan_run
from tunelab.train.recipe import recipe_for
from tunelab.train.stages.sft import SFTRecipe
from tunelab.data.pairwise import pair_sides
from tunelab.data.collate import SupervisedCollator
from tunelab.errors import ConfigError

DEMO = """\
model_name_or_path: tiny
stage: sft
finetuning_type: full
template: chatml
dataset: demo_reverse
max_samples: 64
cutoff_len: 128
output_dir: {out}
per_device_train_batch_size: 16
seed: 42
"""


@pytest.fixture
def demo(tmp_path: Path) -> Path:
    path = tmp_path / "demo.yaml"
    path.write_text(DEMO.format(out=tmp_path / "run"), encoding="utf-8")
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], str]:
    code = main(["data", *argv])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_stats_prints_the_numbers_and_saves_the_histogram(demo: Path, capsys) -> None:
    code, lines, _ = run(capsys, "stats", str(demo))
    assert code == 0
    assert lines[:6] == [
        "train: 64 samples (stage sft, template chatml, cutoff_len 128)",
        "length (tokens): min 25, max 33, mean 28.44, median 29, p95 33",
        "supervised tokens: 494 of 1820 (27.1%) reach the loss",
        "token utilisation: 86.2% in batches of 16 padded to their longest, 86.2% padding-free (shuffled, seed 42); "
        "22.2% if padded to cutoff_len 128",
        "rows (demo_reverse): 64 read, 0 with an empty answer (trains the end-of-turn), 0 with reasoning",
        "encoding: 0 rows shortened to fit cutoff_len 128 (earliest turns dropped first; 0 trained answers lost), 0 "
        "dropped with no supervised token left",
    ]
    assert lines[6] == "length histogram (tokens, samples):"
    assert lines[7].split() == ["25", "█" * 40, "27", "42.2%"]
    out = demo.parent / "run" / "data_stats"
    assert lines[-1] == f"wrote {out / 'length_histogram.png'} and {out / 'stats.json'}"
    assert (out / "length_histogram.png").stat().st_size > 0
    load_config(demo)  # training into that output_dir still works: it holds only data_stats/


def test_stats_with_packing_into_another_folder(demo: Path, tmp_path: Path, capsys) -> None:
    code, lines, _ = run(capsys, "stats", str(demo), "packing=true", "--out", str(tmp_path / "stats"))
    assert code == 0
    assert (
        "packing: 64 samples into 15 rows of 128: efficiency 94.8%; 94.8% in batches of 16 rows padded to their longest"
    ) in lines
    assert (tmp_path / "stats" / "stats.json").is_file()


def test_data_commands_ignore_a_non_empty_output_dir(demo: Path, capsys) -> None:
    (demo.parent / "run").mkdir()
    (demo.parent / "run" / "model.safetensors").write_text("x")
    with pytest.raises(ConfigError, match="is not empty"):
        load_config(demo)
    assert run(capsys, "coverage", str(demo))[0] == 0


def test_verify_passes_and_summarises(demo: Path, capsys) -> None:
    code, lines, _ = run(capsys, "verify", str(demo), "padding_free=false")
    assert code == 0
    assert lines[0] == (
        "train: 4 batches, 64 samples, through SupervisedCollator: input_ids, labels, attention_mask; first batch (16, 33)"
    )
    assert lines[1] == "  494 supervised positions: label == input_id (the loss shifts them)"
    assert lines[-2] == (
        "encoding: 64 training rows re-encoded: every trained answer follows its inference prompt's exact ids and is "
        "its own ids, ending with '<|im_end|>' as one token; no example over cutoff_len 128, the last answer of each "
        "conversation kept"
    )
    assert lines[-1] == "ok: every check passed (dtypes int64, shapes consistent, every input id < vocab_size 864)"


def test_verify_catches_ids_that_are_not_the_inference_prompt(demo: Path, capsys, monkeypatch) -> None:
    from tunelab.data.encode import SupervisedEncoder  # noqa: PLC0415

    encode_rows = SupervisedEncoder.encode_rows

    def first_token_lost(self, rows):  # as if the prompt had tokenised differently in training
        examples = encode_rows(self, rows)
        return [[{**e, "input_ids": e["input_ids"][1:], "labels": e["labels"][1:]} for e in row] for row in examples]

    monkeypatch.setattr(SupervisedEncoder, "encode_rows", first_token_lost)
    code, lines, err = run(capsys, "verify", str(demo), "--max-batches", "1")
    assert (code, lines) == (1, [])
    assert re.fullmatch(
        r"tunelab: verify failed: train row 0: example: answer 1: the ids before it are not the tokenised prompt "
        r"\(\d+ prompt tokens, \d+ ids; first difference at 0\)\n",
        err.splitlines(keepends=True)[-1],
    )


def test_verify_padding_free_is_the_default(demo: Path, capsys) -> None:
    """Mixed lengths (short reversals, long conversations): the same samples in fewer, padding-free rows."""
    mixed = ("dataset=demo_reverse,demo_multiturn", "max_samples=32")
    code, padded, _ = run(capsys, "verify", str(demo), *mixed, "padding_free=false")
    assert code == 0
    assert padded[2] == "  3019 padding positions: pad id 0, label -100, attention_mask 0 (1 on every real token)"
    code, lines, _ = run(capsys, "verify", str(demo), *mixed)
    assert code == 0
    assert lines[:4] == [
        # sdpa_varlen (model/varlen_sdpa.py): each batch's samples flattened into one row, their boundaries beside
        "train: 4 batches, 64 samples, through PaddingFreeCollator (varlen): input_ids, labels, position_ids, "
        "cu_seq_lens_q, cu_seq_lens_k, attention_mask; first batch (1, 792)",
        padded[1],  # the same supervised positions
        "  64 padding-free samples in 4 batch rows: position ids restart at 0 at each start and step by 1; "
        "label -100 at every sample start",
        "  0 padding positions: pad id 0, label -100",
    ]


def test_verify_packed_uses_the_packed_collator(demo: Path, capsys) -> None:
    code, lines, _ = run(capsys, "verify", str(demo), "packing=true", "--max-batches", "1")
    assert code == 0
    assert lines[0] == (
        "train: 1 batch, 15 packed rows, through PackedCollator (varlen): input_ids, labels, position_ids, "
        "cu_seq_lens_q, cu_seq_lens_k, attention_mask; first batch (1, 1820)"
    )
    assert lines[2] == (
        "  64 packed samples in 1 batch rows: position ids restart at 0 at each start and step by 1; "
        "label -100 at every sample start"
    )


class ShiftingCollator(SupervisedCollator):
    """The bug verify exists for: labels shifted by one although the loss shifts them again."""

    def __call__(self, examples):
        batch = super().__call__(examples)
        batch["labels"][:, :-1] = batch["labels"][:, 1:].clone()
        batch["labels"][:, -1] = -100
        return batch


def test_verify_fails_with_one_line_and_exit_1(demo: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(SFTRecipe, "inspection_collator", lambda recipe: ShiftingCollator(recipe.tokenizer.pad_token_id))
    code, lines, err = run(capsys, "verify", str(demo))
    assert (code, lines) == (1, [])
    assert re.fullmatch(
        r"tunelab: verify failed: train: batch 0, sample 0, position \d+: label \d+ != input_id \d+; labels must "
        r"equal input_ids where supervised \(the loss shifts them\); it equals the next input_id: were the labels "
        r"shifted already\?\n",
        err.splitlines(keepends=True)[-1],
    )


def test_coverage_on_a_byte_level_tokenizer(demo: Path, capsys) -> None:
    code, lines, _ = run(capsys, "coverage", str(demo))
    assert code == 0
    from transformers import AutoTokenizer

    from tunelab.assets import TINY_MODEL_DIR
    from tunelab.config.args import DataArguments
    from tunelab.data.pipeline import build_datasets
    from tunelab.data.templates import get_template

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    args = DataArguments(dataset=["demo_reverse"], max_samples=64, template="chatml", cutoff_len=1024)
    train = build_datasets(args, tokenizer, get_template("chatml", tokenizer), seed=0).train
    largest = max(max(ids) for ids in train["input_ids"])
    assert lines == [
        "train: 64 samples, 1820 tokens (tokenizer: byte-level, 864 entries; model vocab_size 864 from config.json)",
        "unk: the tokenizer has no unk token (byte pieces spell any text)",
        f"ids out of range (>= vocab_size 864): 0 tokens (largest id {largest})",
        "vocabulary used: 36 distinct ids of 864 (4.2%)",
        "characters spelled in several byte-level pieces: 0 of 3292 (0.00%)",
    ]


def test_coverage_counts_unk_tokens(demo: Path, tiny_llama_dir: Path, capsys) -> None:
    # The fixture's word-level tokenizer knows only w0 w1 ...: chat text is mostly <unk>.
    code, lines, _ = run(capsys, "coverage", str(demo), f"model_name_or_path={tiny_llama_dir}")
    assert code == 0
    assert re.fullmatch(r"unk: \d+ of \d+ tokens \(\d+\.\d\d%\) are '<unk>'", lines[1])
    assert lines[-1] == "byte pieces: this tokenizer has none (neither byte-level nor byte-fallback)"


def test_pt_stats_and_verify(tmp_path: Path, capsys) -> None:
    config = tmp_path / "pt.yaml"
    config.write_text(
        "model_name_or_path: tiny\nstage: pt\nfinetuning_type: full\ndataset: demo_corpus\nmax_samples: 32\n"
        "cutoff_len: 64\nstride: 48\nper_device_train_batch_size: 8\n",
        encoding="utf-8",
    )
    code, lines, _ = run(capsys, "stats", str(config), "--out", str(tmp_path / "stats"))
    assert code == 0
    assert lines[0] == "train: " + lines[0].split(" ")[1] + " samples (stage pt, cutoff_len 64)"
    assert any(line.startswith("windows: ") and line.endswith("nothing is truncated") for line in lines)
    code, lines, _ = run(capsys, "verify", str(config))
    assert code == 0 and lines[-1].startswith("ok: every check passed")
    # Packed documents go through the PackedCollator training uses; samples are read from position restarts.
    packed = tmp_path / "pt_packed.yaml"
    packed.write_text(config.read_text().replace("stride: 48\n", "packing: true\n"), encoding="utf-8")
    code, lines, _ = run(capsys, "verify", str(packed))
    assert code == 0 and lines[-1].startswith("ok: every check passed")
    assert "through PackedCollator (varlen)" in lines[0]
    assert re.fullmatch(r"  \d+ packed samples in \d+ batch rows: position ids restart .*", lines[2])


def test_bad_override_is_a_config_error(demo: Path, capsys) -> None:
    code, lines, err = run(capsys, "stats", str(demo), "cutof_len=64")
    assert (code, lines) == (2, [])
    # the key came from the command line, not the YAML file
    assert err == "tunelab: error: unknown key 'cutof_len' on the command line; did you mean 'cutoff_len'?\n"


PAIRS = DEMO.replace("stage: sft", "stage: dpo").replace("dataset: demo_reverse", "dataset: demo_preference").replace(
    "max_samples: 64", "max_samples: 24").replace("per_device_train_batch_size: 16", "per_device_train_batch_size: 4")


def pairs_config(tmp_path: Path) -> Path:
    path = tmp_path / "pairs.yaml"
    path.write_text(PAIRS.format(out=tmp_path / "run"), encoding="utf-8")
    return path


def test_stats_of_pairs_count_sequences_as_the_collators_batch_them(tmp_path: Path, capsys) -> None:
    """The utilisation lines equal the real positions of PairedCollator's batches, padded and padding-free,
    drawn in the training order."""
    import numpy as np  # noqa: PLC0415

    from tunelab.data.collate import PackedCollator, PaddingFreeCollator, PairedCollator  # noqa: PLC0415

    path = pairs_config(tmp_path)
    code, lines, _ = run(capsys, "stats", str(path))
    assert code == 0
    data = inspection(path)
    rows = list(data.train)
    order = batch_order(len(rows), "random", 42)
    batches = [[rows[i] for i in order[s : s + 4]] for s in range(0, len(rows), 4)]
    padded = sum(PairedCollator(0)(b)["input_ids"].numel() for b in batches)
    free = sum(PairedCollator(0, padding_free=PaddingFreeCollator(PackedCollator(0)))(b)["input_ids"].numel()
               for b in batches)
    lengths = [len(r[f"{side}_input_ids"]) for side in ("chosen", "rejected") for r in rows]
    supervised = sum(sum(v != -100 for v in r[f"{side}_labels"][1:]) for side in ("chosen", "rejected") for r in rows)
    tokens = sum(lengths)
    assert len(rows) == 24
    assert lines[:4] == [
        "train: 24 pairs, 48 sequences (stage dpo, template chatml, cutoff_len 128)",
        f"length (tokens): min {min(lengths)}, max {max(lengths)}, mean {np.mean(lengths):.2f}, "
        f"median {np.median(lengths):g}, p95 {np.percentile(lengths, 95):.2f}".rstrip("0").rstrip("."),
        f"supervised tokens: {supervised} of {tokens} ({100 * supervised / tokens:.1f}%) reach the loss",
        f"token utilisation: {100 * tokens / padded:.1f}% in batches of 4 pairs (8 sequences) padded to their longest, "
        f"{100 * tokens / free:.1f}% padding-free (shuffled, seed 42); {100 * tokens / (48 * 128):.1f}% if padded to "
        "cutoff_len 128",
    ]
    assert lines[6] == "length histogram (tokens, sequences):"


@pytest.mark.parametrize("stage, unit", [("dpo", "pairs"), ("kto", "examples"), ("rm", "pairs")])
def test_verify_and_coverage_of_pair_stages(tmp_path: Path, capsys, stage: str, unit: str) -> None:
    path = pairs_config(tmp_path)
    code, lines, _ = run(capsys, "verify", str(path), f"stage={stage}")
    assert code == 0
    rows = 24 if stage != "kto" else 48  # a pair gives kto a desirable and an undesirable example
    assert lines[0].startswith(f"train: {rows // 4} batches, {rows} {unit} ({2 * rows} sequences), through PairedCollator")
    if stage == "rm":  # rewards are read at each padded row's end
        assert "through PairedCollator: input_ids, labels, attention_mask; first batch (8, " in lines[0]
        assert not any("sequence_ids" in line for line in lines)
    else:
        assert ("through PairedCollator (varlen): input_ids, labels, position_ids, cu_seq_lens_q, cu_seq_lens_k, "
                "attention_mask, sequence_ids") in lines[0]
        assert lines[3] == "  sequence_ids: one id per sequence, each of the batch's sequences once, -1 on padding"
    assert lines[-1] == "ok: every check passed (dtypes int64, shapes consistent, every input id < vocab_size 864)"

    code, lines, _ = run(capsys, "coverage", str(path), f"stage={stage}")
    data = inspection(path, [f"stage={stage}"])
    first, second = pair_sides(stage)
    tokens = sum(len(r[f"{first}input_ids"]) + len(r[f"{second}input_ids"]) for r in data.train)
    assert code == 0
    assert lines[0].startswith(f"train: {rows} rows of 2 sequences, {tokens} tokens (tokenizer: byte-level")


def inspection(path: Path, overrides: list[str] | None = None) -> RunData:
    """The data `tunelab data` inspects (the stage recipe's view)."""
    return recipe_for(plan_run(path, overrides or [], purpose="data")).inspection()
