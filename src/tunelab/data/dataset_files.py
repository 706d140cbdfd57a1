"""A dataset spec's rows: its files resolved (one file, a folder, a glob, or a Hub split via hub_datasets.py) and
read into `datasets.Dataset`, or its generator run; bad files named in one line, bad JSON-lines lines skipped
(skip_bad_rows) or located (RowLocator) for messages.

This module owns reading files into `datasets.Dataset`; it does not tokenise.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
import re
from pathlib import Path
from typing import Any

import datasets

from tunelab import hub
from tunelab.data import corpus, synthetic
from tunelab.data.hub_datasets import hub_files
from tunelab.data.registry import FILE_TYPES, DatasetSpec, json_kind
from tunelab.errors import ConfigError, DataError


def resolve_files(spec: DatasetSpec) -> list[Path]:
    """The data files a spec names: one file, every data file in a folder, a glob, or a Hub repo's split."""
    if spec.hf_hub_url:
        return list(hub_files(spec.name, spec.hf_hub_url, spec.revision, spec.subset, spec.folder, spec.split))
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
    """Locate the first line of a .json/.jsonl file that does not parse or is not a row object (for a message
    that names it)."""
    if not is_json_lines(path):
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            return 0, f"not UTF-8 ({exc.reason} at byte {exc.start})"
        except json.JSONDecodeError as exc:
            return exc.lineno, exc.msg
        bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
        if bad is not None:
            return 1, f"element {bad} of the array is {json_kind(rows[bad])}, not a row object"
        return None
    with open(path, "rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return lineno, f"not UTF-8 ({exc.reason} at byte {exc.start})"
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    return lineno, exc.msg
                if not isinstance(row, dict):
                    return lineno, f"{json_kind(row)}, not a row object ({{\"column\": value, ...}})"
    return None


def _check_file_shape(path: Path, kind: str) -> None:
    """Files the readers would take wrongly or fail on deep inside: an empty file (no rows), a .json file that is
    one JSON object (read as a single row, or as columns)."""
    with open(path, "rb") as handle:
        head = handle.read(1 << 16)
    if not head.strip():
        raise DataError(f"{path}: the file is empty; add rows or remove it from the dataset")
    if kind != "json" or not head.lstrip().startswith(b"{"):
        return
    first, _, rest = head.lstrip().partition(b"\n")
    try:
        json.loads(first)  # one object on the first line: JSON lines, when more lines follow
        single = not rest.strip() and path.suffix == ".json"
    except ValueError:
        try:
            single = isinstance(json.loads(path.read_bytes()), dict)  # a pretty-printed object
        except ValueError:
            single = False  # the reader names the bad line
    if single:
        raise DataError(
            f"{path}: the file is one JSON object, not rows; write a JSON array of row objects ([{{...}}, {{...}}]) "
            "or one object per line (.jsonl)"
        )


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


def is_json_lines(path: Path) -> bool:
    """A .jsonl file, or a .json file that is not one JSON array."""
    if path.suffix == ".jsonl":
        return True
    with open(path, "rb") as handle:
        return path.suffix == ".json" and not handle.read(4096).lstrip().startswith(b"[")


class RowLocator:
    """A file-backed dataset's row index → where that row is: "file:line" in JSON-lines files (a row is a
    non-blank line holding a JSON object, as the readers count them), "file row k" (k from 0) in the others.
    Built on first use by reading the files again: only messages about bad rows ask."""

    def __init__(self, files: list[Path]):
        self.files = files
        self._rows: list[tuple[Path, int, list[int] | None]] | None = None  # (file, rows, line of each row)

    def _count(self) -> list[tuple[Path, int, list[int] | None]]:
        rows = []
        for path in self.files:
            kind = FILE_TYPES.get(path.suffix)
            if kind == "json" and is_json_lines(path):
                lines = [number for number, raw in enumerate(open(path, "rb"), start=1) if _holds_object(raw)]
                rows.append((path, len(lines), lines))
            elif kind == "json":
                rows.append((path, len(json.loads(path.read_text(encoding="utf-8"))), None))
            else:
                count = datasets.load_dataset(kind, data_files=[str(path)], split="train").num_rows
                rows.append((path, count, None))
        return rows

    def __call__(self, index: int) -> str:
        if self._rows is None:
            try:
                self._rows = self._count()
            except Exception:  # noqa: BLE001 - a message about a row must not fail over its location
                self._rows = []
        total = sum(count for _, count, _ in self._rows)
        if not total:
            return ", ".join(map(str, self.files))
        index %= total  # num_samples repeats the rows
        for path, count, lines in self._rows:
            if index < count:
                return f"{path}:{lines[index]}" if lines is not None else f"{path} row {index}"
            index -= count
        raise AssertionError("unreachable")


def _holds_object(raw: bytes) -> bool:
    if not raw.strip():
        return False
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:
        return False


def describe_files(spec: DatasetSpec) -> str:
    """The file(s) a file-backed dataset reads, for messages ("" for generators)."""
    if not (spec.file_name or spec.hf_hub_url):
        return ""
    files = resolve_files(spec)
    return str(files[0]) if len(files) == 1 else f"{files[0]} and {len(files) - 1} more files"


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


def generator_module(spec: DatasetSpec):
    """The module that provides a spec's generator: synthetic.py (tasks) or corpus.py (plain text)."""
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
        module = generator_module(spec)
        rows = module.generate(spec.generator, spec.split, spec.num_samples or 1000, seed=spec.seed)
        return datasets.Dataset.from_list(rows)

    files = resolve_files(spec)
    kind = FILE_TYPES[files[0].suffix]
    if skipped is not None and kind == "json" and any(_first_bad_json_line(p) for p in files):
        return _rows_skipping_bad_lines(spec, files, skipped)
    for path in files:
        if kind in ("json", "csv", "text"):
            check_utf8(path)
        _check_file_shape(path, kind)
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
        raise DataError(_read_failure(spec, files, exc)) from None
    if spec.num_samples is not None and spec.num_samples != len(dataset):
        indices = [i % len(dataset) for i in range(spec.num_samples)]
        dataset = dataset.select(indices)
    return dataset


def _read_failure(spec: DatasetSpec, files: list[Path], exc: BaseException) -> str:
    """One line for a reader failure: the file (from the reader's own message when it names one) and the root
    cause, not datasets' "An error occurred while generating the dataset"."""
    causes = [exc]
    while causes[-1].__cause__ is not None or causes[-1].__context__ is not None:
        causes.append(causes[-1].__cause__ or causes[-1].__context__)
        if len(causes) > 20:
            break
    root = causes[-1]
    text = " ".join(str(root).split()) or type(root).__name__
    where = next((str(p) for p in files if any(str(p) in str(c) for c in causes)), str(files[0]))
    ragged = re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", text)
    if ragged:
        fields, line, saw = ragged.groups()
        return (f"{where}:{line}: {saw} fields where the header has {fields}; give every row the header's columns "
                "(quote values that contain commas)")
    return f"dataset '{spec.name}': cannot read {where}: {text}"


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
        if spec.hf_hub_url:  # the commit read, so the same rows can be read again
            snapshot = hub.snapshot_containing(resolve_files(spec)[0])
            info["hub"] = {"repo_id": spec.hf_hub_url, "revision": spec.revision, "commit": snapshot.commit,
                           "subset": spec.subset, "folder": spec.folder, "split": spec.split}
        files = resolve_files(spec)
        info["files"] = [{"path": str(p), "size": os.path.getsize(p)} for p in files]
    return info
