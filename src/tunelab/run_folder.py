"""A run's output folder: the names of the files tunelab writes there, their readers and writers, and what a trained
folder says about how to run it (TrainedFolder).

A leaf: it imports nothing of tunelab and no ML library, so training, evaluation, serving, export, the web UI and the
light commands all read and write run folders through it, with one spelling of every file name.

    output_dir/
      tunelab_config.yaml     RUN_RECORD   every resolved option            write_run_record / read_run_record
      trainer_log.jsonl       LOG_FILE     one JSON object per log event    append_log / rewrite_log / read_log
      completions.jsonl       COMPLETIONS  grpo's rollouts: prompt, completion, rewards    append_records
      all_results.json        RESULTS      final metrics, peak memory       write_json / read_json
      data_report.json        DATA_REPORT  rows, tokens, drops
      run_info.json           RUN_INFO     library versions, Hub commits
      predictions.jsonl, predict_results.json    tunelab eval / do_predict
      data_stats/             DATA_STATS_DIR   tunelab data stats (the output_dir check ignores it)
      export_report.json      EXPORT_REPORT    tunelab export's parity check
      checkpoint-N/           trainer_state.json, tunelab_state.json, the run record, and tunelab_manifest.json,
                              written last: the size and SHA-256 of every other file (a checkpoint is complete
                              when its manifest is there; train/checkpoints.py verifies and resumes them)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

RUN_RECORD = "tunelab_config.yaml"
LOG_FILE = "trainer_log.jsonl"
COMPLETIONS = "completions.jsonl"
RESULTS = "all_results.json"
DATA_REPORT = "data_report.json"
RUN_INFO = "run_info.json"
PREDICTIONS = "predictions.jsonl"
PREDICT_RESULTS = "predict_results.json"
DATA_STATS_DIR = "data_stats"
EXPORT_REPORT = "export_report.json"
CHAT_TEMPLATE = "chat_template.jinja"  # transformers' file for a tokenizer's chat template

CHECKPOINT_PREFIX = "checkpoint"  # transformers' PREFIX_CHECKPOINT_DIR
STAGING_PREFIX = "tmp-checkpoint"  # older tunelab staged saves in tmp-checkpoint-N; a run removes leftovers
TRAINER_STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME
RUN_STATE = "tunelab_state.json"
MANIFEST = "tunelab_manifest.json"
MANIFEST_FORMAT = 1

_CHECKPOINT_RE = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")
_HASH_CHUNK = 1 << 24


# ---- the run record, JSON files ----------------------------------------------------------------------------


def write_run_record(folder: str | Path, options: dict[str, Any]) -> Path:
    """folder/tunelab_config.yaml: every option the run resolved, in the order given (YAML values)."""
    path = Path(folder) / RUN_RECORD
    path.write_text(yaml.safe_dump(options, sort_keys=False, default_flow_style=None), encoding="utf-8")
    return path


def read_run_record(folder: str | Path) -> dict[str, Any] | None:
    """The options a tunelab run recorded in folder/tunelab_config.yaml; None where there is no readable record
    (not a tunelab folder, or a damaged file: callers then go on without what it would have said)."""
    try:
        options = yaml.safe_load((Path(folder) / RUN_RECORD).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return options if isinstance(options, dict) else None


def write_json(folder: str | Path, name: str, data: Any) -> Path:
    """folder/name as indented JSON. In a distributed run only global rank 0 writes: the other ranks hold the same
    data and would race on the same file."""
    path = Path(folder) / name
    if int(os.environ.get("RANK", "0")) != 0:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def read_json(path: str | Path) -> Any:
    """A JSON file's value; None when it is missing or does not parse (a run still writing it, or none)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


# ---- the training log ------------------------------------------------------------------------------------------


def read_log(folder: str | Path) -> list[dict[str, Any]]:
    """The records of folder/trainer_log.jsonl. A line still being written (no newline yet, or cut by a kill) is
    not a record: the web UI reads the log while the run writes it, and a resume reads what a killed run left."""
    try:
        text = (Path(folder) / LOG_FILE).read_text(encoding="utf-8")
    except OSError:
        return []
    records = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def append_log(folder: str | Path, record: dict[str, Any]) -> None:
    append_records(folder, LOG_FILE, [record])


def append_records(folder: str | Path, name: str, records: list[dict[str, Any]]) -> None:
    """Append one JSON line per record to folder/name."""
    with (Path(folder) / name).open("a", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))


def rewrite_log(folder: str | Path, records: list[dict[str, Any]]) -> None:
    """The log as exactly these records (a fresh run: none; a resumed one: those up to its checkpoint)."""
    path = Path(folder) / LOG_FILE
    if not records:
        path.unlink(missing_ok=True)
        return
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


# ---- which example writes a run folder -------------------------------------------------------------------------

