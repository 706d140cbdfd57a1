"""Stage pt data: window/stride counts and contents, overlap labels, tail, cleaning, file types, folders.

Documents are words "w<i>" tokenised by a word-level tokenizer (w<i> → id i + 3, eos 2), so every
expected window below is computed by hand from the concatenated stream.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tunelab.config.args import DataArguments
from tunelab.data import pretrain
from tunelab.data.pretrain import build_pretrain_datasets, plan_windows
from tunelab.data.dataset_files import load_rows
from tunelab.data.registry import load_registry
from tunelab.errors import ConfigError, DataError

EOS = 2
X = -100  # label of a context-only token


def words(*ids: int) -> str:
    return " ".join(f"w{i}" for i in ids)


def register(folder: Path, file_name: str, **entry) -> Path:
    (folder / "dataset_info.json").write_text(json.dumps({"corpus": {"file_name": file_name, "formatting": "text", **entry}}))
    return folder


def build(folder: Path, tokenizer, **options):
    args = DataArguments(dataset_dir=str(folder), dataset=["corpus"], **{"cutoff_len": 6, **options})
    return build_pretrain_datasets(args, tokenizer, seed=0)


def windows(bundle) -> list[tuple[list[int], list[int]]]:
    return [(row["input_ids"], row["labels"]) for row in bundle.train]


# --- the plan: counts ------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 2, 5, 8])
@pytest.mark.parametrize("total", [0, 1, 4, 5, 7, 8, 9, 16, 17, 40])
def test_full_window_count_matches_formula_and_brute_force(total, window):
    for stride in range(1, window + 1):
        plan = plan_windows(total, window, stride, tail="drop")
        brute = [s for s in range(0, total) if s + window <= total and s % stride == 0]
        assert plan.full_windows == len(brute) == ((total - window) // stride + 1 if total >= window else 0)
        assert plan.starts.tolist() == brute
        covered = brute[-1] + window if brute else 0
        assert plan.tail_tokens == plan.dropped_tail_tokens == total - covered


def test_docstring_example_overlap_and_tail():
    plan = plan_windows(15, 6, 4, tail="keep")
    assert list(zip(plan.starts.tolist(), plan.ends.tolist(), plan.first_targets.tolist())) == [
        (0, 6, 0), (4, 10, 6), (8, 14, 10), (12, 15, 14),
    ]
    assert (plan.full_windows, plan.tail_tokens, plan.dropped_tail_tokens) == (3, 1, 0)
    assert plan.target_tokens == 14  # every token but the first, once
    dropped = plan_windows(15, 6, 4, tail="drop")
    assert (dropped.windows, dropped.dropped_tail_tokens, dropped.target_tokens) == (3, 1, 13)


def test_window_count_example_from_the_walkthrough():
    for stride, expected in ((512, 1953), (256, 3905), (128, 7809)):
        assert plan_windows(1_000_000, 512, stride).full_windows == expected


# --- contents ----------------------------------------------------------------------------------


def test_windows_without_overlap(tmp_path, word_tokenizer):
    # stream: 10 11 12 E 13 14 E 15 16 17 18 E  (12 tokens; ids are word + 3)
    (tmp_path / "c.txt").write_text(f"{words(10, 11, 12)}\n{words(13, 14)}\n{words(15, 16, 17, 18)}\n")
    bundle = build(register(tmp_path, "c.txt"), word_tokenizer, cutoff_len=5)
    assert windows(bundle) == [
        ([13, 14, 15, EOS, 16], [13, 14, 15, EOS, 16]),
        ([17, EOS, 18, 19, 20], [17, EOS, 18, 19, 20]),
        ([21, EOS], [21, EOS]),  # tail of 2 kept
    ]
    assert bundle.report["train"] == {
        "documents": 3, "tokens": 12, "window": 5, "stride": 5, "windows": 3, "full_windows": 2, "tail": "keep",
        "tail_tokens": 2, "dropped_tail_tokens": 0, "target_tokens": 12 - 3,
    }


def test_overlap_tokens_are_context_only(tmp_path, word_tokenizer):
    # stream positions 0..14: ids 3..8 E 9..12 E 13 14 E  → the docstring's W=6, S=4 example
    (tmp_path / "c.txt").write_text(f"{words(0, 1, 2, 3, 4, 5)}\n{words(6, 7, 8, 9)}\n{words(10, 11)}\n")
    stream = [3, 4, 5, 6, 7, 8, EOS, 9, 10, 11, 12, EOS, 13, 14, EOS]
    bundle = build(register(tmp_path, "c.txt"), word_tokenizer, cutoff_len=6, stride=4)
    assert windows(bundle) == [
        (stream[0:6], stream[0:6]),
        (stream[4:10], [X, X] + stream[6:10]),
        (stream[8:14], [X, X] + stream[10:14]),
        (stream[12:15], [X, X] + stream[14:15]),
    ]
    # Each stream position after the first is a target exactly once.
    targets = [start + i for (start, (_, labels)) in zip((0, 4, 8, 12), windows(bundle))
               for i, label in enumerate(labels) if i > 0 and label != X]
    assert sorted(targets) == list(range(1, 15)) and bundle.report["train"]["target_tokens"] == 14


def test_tail_drop_reports_the_dropped_tokens(tmp_path, word_tokenizer, caplog):
    (tmp_path / "c.txt").write_text(f"{words(0, 1, 2, 3, 4, 5)}\n{words(6, 7, 8, 9)}\n{words(10, 11)}\n")
    with caplog.at_level(logging.WARNING, logger="tunelab"):
        bundle = build(register(tmp_path, "c.txt"), word_tokenizer, cutoff_len=6, stride=4, tail="drop")
    assert len(bundle.train) == 3 and bundle.report["train"]["dropped_tail_tokens"] == 1
    assert "train: tail: drop dropped the last 1 tokens of the stream" in caplog.text


def test_short_corpus_with_tail_drop_fails_clearly(tmp_path, word_tokenizer):
    (tmp_path / "c.txt").write_text(f"{words(1, 2)}\n")
    with pytest.raises(DataError, match=r"^train: all 3 tokens are fewer than cutoff_len=6 and tail: drop drops them; set tail: keep or lower cutoff_len$"):
        build(register(tmp_path, "c.txt"), word_tokenizer, tail="drop")
    assert windows(build(tmp_path, word_tokenizer)) == [([4, 5, EOS], [4, 5, EOS])]  # keep: one short window


def test_windows_are_exact_across_map_batches_and_workers(tmp_path, word_tokenizer, monkeypatch):
    docs = [[(7 * d + i) % 150 for i in range(1 + d % 9)] for d in range(61)]
    (tmp_path / "c.txt").write_text("".join(words(*doc) + "\n" for doc in docs))
    stream = [t for doc in docs for t in [i + 3 for i in doc] + [EOS]]
    monkeypatch.setattr(pretrain, "TOKENIZE_BATCH", 7)
    monkeypatch.setattr(pretrain, "WINDOW_BATCH", 3)
    for workers in (None, 2):
        bundle = build(register(tmp_path, "c.txt"), word_tokenizer, cutoff_len=16, stride=5,
                       preprocessing_num_workers=workers, overwrite_cache=True)
        got = [row["input_ids"] for row in bundle.train]
        full = (len(stream) - 16) // 5 + 1
        assert got[:full] == [stream[s : s + 16] for s in range(0, full * 5, 5)]
        assert got[full:] == [stream[full * 5 :]] and (full - 1) * 5 + 16 < len(stream)  # a tail exists
        assert bundle.report["train"]["target_tokens"] == len(stream) - 1


# --- cleaning -------------------------------------------------------------------------------------


def test_empty_and_short_documents_are_dropped_and_counted(tmp_path, word_tokenizer, caplog):
    rows = [{"text": f"  {words(1, 2, 3)}  "}, {"text": ""}, {"text": "   "}, {"text": None}, {"text": words(4)},
            {"text": words(5, 6)}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING, logger="tunelab"):
        bundle = build(register(tmp_path, "c.jsonl"), word_tokenizer, min_length=2)
    source = bundle.report["sources"][0]
    assert {k: source[k] for k in ("documents", "kept", "dropped_empty", "dropped_short", "tokens")} == {
        "documents": 6, "kept": 2, "dropped_empty": 3, "dropped_short": 1, "tokens": 7,
    }
    assert windows(bundle) == [([4, 5, 6, EOS, 8, 9], [4, 5, 6, EOS, 8, 9]), ([EOS], [EOS])]
    assert "dataset corpus: dropped 4 of 6 documents: 3 empty, 1 shorter than min_length=2 tokens" in caplog.text


def test_no_usable_document_is_an_error(tmp_path, word_tokenizer):
    (tmp_path / "c.txt").write_text("\n  \nw1\n")
    with pytest.raises(DataError, match=r"^dataset 'corpus': no usable documents \(all 3 were empty or shorter than min_length=5 tokens\); check text_column or lower min_length$"):
        build(register(tmp_path, "c.txt"), word_tokenizer, min_length=5)


def test_non_text_column_is_an_error(tmp_path, word_tokenizer):
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": 5}) + "\n")
    with pytest.raises(DataError, match=r"^dataset 'corpus': column 'text' holds int values, not text; set text_column"):
        build(register(tmp_path, "c.jsonl"), word_tokenizer)


# --- sources: txt modes, file types, columns, folders and globs -----------------------------------


TXT = f"{words(1, 2)}\n{words(3)}\n\n{words(4, 5)}\n"


@pytest.mark.parametrize(("sample_by", "documents", "stream"), [
    ("line", 4, [4, 5, EOS, 6, EOS, 7, 8, EOS]),  # the blank line is an empty document, dropped
    ("paragraph", 2, [4, 5, 6, EOS, 7, 8, EOS]),
    ("document", 1, [4, 5, 6, 7, 8, EOS]),
])
def test_txt_sample_by(tmp_path, word_tokenizer, sample_by, documents, stream):
    (tmp_path / "c.txt").write_text(TXT)
    bundle = build(register(tmp_path, "c.txt"), word_tokenizer, cutoff_len=32, txt_sample_by=sample_by)
    assert bundle.report["sources"][0]["documents"] == documents
    assert windows(bundle) == [(stream, stream)]


def _write(path: Path, rows: list[dict]) -> None:
    table = pa.Table.from_pylist(rows)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        table.to_pandas().to_csv(path, index=False)
    elif path.suffix == ".parquet":
        pq.write_table(table, path)
    elif path.suffix == ".arrow":
        with pa.ipc.new_stream(str(path), table.schema) as writer:
            writer.write_table(table)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet", ".arrow"])
def test_every_file_type(tmp_path, word_tokenizer, suffix):
    _write(tmp_path / f"c{suffix}", [{"id": 1, "text": words(1, 2)}, {"id": 2, "text": words(3)}])
    bundle = build(register(tmp_path, f"c{suffix}"), word_tokenizer, cutoff_len=32)
    assert windows(bundle) == [([4, 5, EOS, 6, EOS], [4, 5, EOS, 6, EOS])]


def test_text_column_choice(tmp_path, word_tokenizer):
    _write(tmp_path / "c.jsonl", [{"content": words(1), "body": words(2)}])
    assert windows(build(register(tmp_path, "c.jsonl"), word_tokenizer))[0][0] == [4, EOS]  # content fallback
    assert windows(build(tmp_path, word_tokenizer, text_column="body"))[0][0] == [5, EOS]
    assert windows(build(register(tmp_path, "c.jsonl", columns={"prompt": "body"}), word_tokenizer))[0][0] == [5, EOS]
    with pytest.raises(DataError, match=r"^dataset 'corpus': no column 'title' \(text_column\); columns: content, body; set text_column to the column holding the documents$"):
        build(tmp_path, word_tokenizer, text_column="title")
    _write(tmp_path / "c.jsonl", [{"body": words(2)}])
    with pytest.raises(DataError, match=r"^dataset 'corpus': no 'text' or 'content' column \(columns: body\); set text_column to the column holding the documents$"):
        build(register(tmp_path, "c.jsonl"), word_tokenizer)


def test_folder_and_glob_concatenate_files_in_name_order(tmp_path, word_tokenizer):
    folder = tmp_path / "shards"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text(words(2) + "\n")
    (folder / "a.txt").write_text(words(1) + "\n")
    (folder / "sub" / "c.txt").write_text(words(3) + "\n")
    by_folder = build(register(tmp_path, "shards"), word_tokenizer, cutoff_len=32)
    assert windows(by_folder)[0][0] == [4, EOS, 5, EOS, 6, EOS]
    by_glob = build(register(tmp_path, "shards/*.txt"), word_tokenizer, cutoff_len=32)
    assert windows(by_glob)[0][0] == [4, EOS, 5, EOS]


def test_val_split_is_by_document_and_eval_sets_are_windowed(tmp_path, word_tokenizer):
    (tmp_path / "c.txt").write_text("".join(words(i, i + 1, i + 2) + "\n" for i in range(20)))
    bundle = build(register(tmp_path, "c.txt"), word_tokenizer, cutoff_len=8, val_size=5)
    assert bundle.report["train"]["documents"] == 15 and bundle.report["eval:val"]["documents"] == 5
    assert bundle.report["eval:val"]["tokens"] == 20 and len(bundle.eval["val"]) == 3
    with pytest.raises(DataError, match=r"^val_size=20 leaves no training documents \(the train set has 20\)$"):
        build(tmp_path, word_tokenizer, val_size=20)


def test_tokenizer_without_eos_is_a_config_error(tmp_path, word_tokenizer):
    from transformers import PreTrainedTokenizerFast

    plain = PreTrainedTokenizerFast(tokenizer_object=word_tokenizer.backend_tokenizer, unk_token="<unk>")
    (tmp_path / "c.txt").write_text("w1\n")
    with pytest.raises(ConfigError, match=r"^model_name_or_path: the tokenizer has no eos_token"):
        build(register(tmp_path, "c.txt"), plain)


# --- the built-in corpus --------------------------------------------------------------------------


def test_builtin_corpus_is_deterministic_text():
    registry = load_registry()
    assert registry["demo_corpus"].formatting == "text" and registry["demo_corpus_test"].split == "test"
    first = load_rows(registry["demo_corpus"]).select(range(5)).to_list()
    assert first == load_rows(registry["demo_corpus"]).select(range(5)).to_list()
    assert all(isinstance(r["text"], str) and r["text"].endswith(".") for r in first)
    assert first != load_rows(registry["demo_corpus_test"]).select(range(5)).to_list()


def test_unknown_generator_lists_both_modules(tmp_path):
    (tmp_path / "dataset_info.json").write_text(json.dumps({"x": {"generator": "nope", "formatting": "text"}}))
    with pytest.raises(ConfigError, match=r"^dataset 'x': unknown generator 'nope' \(available: .*corpus.*reverse"):
        load_rows(load_registry(str(tmp_path))["x"])


def test_demo_corpus_through_the_tiny_tokenizer(tiny_tokenizer):
    args = DataArguments(dataset=["demo_corpus"], max_samples=50, cutoff_len=64, stride=48)
    bundle = build_pretrain_datasets(args, tiny_tokenizer, seed=0)
    report = bundle.report["train"]
    assert report["full_windows"] == (report["tokens"] - 64) // 48 + 1
    assert report["target_tokens"] == report["tokens"] - 1
    assert all(len(ids) == 64 for ids in bundle.train["input_ids"][: report["full_windows"]])
    assert isinstance(bundle.train, datasets.Dataset)


# --- LlamaFactory habits: mixed text/content rows, BOS, pt entries without a formatting -------------------


def test_rows_mixing_text_and_content_keep_every_document(tmp_path, word_tokenizer):
    # One JSONL with both fields: the reader gives every row both columns, null where absent.
    _write(tmp_path / "c.jsonl", [{"text": words(1)}, {"content": words(2, 3)}, {"text": words(4)}, {"other": 1}])
    bundle = build(register(tmp_path, "c.jsonl"), word_tokenizer, cutoff_len=32)
    source = bundle.report["sources"][0]
    assert (source["kept"], source["dropped_empty"], source["documents_by_column"]) == (3, 1, {"text": 2, "content": 1})
    assert windows(bundle)[0][0] == [4, EOS, 5, 6, EOS, 7, EOS]
    # text_column takes a list: each row's first column with text, in that order
    _write(tmp_path / "c.jsonl", [{"body": words(1), "title": words(9)}, {"title": words(2)}])
    bundle = build(tmp_path, word_tokenizer, cutoff_len=32, text_column=["body", "title"])
    assert windows(bundle)[0][0] == [4, EOS, 5, EOS]


def bos_tokenizer(adds_bos: bool):
    """Word-level tokenizer ("w<i>" → i + 4; <s> 3, </s> 2) that declares <s> and, if `adds_bos`, adds it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2, "<s>": 3} | {f"w{i}": i + 4 for i in range(50)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if adds_bos:  # what Llama's tokenizer.json does
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize(("adds_bos", "stream"), [(True, [3, 5, 6, EOS, 3, 7, EOS]), (False, [5, 6, EOS, 7, EOS])])
def test_documents_start_with_bos_when_the_tokenizer_adds_it(tmp_path, adds_bos, stream):
    tokenizer = bos_tokenizer(adds_bos)
    assert tokenizer(words(1))["input_ids"][:1] == ([3] if adds_bos else [5])
    assert pretrain.document_bos_id(tokenizer) == (3 if adds_bos else None)
    (tmp_path / "c.txt").write_text(f"{words(1, 2)}\n{words(3)}\n")
    bundle = build(register(tmp_path, "c.txt"), tokenizer, cutoff_len=32, min_length=2)  # BOS/EOS not counted
    assert bundle.report["sources"][0]["kept"] == 1
    bundle = build(register(tmp_path, "c.txt"), tokenizer, cutoff_len=32)
    assert windows(bundle) == [(stream, stream)]
    assert bundle.report["sources"][0]["tokens"] == bundle.report["train"]["tokens"] == len(stream)
    packed = build(register(tmp_path, "c.txt"), tokenizer, cutoff_len=32, packing=True)
    assert sorted(len(ids) for ids in packed.train["input_ids"]) == [len(stream)]


def test_the_embedded_tiny_tokenizer_declares_bos_but_does_not_add_it(tiny_tokenizer):
    assert tiny_tokenizer.bos_token == "<s>" and pretrain.document_bos_id(tiny_tokenizer) is None


def test_llamafactory_pretraining_entries_read_as_documents(tmp_path, word_tokenizer):
    # LlamaFactory's own dataset_info.json: {"c4_demo": {"file_name": ..., "columns": {"prompt": "text"}}}
    _write(tmp_path / "c4.jsonl", [{"text": words(1, 2)}, {"text": words(3)}])
    (tmp_path / "dataset_info.json").write_text(json.dumps({"corpus": {"file_name": "c4.jsonl", "columns": {"prompt": "text"}}}))
    assert windows(build(tmp_path, word_tokenizer, cutoff_len=32)) == [([4, 5, EOS, 6, EOS], [4, 5, EOS, 6, EOS])]
    spec = load_registry(str(tmp_path))["corpus"]
    assert (spec.formatting, spec.reads_documents) == ("alpaca", True)
    # a formatting the entry names is kept to: an alpaca set is not a corpus
    (tmp_path / "dataset_info.json").write_text(json.dumps({"corpus": {"file_name": "c4.jsonl", "formatting": "alpaca"}}))
    assert not load_registry(str(tmp_path))["corpus"].reads_documents


# ---- bounded memory per document: long documents are tokenised in pieces, exactly -------------------------


def _prose(words_count: int) -> str:
    import random

    rng = random.Random(3)
    vocabulary = ["alpha", "beta,", "Gamma", "(delta)", "42", "naïve", "東京", "--", "x" * 25]
    return "".join(rng.choice(vocabulary) + rng.choice([" ", " ", " ", "  ", "\n", "\n\n"]) for _ in range(words_count))


def _legacy_sentencepiece_tokenizer():
    """A tokenizer whose normalizer prepends "▁" to every text (old Llama-2 style): a piece tokenised on its own
    gets an extra "▁", so cutting changes tokens and the document must be tokenised whole."""
    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.train_from_iterator([_prose(300)], trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


@pytest.mark.parametrize("name", ["byte-level BPE (tiny)", "legacy SentencePiece (cuts change tokens)"])
def test_a_long_document_is_tokenised_in_pieces_exactly(tiny_tokenizer, monkeypatch, name):
    from tunelab.data.encode import PieceTokenizer

    tokenizer = tiny_tokenizer if "tiny" in name else _legacy_sentencepiece_tokenizer()
    document = _prose(3000)  # ~22,000 characters
    monkeypatch.setattr(pretrain, "LONG_DOCUMENT_CHARS", 2048)  # ~10 pieces
    longest = []
    raw = PieceTokenizer._raw
    monkeypatch.setattr(PieceTokenizer, "_raw",
                        lambda self, texts: longest.append(max(map(len, texts))) or raw(self, texts))
    function = pretrain.DocumentTokenizer(tokenizer, ("text",), 1, "corpus")
    out = function({"text": [document, "short one"]})
    whole = tokenizer([document.strip(), "short one"], add_special_tokens=False)["input_ids"]
    assert [list(ids) for ids in out["input_ids"]] == [ids + [tokenizer.eos_token_id] for ids in whole]
    pieces = "tiny" in name  # the legacy tokenizer fails the seam check and is tokenised whole
    assert (max(longest) < 2048 + 4 * pretrain._SEAM_WINDOW) == pieces


def test_long_documents_mixed_with_short_and_empty_ones_map_into_one_column(tiny_tokenizer, monkeypatch):
    """datasets.map writes the batch to arrow: arrays and lists (an empty one reads as float) must not mix."""
    monkeypatch.setattr(pretrain, "LONG_DOCUMENT_CHARS", 500)
    long = _prose(400)
    function = pretrain.DocumentTokenizer(tiny_tokenizer, ("text",), 1, "corpus")
    rows = {"text": [long, "short one", "", long[:100]]}
    mapped = datasets.Dataset.from_dict(rows).map(function, batched=True, batch_size=2, remove_columns=["text"])
    expected = [ids + [tiny_tokenizer.eos_token_id] if ids else [] for ids in tiny_tokenizer(
        [long.strip(), "short one", "", long[:100].strip()], add_special_tokens=False)["input_ids"]]
    assert mapped["input_ids"] == expected
    short_only = datasets.Dataset.from_dict({"text": ["short one"]}).map(function, batched=True, remove_columns=["text"])
    assert mapped.features == short_only.features  # batches with and without a long document agree
