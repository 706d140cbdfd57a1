"""Bad input → exact behaviour, through the real CLI (`tunelab.cli.main`).

Errors: exit code 2 and exactly one line on stderr, naming the file and line or the key, and the fix.
Rows that are dropped, skipped or truncated instead: exit 0 and an explicit count in data_report.json.
The data files live beside this module in data/<case>/ (dataset_info.json + data.jsonl).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import transformers
import yaml

from tunelab.assets import TINY_MODEL_DIR
from tunelab.cli import main

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(autouse=True)
def quiet_progress_bars():
    """Progress bars write to stderr too; the assertions below read stderr whole."""
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    yield
    datasets.enable_progress_bars()
    transformers.utils.logging.enable_progress_bar()


def write_config(tmp_path: Path, **options) -> Path:
    config = {
        "model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_reverse", "max_samples": 8,
        "cutoff_len": 64, "output_dir": str(tmp_path / "out"), "max_steps": 1, "per_device_train_batch_size": 2,
        "disable_tqdm": True, "plot_loss": False, **options,
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train(tmp_path: Path, capsys, **options) -> tuple[int, str]:
    code = main(["train", str(write_config(tmp_path, **options))])
    return code, capsys.readouterr().err


def copy_of_tiny(tmp_path: Path, without: str) -> Path:
    folder = tmp_path / f"tiny-without-{without}"
    shutil.copytree(TINY_MODEL_DIR, folder)
    (folder / without).unlink()
    return folder


# (case, options or a function of tmp_path giving them, the expected message with {data} / {tmp} placeholders)
ERRORS = [
    ("malformed JSON line", {"dataset": "mine", "dataset_dir": "{data}/malformed_json"},
     "{data}/malformed_json/data.jsonl:2: Expecting value; fix or remove that line"),
    ("missing mapped column", {"dataset": "mine", "dataset_dir": "{data}/missing_column"},
     "dataset 'mine' ({data}/missing_column/data.jsonl): column 'question' (mapped as prompt) is missing; the file "
     "has instruction, output — set columns.prompt in dataset_info.json"),
    ("wrong role order", {"dataset": "mine", "dataset_dir": "{data}/role_order"},
     "dataset 'mine' row 0 ({data}/role_order/data.jsonl:1): turn 0 is assistant, expected a user/tool turn (roles "
     "must alternate); or set skip_bad_rows: true to skip such rows (counted per reason)"),
    # data is never silently changed: every error names the file and the row's line
    ("a list where text belongs", {"dataset": "mine", "dataset_dir": "{data}/not_text"},
     "dataset 'mine' row 1 ({data}/not_text/data.jsonl:2): column 'instruction' holds a list, not text ([\"Sort\", "
     "\"3 1 2\"]); write the text itself; or set skip_bad_rows: true to skip such rows (counted per reason)"),
    ("a null sharegpt turn", {"dataset": "mine", "dataset_dir": "{data}/null_turn"},
     "dataset 'mine' row 1 ({data}/null_turn/data.jsonl:2) turn 0: 'value' is missing (null); write the user turn's "
     "text; or set skip_bad_rows: true to skip such rows (counted per reason)"),
    ("a JSON-lines line that is an array", {"dataset": "mine", "dataset_dir": "{data}/array_line"},
     "{data}/array_line/data.jsonl:2: a JSON array, not a row object ({{\"column\": value, ...}}); fix or remove "
     "that line"),
    ("a ragged CSV row", {"dataset": "mine", "dataset_dir": "{data}/ragged_csv"},
     "{data}/ragged_csv/data.csv:3: 3 fields where the header has 2; give every row the header's columns (quote "
     "values that contain commas)"),
    ("an empty file", {"dataset": "mine", "dataset_dir": "{data}/empty_file"},
     "{data}/empty_file/data.jsonl: the file is empty; add rows or remove it from the dataset"),
    ("a top-level JSON object", {"dataset": "mine", "dataset_dir": "{data}/top_level_object"},
     "{data}/top_level_object/data.json: the file is one JSON object, not rows; write a JSON array of row objects "
     "([{{...}}, {{...}}]) or one object per line (.jsonl)"),
    ("dataset_info.json is a list", {"dataset": "mine", "dataset_dir": "{data}/info_list"},
     "{data}/info_list/dataset_info.json: dataset_info.json holds a JSON array; it must map each dataset name to an "
     "object of its settings, e.g. {{\"my_data\": {{\"file_name\": \"data.jsonl\"}}}}"),
    ("an entry that is a string", {"dataset": "mine", "dataset_dir": "{data}/info_string"},
     "{data}/info_string/dataset_info.json: dataset 'mine' is a string, not an object of settings; write it as "
     "{{\"file_name\": ...}}, e.g. {{\"my_data\": {{\"file_name\": \"data.jsonl\"}}}}"),
    ("non-UTF-8 bytes", {"dataset": "mine", "dataset_dir": "{data}/not_utf8"},
     "{data}/not_utf8/data.jsonl:2: not UTF-8 (byte 0xe9); re-encode the file as UTF-8"),
    ("images column mapped", {"dataset": "mine", "dataset_dir": "{data}/images_mapped"},
     "dataset 'mine' ({data}/images_mapped/data.jsonl) maps columns.images, but model_name_or_path is a text-only "
     "model and would ignore the images: remove columns.images, or train a vision-language model (a folder with its "
     "processor)"),
    ("images in sharegpt rows", {"dataset": "mine", "dataset_dir": "{data}/images_in_rows"},
     "dataset 'mine' ({data}/images_in_rows/data.jsonl): 1 rows have images, but model_name_or_path is a text-only "
     "model and would ignore the images: remove the 'images' field from the rows, or train a vision-language model (a "
     "folder with its processor)"),
    ("unknown template", {"template": "chatml2"},
     "template: 'chatml2' does not exist; did you mean 'chatml'? built-ins: {templates}"),
    ("missing model folder", {"model_name_or_path": "{tmp}/no-model"},
     "model_name_or_path: {tmp}/no-model is not a folder; point it at a local Hugging Face model folder"),
    ("config.json without weights", lambda tmp: {"model_name_or_path": str(copy_of_tiny(tmp, "model.safetensors"))},
     "model_name_or_path: cannot load the model from {tmp}/tiny-without-model.safetensors: Error no file named "
     "model.safetensors, or pytorch_model.bin, found in directory {tmp}/tiny-without-model.safetensors."),
    ("weights without config.json", lambda tmp: {"model_name_or_path": str(copy_of_tiny(tmp, "config.json"))},
     "model_name_or_path: {tmp}/tiny-without-config.json has no config.json; is it a complete Hugging Face model "
     "folder?"),
    ("typo'd key", {"learning_rat": 1e-3},
     "unknown key 'learning_rat' in {tmp}/cfg.yaml; did you mean 'learning_rate'?"),
    ("wrong type", {"learning_rate": "fast"}, "learning_rate: expected float, got 'fast'"),
    ("wrong choice", {"finetuning_type": "lora2"}, "finetuning_type: 'lora2' is not one of lora, oft, vera, freeze, full"),
    ("missing deepspeed file", {"deepspeed": "{tmp}/ds.json"},
     "deepspeed: {tmp}/ds.json does not exist; point it at a DeepSpeed JSON config "
     "(examples/deepspeed/ds_z2_config.json or ds_z3_config.json)"),
    ("fsdp on cpu, one process", {"fsdp": True, "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}},
     "fsdp: one process has nothing to shard with; set nproc_per_node: 2 or more"),
    ("fsdp offload on cpu", {"fsdp": "full_shard offload", "nproc_per_node": 2},
     "fsdp on CPU: offloading needs GPUs (accelerate's FSDP); on CPU tunelab shards every layer with FSDP2 full_shard "
     "(fsdp: true or full_shard, reshard_after_forward: true, state_dict_type: FULL_STATE_DICT)"),
    ("fsdp checkpoints on cpu", {"fsdp": True, "nproc_per_node": 2, "save_steps": 2},
     "fsdp on CPU cannot checkpoint the optimizer of its sharded model: set save_only_model: true (checkpoints hold "
     "the gathered model; resume them with resume_weights_only: true) or save_strategy: no; sharded optimizer "
     "checkpoints need GPUs (accelerate's FSDP)"),
    ("fsdp with qlora", {"fsdp": "full_shard", "quantization_bit": 4, "use_cpu": False},
     "fsdp cannot shard the 4-bit weights of quantization_bit (QLoRA); remove fsdp (QLoRA trains one copy per "
     "process with DDP) or quantization_bit"),
    ("nproc_per_node below 1", {"nproc_per_node": 0}, "nproc_per_node: expected at least 1 process, got 0"),
    ("skip_bad_rows with streaming", {"skip_bad_rows": True, "streaming": True},
     "skip_bad_rows applies to conversation datasets read whole (not stage pt, not streaming: true): remove it"),
    # numbers that torch trips over (or trains nonsense with): stopped before any model loads
    ("negative learning_rate", {"learning_rate": -1e-3},
     "learning_rate must be a number > 0, got -0.001; typical values: 1e-4 to 2e-4 for LoRA, 1e-5 for full fine-tuning"),
    ("batch size 0", {"per_device_train_batch_size": 0},
     "per_device_train_batch_size must be at least 1, got 0; it is the rows per device in a micro-batch; to use less "
     "memory raise gradient_accumulation_steps instead"),
    ("gradient_accumulation_steps 0", {"gradient_accumulation_steps": 0},
     "gradient_accumulation_steps must be at least 1, got 0; 1 takes one micro-batch per optimizer step"),
    ("max_steps 0", {"max_steps": 0},
     "max_steps must be at least 1, or -1, got 0; set the number of optimizer steps, or -1 to train num_train_epochs"),
    ("no steps and no epochs", {"max_steps": -1, "num_train_epochs": 0},
     "num_train_epochs: 0 trains nothing (max_steps is -1, so the epochs decide the length); set num_train_epochs > 0 "
     "or max_steps"),
    ("save_steps 0", {"save_steps": 0},
     "save_steps must be a number > 0, got 0; it is the steps between checkpoints, or a ratio of the total below 1"),
    ("learning_rate nan", {"learning_rate": float("nan")},
     "learning_rate must be a number > 0, got nan; typical values: 1e-4 to 2e-4 for LoRA, 1e-5 for full fine-tuning"),
    ("adam_beta2 1", {"adam_beta2": 1.0}, "adam_beta2 must be in [0, 1), got 1; the default is 0.999"),
    ("negative warmup_steps", {"warmup_steps": -1},
     "warmup_steps must be a number >= 0, got -1; it is a number of steps, or a ratio of the total below 1"),
    ("logging_steps 0", {"logging_steps": 0},
     "logging_steps must be a number > 0, got 0; it is the steps between log lines, or a ratio of the total below 1"),
    ("eval batch size 0", {"per_device_eval_batch_size": 0},
     "per_device_eval_batch_size must be at least 1, got 0; it is the rows per device in an evaluation batch"),
    ("negative num_train_epochs", {"num_train_epochs": -1},
     "num_train_epochs must be a number >= 0, got -1; it is the number of passes over the training set"),
    ("negative dataloader_num_workers", {"dataloader_num_workers": -1},
     "dataloader_num_workers must be at least 0, got -1; 0 loads batches in the training process"),
    ("negative max_grad_norm", {"max_grad_norm": -1},
     "max_grad_norm must be a number >= 0, got -1; 0 turns gradient clipping off"),
]


@pytest.mark.parametrize("options, expected", [case[1:] for case in ERRORS], ids=[case[0] for case in ERRORS])
def test_bad_input_fails_with_one_line(tmp_path, capsys, options, expected):
    from tunelab.data.templates import TEMPLATE_NAMES

    options = options(tmp_path) if callable(options) else options
    options = {k: v.format(data=DATA, tmp=tmp_path) if isinstance(v, str) else v for k, v in options.items()}
    code, err = train(tmp_path, capsys, **options)
    message = expected.format(data=DATA, tmp=tmp_path, templates=", ".join(TEMPLATE_NAMES))
    assert (code, err) == (2, f"tunelab: error: {message}\n")


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed is installed here")
def test_deepspeed_not_installed(tmp_path, capsys):
    config = Path(__file__).resolve().parents[2] / "examples" / "deepspeed" / "ds_z2_config.json"
    code, err = train(tmp_path, capsys, deepspeed=str(config))
    assert (code, err) == (
        2, "tunelab: error: deepspeed is set but the deepspeed package is not installed: pip install 'tunelab[deepspeed]'\n"
    )


def test_output_dir_not_writable(tmp_path, capsys):
    """A read-only tmpfs where we may mount one (root), else a folder without write permission."""
    locked = tmp_path / "locked"
    locked.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(locked)], capture_output=True
    ).returncode == 0
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("root without mount: permissions do not stop root")
        locked.chmod(0o555)
    try:
        code, err = train(tmp_path, capsys, output_dir=str(locked / "out"))
    finally:
        subprocess.run(["umount", str(locked)], check=False) if mounted else locked.chmod(0o755)
    assert (code, err) == (
        2, f"tunelab: error: output_dir: {locked}/out is not writable (it would be created in {locked}); "
        "choose a folder you can write to\n",
    )


@pytest.mark.slow
def test_disk_full_during_save_is_one_line(tmp_path):
    """RLIMIT_FSIZE in a child process: writing past 1 MB fails with EFBIG (SIGXFSZ ignored), as a full disk
    fails with ENOSPC; the 3.9 MB model.safetensors is the first file that large. The cache lives in tmp."""
    config = write_config(tmp_path, finetuning_type="full")
    script = (
        "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20)); "
        "import datasets, transformers; datasets.disable_progress_bars(); "
        "transformers.utils.logging.disable_progress_bar(); "
        f"from tunelab.cli import main; sys.exit(main(['train', {str(config)!r}]))"
    )
    env = {**os.environ, "TUNELAB_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith(("tunelab:", "Traceback"))]
    assert (result.returncode, errors) == (2, [
        f"tunelab: error: file too large while writing {tmp_path}/out: a file-size limit (ulimit -f) or the file "
        "system's maximum; raise the limit or change output_dir"
    ])
    assert not (tmp_path / "out" / "all_results.json").exists()  # the run is visibly unfinished


@pytest.mark.slow
def test_disk_full_on_a_tiny_tmpfs(tmp_path, capsys):
    """The real thing where we may mount: output_dir on a 1 MB tmpfs → ENOSPC while saving the weights."""
    out = tmp_path / "small"
    out.mkdir()
    if os.geteuid() != 0 or subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(out)], capture_output=True
    ).returncode != 0:
        pytest.skip("needs root to mount a tmpfs")
    try:
        code, err = train(tmp_path, capsys, finetuning_type="full", output_dir=str(out), overwrite_output_dir=True)
    finally:
        subprocess.run(["umount", str(out)], check=False)
    assert (code, err) == (
        2, f"tunelab: error: no space left on device while writing {out}: free space or change output_dir / "
        "TUNELAB_CACHE\n",
    )


# A checkpoint of the tiny model, full fine-tuning: weights 3.9 MB, optimizer 7.7 MB, ~12 MB in all. On a 14 MB
# tmpfs the second checkpoint's weights fail (safetensors, "os error 28"); on 17 MB its optimizer does (torch.save:
# "unexpected pos", no errno).
FULL_DURING_CHECKPOINT = {"weights (safetensors)": "14m", "optimizer (torch.save)": "17m"}


@pytest.mark.slow
@pytest.mark.parametrize("size", list(FULL_DURING_CHECKPOINT.values()), ids=list(FULL_DURING_CHECKPOINT))
def test_disk_full_during_a_checkpoint_keeps_the_previous_one(tmp_path, capsys, size):
    from tunelab.train.resume import checkpoint_problem, resolve_resume

    out = tmp_path / "small"
    out.mkdir()
    if os.geteuid() != 0 or subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(out)], capture_output=True
    ).returncode != 0:
        pytest.skip("needs root to mount a tmpfs")
    try:
        code, err = train(
            tmp_path, capsys, finetuning_type="full", output_dir=str(out / "run"), max_steps=4, save_steps=2,
            per_device_train_batch_size=4, max_samples=48,
        )
        left = sorted(p.name for p in (out / "run").iterdir() if "checkpoint" in p.name)
        previous = out / "run" / "checkpoint-2"
        problem = checkpoint_problem(previous)
        picked = resolve_resume(True, out / "run")
    finally:
        subprocess.run(["umount", str(out)], check=False)
    assert (code, err) == (
        2, f"tunelab: error: no space left on device while writing {out}/run: free space or change output_dir / "
        "TUNELAB_CACHE\n",
    )
    assert left == ["checkpoint-2"]  # the half-written checkpoint-4 removed
    assert (problem, picked) == (None, str(previous))  # the previous checkpoint intact, and the one resume picks


@pytest.mark.slow
def test_out_of_memory_says_what_to_lower(tmp_path):
    """A CPU out-of-memory in the first step, made certain by an address-space limit 1 GiB above the process's
    size: 128 rows of ~440 tokens need ~3.9 GiB of tensors (0.5 of it the padded batch's mask, made float in each
    layer). One line with the estimate and the fixes."""
    rows = [{"instruction": f"Repeat {i}", "output": " ".join(["alpha beta gamma delta"] * 110)} for i in range(128)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"long": {"file_name": "data.jsonl"}}))
    config = write_config(
        tmp_path, dataset="long", dataset_dir=str(tmp_path), cutoff_len=512, per_device_train_batch_size=128,
        finetuning_type="full", max_samples=None,
    )
    script = (
        "import resource, sys; import torch, datasets, transformers; datasets.disable_progress_bars(); "
        "transformers.utils.logging.disable_progress_bar(); from tunelab.cli import main; "
        "size = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize(); "
        "resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.RLIM_INFINITY)); "
        f"sys.exit(main(['train', {str(config)!r}]))"
    )
    env = {**os.environ, "TUNELAB_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith(("tunelab:", "Traceback"))]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert re.fullmatch(
        r"tunelab: error: out of CPU memory while training \(an allocation of [\d.]+ [KMG]iB failed\): `tunelab "
        r"estimate` puts a step of 128 x 512 tokens at 3\.54 GiB of tensors \(activations 3\.19 GiB, loss workspace "
        r"343\.58 MiB, weights \+ gradients \+ optimizer 14\.71 MiB\); lower per_device_train_batch_size \(now 128; "
        r"raise gradient_accumulation_steps to keep the batch\) or cutoff_len \(now 512\), set "
        r"gradient_checkpointing: true", errors[0],
    ), errors[0]


@pytest.mark.slow
def test_skip_bad_rows_skips_and_counts(tmp_path, caplog):
    code = main(["train", str(write_config(
        tmp_path, dataset="mine", dataset_dir=str(DATA / "bad_lines"), skip_bad_rows=True,
    ))])
    assert code == 0
    source = json.loads((tmp_path / "out" / "data_report.json").read_text())["sources"][0]
    assert (source["rows"], source["skipped_bad_rows"]) == (3, 3)
    path = DATA / "bad_lines" / "data.jsonl"
    assert f"dataset mine: skipped 3 rows (skip_bad_rows): unreadable_line, first: {path}:2: Expecting value" in caplog.messages


@pytest.mark.slow
def test_skip_bad_rows_skips_structural_faults_per_reason(tmp_path, caplog):
    code = main(["train", str(write_config(
        tmp_path, dataset="mine", dataset_dir=str(DATA / "bad_structure"), skip_bad_rows=True,
    ))])
    assert code == 0
    source = json.loads((tmp_path / "out" / "data_report.json").read_text())["sources"][0]
    path = DATA / "bad_structure" / "data.jsonl"
    assert source["rows"] == 5 and source["skipped_bad_rows"] == 3
    assert source["skipped_by_reason"] == {"unreadable_line": 1, "answer_first": 1, "ends_without_answer": 1}
    assert source["first_skipped"] == {
        "unreadable_line": f"{path}:4: Expecting ',' delimiter",
        "answer_first": f"dataset 'mine' row 1 ({path}:2): turn 0 is assistant, expected a user/tool turn (roles must "
                        "alternate)",
        "ends_without_answer": f"dataset 'mine' row 2 ({path}:3): the conversation must end with an assistant turn",
    }
    assert source["empty_answers"] == 1  # kept: it trains the end-of-turn
    assert (
        f"dataset mine: skipped 1 rows (skip_bad_rows): ends_without_answer, first: dataset 'mine' row 2 ({path}:3): "
        "the conversation must end with an assistant turn"
    ) in caplog.messages


# Rows that are kept but changed, or left out: exit 0 and the exact count in data_report.json's source.
COUNTS = [
    ("numbers in text fields", {"dataset_dir": "{data}/numbers"}, {"rows": 3, "numbers_as_text": 3}),
    ("a list where text belongs, skipped", {"dataset_dir": "{data}/not_text", "skip_bad_rows": True},
     {"rows": 2, "skipped_bad_rows": 1, "skipped_by_reason": {"not_text": 1}}),
    ("a null turn, skipped", {"dataset_dir": "{data}/null_turn", "skip_bad_rows": True},
     {"rows": 2, "skipped_bad_rows": 1, "skipped_by_reason": {"missing_content": 1}}),
]


@pytest.mark.slow
@pytest.mark.parametrize("options, counts", [case[1:] for case in COUNTS], ids=[case[0] for case in COUNTS])
def test_kept_or_skipped_rows_are_counted(tmp_path, options, counts):
    options = {k: v.format(data=DATA) if isinstance(v, str) else v for k, v in options.items()}
    assert main(["train", str(write_config(tmp_path, dataset="mine", **options))]) == 0
    source = json.loads((tmp_path / "out" / "data_report.json").read_text())["sources"][0]
    assert {key: source[key] for key in counts} == counts


@pytest.mark.slow
def test_empty_responses_are_kept_and_counted(tmp_path):
    assert main(["train", str(write_config(tmp_path, dataset="mine", dataset_dir=str(DATA / "empty_response")))]) == 0
    report = json.loads((tmp_path / "out" / "data_report.json").read_text())
    assert (report["sources"][0]["rows"], report["sources"][0]["empty_answers"]) == (4, 2)
    assert report["train"]["examples"] == 4


@pytest.mark.slow
def test_sample_longer_than_cutoff_is_truncated_and_counted(tmp_path):
    assert main(["train", str(write_config(tmp_path, dataset="mine", dataset_dir=str(DATA / "long_answer")))]) == 0
    train_report = json.loads((tmp_path / "out" / "data_report.json").read_text())["train"]
    assert (train_report["examples"], train_report["truncated"], train_report["dropped_no_supervised"]) == (2, 1, 0)


@pytest.mark.slow
def test_tokenizer_without_pad_token_falls_back_to_eos(tmp_path, caplog, tiny_llama_dir):
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tiny_llama_dir).pad_token is None
    assert main(["train", str(write_config(tmp_path, model_name_or_path=str(tiny_llama_dir)))]) == 0
    assert "The tokenizer has no pad token: padding with its eos token '</s>'." in caplog.messages
