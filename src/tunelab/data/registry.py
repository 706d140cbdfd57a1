"""The dataset registry: dataset_info.json → DatasetSpec → rows loaded from files or generators.

A registry maps dataset names to where the rows come from (a file, folder or glob under
`dataset_dir`, or one of the built-in generators: synthetic.py's tasks, corpus.py's plain text) and
how their columns map onto the canonical conversation (see formats.py), or, with
`"formatting": "text"`, that its rows are raw documents for stage pt (see pretrain.py). The
built-in registry (data/dataset_info.json) is always available; a user's
`dataset_dir/dataset_info.json` adds to it and wins on equal names. An entry is checked when a run
looks it up (`Registry`), so an entry no run uses cannot stop the others.

This module owns reading files into `datasets.Dataset`; it does not tokenise.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets

from tunelab.errors import ConfigError, DataError

BUILTIN_REGISTRY = Path(__file__).resolve().parent / "dataset_info.json"
FILE_TYPES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text"}
SPEC_KEYS = {"file_name", "generator", "formatting", "ranking", "split", "num_samples", "seed", "columns", "tags"}
FORMATTINGS = ("alpaca", "sharegpt", "openai", "text")
# Columns of multimodal datasets (LlamaFactory's names). tunelab trains text-only models: mapping one
# is refused instead of silently training on the text without its images.
MEDIA_COLUMNS = ("images", "videos", "audios")


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    file_name: str | None = None  # file, folder or glob, relative to the registry's folder
    generator: str | None = None  # name in tunelab.data.synthetic or tunelab.data.corpus GENERATORS
    formatting: str = "alpaca"  # alpaca | sharegpt | openai | text (raw documents, stage pt)
    # False when the entry names no formatting: LlamaFactory's pretraining entries ({"columns": {"prompt":
    # "text"}}) are such alpaca-by-default entries, and stage pt reads them as documents (reads_documents).
    formatting_given: bool = True
    ranking: bool = False  # rows hold chosen/rejected answers
    split: str = "train"
    num_samples: int | None = None  # generator size, or rows to draw from a file (repeating if larger)
    seed: int = 0
    columns: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    root: str = ""  # folder file_name is relative to

    @property
    def reads_documents(self) -> bool:
        """Stage pt can read this set: raw text, or an entry without a formatting (LlamaFactory's pt entries)."""
        return self.formatting == "text" or not self.formatting_given


class Registry(Mapping[str, DatasetSpec]):
    """Dataset names → specs. An entry is checked when it is looked up, so one entry a run does not use
    (a multimodal set, a key tunelab does not support) cannot stop it; names are known without checking."""

    def __init__(self, entries: dict[str, tuple[Path, dict[str, Any]]]):
        self._entries = entries  # name -> (dataset_info.json it comes from, its raw entry)
        self._specs: dict[str, DatasetSpec] = {}

    def __getitem__(self, name: str) -> DatasetSpec:
        if name not in self._specs:
            path, entry = self._entries[name]
            self._specs[name] = _spec(path, name, entry)
        return self._specs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _read_registry(path: Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: dataset_info.json is not valid JSON ({exc.msg})") from None
    if not isinstance(raw, dict) or not all(isinstance(entry, dict) for entry in raw.values()):
        raise ConfigError(f"{path}: dataset_info.json must map each dataset name to an object of its settings")
    return {name: (path, entry) for name, entry in raw.items()}


def _spec(path: Path, name: str, entry: dict[str, Any]) -> DatasetSpec:
    """One registry entry checked and turned into a spec."""
    unknown = set(entry) - SPEC_KEYS
    if unknown:
        raise ConfigError(
            f"{path}: dataset '{name}' has unsupported key(s) {sorted(unknown)} "
            f"(supported: {sorted(SPEC_KEYS)}; hub datasets are not fetched, download the files first)"
        )
    if bool(entry.get("file_name")) == bool(entry.get("generator")):
        raise ConfigError(f"{path}: dataset '{name}' needs exactly one of file_name or generator")
    if entry.get("file_name") and entry.get("split", "train") != "train":  # LlamaFactory habit, meant for the hub
        raise ConfigError(
            f"{path}: dataset '{name}': split '{entry['split']}' applies to generator datasets; a file_name entry is "
            "read whole: remove split (or give that split its own file and entry)"
        )
    if entry.get("formatting", "alpaca") not in FORMATTINGS:
        raise ConfigError(f"{path}: dataset '{name}': formatting must be one of {', '.join(FORMATTINGS)}")
    media = [key for key in MEDIA_COLUMNS if key in (entry.get("columns") or {})]
    if media:
        raise ConfigError(
            f"{path}: dataset '{name}' maps columns.{media[0]}, but tunelab trains text-only models and "
            f"would ignore the {media[0]}: remove columns.{media[0]} (and the {media[0]} from the rows)"
        )
    return DatasetSpec(name=name, root=str(path.parent), formatting_given="formatting" in entry, **entry)


def load_registry(dataset_dir: str | None = None) -> Registry:
    """Built-in datasets plus the ones in `dataset_dir/dataset_info.json` (each checked when looked up)."""
    entries = _read_registry(BUILTIN_REGISTRY)
    if dataset_dir:
        path = Path(dataset_dir) / "dataset_info.json"
        if not path.is_file():
            raise ConfigError(f"dataset_dir: {dataset_dir} has no dataset_info.json")
        entries.update(_read_registry(path))
    return Registry(entries)


def resolve_files(spec: DatasetSpec) -> list[Path]:
    """The data files a spec names: one file, every data file in a folder, or a glob."""
    target = Path(spec.root) / spec.file_name
    if target.is_dir():
        files = sorted(p for p in target.rglob("*") if p.suffix in FILE_TYPES and p.is_file())
    elif any(ch in spec.file_name for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(target), recursive=True) if Path(p).is_file())
    else:
        files = [target] if target.is_file() else []
    if not files:
        raise DataError(f"dataset '{spec.name}': no data files at {target}")
    kinds = {FILE_TYPES.get(p.suffix) for p in files}
    if None in kinds or len(kinds) > 1:
        raise DataError(
            f"dataset '{spec.name}': files must share one type of {', '.join(sorted(FILE_TYPES))}; got "
            f"{', '.join(sorted({p.suffix or '(none)' for p in files}))}"
        )
    return files


def _first_bad_json_line(path: Path) -> tuple[int, str] | None:
    """Locate the first line of a .json/.jsonl file that does not parse (for a message that names it)."""
    with open(path, "rb") as handle:
        head = handle.read(1).lstrip()
    if path.suffix == ".json" and head == b"[":
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            return 0, f"not UTF-8 ({exc.reason} at byte {exc.start})"
        except json.JSONDecodeError as exc:
            return exc.lineno, exc.msg
        return None
    with open(path, "rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return lineno, f"not UTF-8 ({exc.reason} at byte {exc.start})"
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as exc:
                    return lineno, exc.msg
    return None


def _read_json_lines_skipping(path: Path, skipped: list[str]) -> list[dict]:
    """The rows of a JSON-lines file, leaving out (and listing as "file:line: why") lines that are not
    UTF-8, not JSON or not a JSON object."""
    rows = []
    with open(path, "rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                skipped.append(f"{path}:{lineno}: not UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            except json.JSONDecodeError as exc:
                skipped.append(f"{path}:{lineno}: {exc.msg}")
                continue
            if not isinstance(row, dict):
                skipped.append(f"{path}:{lineno}: not a JSON object")
                continue
            rows.append(row)
    return rows


def check_utf8(path: Path, chunk_size: int = 1 << 24) -> None:
    """Fail naming the line of the first byte that is not UTF-8.

    The JSON reader underneath would otherwise replace such bytes silently, corrupting the text.
    One streaming pass; about a second per GB.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    lines_before = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_size):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                lineno = lines_before + chunk[: exc.start].count(b"\n") + 1
                raise DataError(f"{path}:{lineno}: not UTF-8 (byte 0x{chunk[exc.start]:02x}); re-encode the file as UTF-8") from None
            lines_before += chunk.count(b"\n")


def _generator_module(spec: DatasetSpec):
    """The module that provides a spec's generator: synthetic.py (tasks) or corpus.py (plain text)."""
    from tunelab.data import corpus, synthetic  # noqa: PLC0415 - keeps the generators out of the import path otherwise

    for module in (synthetic, corpus):
        if spec.generator in module.GENERATORS:
            return module
    known = sorted({*synthetic.GENERATORS, *corpus.GENERATORS})
    raise ConfigError(f"dataset '{spec.name}': unknown generator '{spec.generator}' (available: {', '.join(known)})")


def load_rows(
    spec: DatasetSpec, cache_dir: str | None = None, txt_sample_by: str = "line", skipped: list[str] | None = None
) -> datasets.Dataset:
    """Raw rows of one dataset, before format conversion.

    `txt_sample_by` (line | paragraph | document) decides what one row of a .txt file is. With a
    `skipped` list (skip_bad_rows: true), lines of JSON-lines files that do not parse are left out and
    listed there as "file:line: why" instead of failing the run.
    """
    if spec.generator:
        module = _generator_module(spec)
        rows = module.generate(spec.generator, spec.split, spec.num_samples or 1000, seed=spec.seed)
        return datasets.Dataset.from_list(rows)

    files = resolve_files(spec)
    kind = FILE_TYPES[files[0].suffix]
    if skipped is not None and kind == "json" and any(_first_bad_json_line(p) for p in files):
        return _rows_skipping_bad_lines(spec, files, skipped)
    if kind in ("json", "csv", "text"):
        for path in files:
            check_utf8(path)
    reader_options = {"sample_by": txt_sample_by} if kind == "text" else {}
    try:
        dataset = datasets.load_dataset(
            kind, data_files=[str(p) for p in files], split="train", cache_dir=cache_dir,
            num_proc=None, **reader_options,
        )
    except Exception as exc:  # noqa: BLE001 - turn the reader's deep error into one line naming the file
        if kind == "json":
            for path in files:
                bad = _first_bad_json_line(path)
                if bad:
                    lineno, why = bad
                    raise DataError(f"{path}:{lineno}: {why}; fix or remove that line") from None
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise DataError(f"dataset '{spec.name}': cannot read {files[0]}: {reason}") from None
    if spec.num_samples is not None and spec.num_samples != len(dataset):
        indices = [i % len(dataset) for i in range(spec.num_samples)]
        dataset = dataset.select(indices)
    return dataset


def _rows_skipping_bad_lines(spec: DatasetSpec, files: list[Path], skipped: list[str]) -> datasets.Dataset:
    rows = []
    for path in files:
        with open(path, "rb") as handle:
            if path.suffix == ".json" and handle.read(1024).lstrip().startswith(b"["):
                bad = _first_bad_json_line(path)
                raise DataError(
                    f"{path}:{bad[0]}: {bad[1]}; skip_bad_rows skips lines of JSON-lines files only, and this file "
                    "is one JSON array: fix that line, or write one JSON object per line (.jsonl)"
                )
        rows += _read_json_lines_skipping(path, skipped)
    if not rows:
        raise DataError(f"dataset '{spec.name}': no readable rows (all {len(skipped)} lines were bad; first: {skipped[0]})")
    dataset = datasets.Dataset.from_list(rows)
    if spec.num_samples is not None and spec.num_samples != len(dataset):
        dataset = dataset.select([i % len(dataset) for i in range(spec.num_samples)])
    return dataset


def describe(spec: DatasetSpec) -> dict[str, Any]:
    """What the run log records about a dataset's source."""
    info: dict[str, Any] = {"name": spec.name, "formatting": spec.formatting, "ranking": spec.ranking}
    if spec.generator:
        info.update(generator=spec.generator, split=spec.split, num_samples=spec.num_samples, seed=spec.seed)
    else:
        files = resolve_files(spec)
        info["files"] = [{"path": str(p), "size": os.path.getsize(p)} for p in files]
    return info