EXAMPLES_DIR = "examples"  # the repo's example configs, read from the folder tunelab runs in (a clone's root)


def example_output_dirs() -> dict[Path, Path]:
    """{output_dir, resolved: the example config that writes it} of the configs under ./examples (sub-folders too).
    A missing folder one of them names is a run not made yet (examples/kto.yaml reads saves/sft_base before
    examples/sft_base.yaml has written it), never a Hub id. An unreadable config is passed over: this only finds
    hints for messages."""
    found: dict[Path, Path] = {}
    for config in sorted(Path(EXAMPLES_DIR).rglob("*.yaml")):
        try:
            options = yaml.safe_load(config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        output_dir = options.get("output_dir") if isinstance(options, dict) else None
        if isinstance(output_dir, str):
            found.setdefault(Path(output_dir).expanduser().resolve(), config)
    return found


# ---- checkpoints and their manifests ---------------------------------------------------------------------------


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checksums(folder: Path, names: list[str]) -> dict[str, str]:
    """SHA-256 of each file, several files at once (hashlib releases the GIL on large buffers)."""
    with ThreadPoolExecutor(max_workers=min(8, max(len(names), 1))) as pool:
        return dict(zip(names, pool.map(lambda name: file_sha256(folder / name), names)))


def write_manifest(folder: str | Path, step: int, optimizer_state: bool) -> dict[str, Any]:
    """Record the size and SHA-256 of every file under folder in tunelab_manifest.json (written last)."""
    folder = Path(folder)
    names = sorted(
        str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file() and path.name != MANIFEST
    )
    sums = checksums(folder, names)
    manifest = {
        "format": MANIFEST_FORMAT, "global_step": step, "optimizer_state": optimizer_state,
        "files": {name: {"size": (folder / name).stat().st_size, "sha256": sums[name]} for name in names},
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    """The manifest of a checkpoint folder, or None when it has none that parses."""
    manifest = read_json(Path(folder) / MANIFEST)
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def checkpoint_step(path: str | Path) -> int | None:
    match = _CHECKPOINT_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete(path: str | Path) -> bool:
    """A checkpoint folder whose manifest, written last, is there and parses (a kill while it was written leaves it
    cut short). Whether the files match it is checked before a resume (train/checkpoints.py: checkpoint_problem)."""
    return isinstance(read_json(Path(path) / MANIFEST), dict)


def checkpoint_folders(output_dir: str | Path) -> list[Path]:
    """Every `checkpoint-N` folder of output_dir, complete or not, oldest step first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in out.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return [p for _, p in sorted(found)]


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete `checkpoint-N` folders of output_dir, oldest step first."""
    return [p for p in checkpoint_folders(output_dir) if is_complete(p)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    checkpoints = complete_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


# ---- a trained folder ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainedFolder:
    """What a model or LoRA adapter folder says about how to run it, read from its files: a tunelab run's output
    (it holds tunelab_config.yaml), or any Hugging Face folder.

    - `base`: for an adapter, the base model it names (peft's base_model_name_or_path, and its revision);
    - `tokenizer_folder`: the adapter's own folder when it saved a tokenizer (a tunelab run saves the one it trained
      with, chat template included), else the model's;
    - `template`, `template_kwargs`: the template option and its variables the run recorded (None: not a tunelab
      run, or not recorded); the chat template itself is the one saved with the tokenizer.
    Decisions that need the tokenizer or the template engine (which template to render with) are infer/trained.py's.
    """

    path: Path

    @classmethod
    def of(cls, model_folder: str | Path, adapter_folder: str | Path | None = None) -> TrainedFolder:
        """The folder that holds the trained weights: the adapter's, else the model's."""
        return cls(Path(adapter_folder or model_folder))

    @cached_property
    def record(self) -> dict[str, Any] | None:
        return read_run_record(self.path)

    @property
    def is_tunelab_run(self) -> bool:
        return (self.path / RUN_RECORD).is_file()

    @cached_property
    def adapter_config(self) -> dict[str, Any] | None:
        value = read_json(self.path / "adapter_config.json")
        return value if isinstance(value, dict) else None

    @property
    def is_adapter(self) -> bool:
        return (self.path / "adapter_config.json").is_file()

    @property
    def base(self) -> tuple[str | None, str]:
        """(base model, revision) an adapter names; (None, "main") where it names none."""
        saved = self.adapter_config or {}
        return saved.get("base_model_name_or_path") or None, saved.get("revision") or "main"

    def tokenizer_folder(self, model_folder: str | Path) -> Path:
        return self.path if self.is_adapter and (self.path / "tokenizer_config.json").is_file() else Path(model_folder)

    @property
    def template(self) -> str | None:
        value = (self.record or {}).get("template")
        return value if isinstance(value, str) else None

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        value = (self.record or {}).get("template_kwargs")
        return value if isinstance(value, dict) else None
