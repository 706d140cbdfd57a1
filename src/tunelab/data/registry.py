"""The dataset registry: dataset_info.json → DatasetSpec → rows loaded from files or generators.

A registry maps dataset names to where the rows come from (a file, folder or glob under
`dataset_dir`, a Hugging Face Hub dataset repo (`hf_hub_url`, fetched into the Hub cache by
tunelab/hub.py), or one of the built-in generators: synthetic.py's tasks, corpus.py's plain text) and
how their columns map onto the canonical conversation (see formats.py), or, with
`"formatting": "text"`, that its rows are raw documents for stage pt (see pretrain.py). The
built-in registry (data/dataset_info.json) is always available; a user's
`dataset_dir/dataset_info.json` adds to it and wins on equal names. An entry is checked when a run
looks it up (`Registry`), so an entry no run uses cannot stop the others.

This module owns reading files into `datasets.Dataset`; it does not tokenise.
"""

from __future__ import annotations

import codecs
import difflib
import functools
import glob
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets

from tunelab import hub
from tunelab.config.stages import stage_row
from tunelab.errors import ConfigError, DataError

BUILTIN_REGISTRY = Path(__file__).resolve().parent / "dataset_info.json"
FILE_TYPES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text"}
SPEC_KEYS = {"file_name", "generator", "formatting", "ranking", "split", "num_samples", "seed", "columns", "tags",
             "hf_hub_url", "subset", "folder", "revision", "ms_hub_url", "om_hub_url"}
# Keys of a Hub dataset only (LlamaFactory's names, `revision` ours): set on a local one, they would do nothing.
HUB_KEYS = ("subset", "folder", "revision")
FORMATTINGS = ("alpaca", "sharegpt", "openai", "text")
# Columns of multimodal datasets (LlamaFactory's names). Images train vision-language models (data/images.py,
# data/vision.py); videos and audio are refused instead of silently training on the text without them.
IMAGE_COLUMN = "images"
UNSUPPORTED_MEDIA_COLUMNS = ("videos", "audios")
MEDIA_COLUMNS = (IMAGE_COLUMN, *UNSUPPORTED_MEDIA_COLUMNS)


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    file_name: str | None = None  # file, folder or glob, relative to the registry's folder
    generator: str | None = None  # name in tunelab.data.synthetic or tunelab.data.corpus GENERATORS
    hf_hub_url: str | None = None  # a Hugging Face Hub dataset repo id (org/name)
    subset: str | None = None  # hub: the repo's config (README.md `configs`), as datasets' `name`
    folder: str | None = None  # hub: the folder of the repo holding the data, as datasets' `data_dir`
    revision: str = "main"  # hub: branch, tag or commit
    formatting: str = "alpaca"  # alpaca | sharegpt | openai | text (raw documents, stage pt)
    # False when the entry names no formatting: LlamaFactory's pretraining entries ({"columns": {"prompt":
    # "text"}}) are such alpaca-by-default entries, and stage pt reads them as documents (reads_documents).
    formatting_given: bool = True
    ranking: bool = False  # rows hold chosen/rejected answers
    split: str = "train"  # generators: which rows; hub: the split of the repo's data files
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
    example = '{"my_data": {"file_name": "data.jsonl"}}'
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: dataset_info.json holds {_json_kind(raw)}; it must map each dataset name to an object of its "
            f"settings, e.g. {example}"
        )
    for name, entry in raw.items():
        if not isinstance(entry, dict):
            raise ConfigError(
                f"{path}: dataset '{name}' is {_json_kind(entry)}, not an object of settings; write it as "
                f"{{\"file_name\": ...}}, e.g. {example}"
            )
    return {name: (path, entry) for name, entry in raw.items()}


def _json_kind(value: Any) -> str:
    kinds = {list: "a JSON array", str: "a string", bool: "a boolean", type(None): "null", dict: "an object"}
    return kinds.get(type(value), "a number")


def _spec(path: Path, name: str, entry: dict[str, Any]) -> DatasetSpec:
    """One registry entry checked and turned into a spec."""
    unknown = set(entry) - SPEC_KEYS
    if unknown:
        raise ConfigError(
            f"{path}: dataset '{name}' has unsupported key(s) {sorted(unknown)} (supported: {sorted(SPEC_KEYS)})"
        )
    entry = _hub_entry(path, name, entry)
    if sum(bool(entry.get(k)) for k in ("file_name", "generator", "hf_hub_url")) != 1:
        raise ConfigError(f"{path}: dataset '{name}' needs exactly one of file_name, hf_hub_url or generator")
    if entry.get("file_name") and entry.get("split", "train") != "train":  # LlamaFactory habit, meant for the hub
        raise ConfigError(
            f"{path}: dataset '{name}': split '{entry['split']}' applies to generator and hf_hub_url datasets; a "
            "file_name entry is read whole: remove split (or give that split its own file and entry)"
        )
    if entry.get("formatting", "alpaca") not in FORMATTINGS:
        raise ConfigError(f"{path}: dataset '{name}': formatting must be one of {', '.join(FORMATTINGS)}")
    media = [key for key in UNSUPPORTED_MEDIA_COLUMNS if key in (entry.get("columns") or {})]
    if media:
        raise ConfigError(
            f"{path}: dataset '{name}' maps columns.{media[0]}, but tunelab trains text and image models and "
            f"would ignore the {media[0]}: remove columns.{media[0]} (and the {media[0]} from the rows)"
        )
    return DatasetSpec(name=name, root=str(path.parent), formatting_given="formatting" in entry, **entry)


def _hub_entry(path: Path, name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """A registry entry's hub keys checked; ModelScope / Modelers ids (LlamaFactory lists them beside the
    Hugging Face one) dropped when an hf_hub_url is there, refused when they are all there is."""
    others = [key for key in ("ms_hub_url", "om_hub_url") if key in entry]
    if others and not entry.get("hf_hub_url"):
        raise ConfigError(
            f"{path}: dataset '{name}' has only {others[0]}; tunelab reads datasets from the Hugging Face Hub "
            "(hf_hub_url) or local files (file_name)"
        )
    entry = {k: v for k, v in entry.items() if k not in others}
    local_only = [key for key in HUB_KEYS if key in entry and not entry.get("hf_hub_url")]
    if local_only:
        raise ConfigError(f"{path}: dataset '{name}': {local_only[0]} applies to hf_hub_url datasets only; remove it")
    hub_id = entry.get("hf_hub_url")
    if hub_id is not None:
        if not isinstance(hub_id, str) or not hub.is_repo_id(hub_id.strip()):
            raise ConfigError(f"{path}: dataset '{name}': hf_hub_url must be a Hub dataset id like org/name, got {hub_id!r}")
        entry["hf_hub_url"] = hub_id.strip()
    return entry


def load_registry(dataset_dir: str | None = None) -> Registry:
    """Built-in datasets plus the ones in `dataset_dir/dataset_info.json` (each checked when looked up). Read once per
    process while that file is unchanged: tunelab/preflight.py reads it first, and every later lookup of the run
    (encoding, the cache's fingerprint, streaming) gets the same Registry, its specs checked once."""
    if not dataset_dir:
        return _registry(None)
    path = Path(dataset_dir) / "dataset_info.json"
    if not path.is_file():
        raise ConfigError(f"dataset_dir: {dataset_dir} has no dataset_info.json")
    stat = path.stat()
    return _registry((str(path), str(path.resolve()), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=16)
def _registry(source: tuple[str, str, int, int] | None) -> Registry:
    """(the path as given, which messages and relative roots keep; where it resolves; its mtime and size)."""
    entries = _read_registry(BUILTIN_REGISTRY)
    if source is not None:
        entries.update(_read_registry(Path(source[0])))
    return Registry(entries)


def resolve_files(spec: DatasetSpec) -> list[Path]:
    """The data files a spec names: one file, every data file in a folder, a glob, or a Hub repo's split."""
    if spec.hf_hub_url:
        return list(_hub_files(spec.name, spec.hf_hub_url, spec.revision, spec.subset, spec.folder, spec.split))
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


@functools.cache  # one run reads one commit of a Hub dataset, however often its files are asked for
def _hub_files(
    name: str, repo_id: str, revision: str, subset: str | None, folder: str | None, split: str
) -> tuple[Path, ...]:
    """A Hub dataset's files of one split, read like local ones. The repo is fetched into the Hub cache
    (README.md first, for its commit and configs; then the data files the subset or folder can use), and
    datasets' own rules pick the split's files: README.md `configs`, else split names in file and folder
    names (data/train-*.parquet, test.jsonl, ...)."""
    what = f"dataset '{name}': hf_hub_url {repo_id}"
    card = hub.fetch_dataset(repo_id, revision, ["README.md"], what)
    prefixes = _hub_data_prefixes(card / "README.md", subset, folder)
    patterns = ["README.md"] + [
        prefix if prefix.endswith(tuple(FILE_TYPES)) else f"{prefix}*{suffix}"
        for prefix in prefixes for suffix in FILE_TYPES
    ]
    snapshot = hub.fetch_dataset(repo_id, card.name, patterns, what)  # card.name: the commit, pinned
    data_files = {}
    if snapshot.is_dir():  # else nothing matched: no data files of the types tunelab reads
        try:
            builder = datasets.load_dataset_builder(str(snapshot), name=subset, data_dir=folder)
            data_files = {str(k): v for k, v in (builder.config.data_files or {}).items()}
        except ValueError as exc:  # an unknown subset, mostly
            problem = f"has no subset {subset!r}" if subset else "cannot be read"
            raise DataError(f"{what} {problem} ({str(exc).splitlines()[0]})") from None
        except FileNotFoundError:  # datasets' EmptyDatasetError: no data files (under folder)
            pass
    files = tuple(Path(p) for p in data_files.get(split) or [])
    if not files:
        where = f" under {folder}/" if folder else ""
        splits = f" (splits: {', '.join(data_files)})" if data_files else ""
        if hub.is_offline():  # the cache may hold only part of the repo
            fix = f"in the Hugging Face cache; {hub.fetch_hint(repo_id, 'dataset', snapshot.name)}"
        else:
            fix = f"of the types tunelab reads ({', '.join(sorted(FILE_TYPES))}); set split, subset or folder in dataset_info.json"
        raise DataError(f"{what} has no '{split}' data files{where} at commit {snapshot.name}{splits} {fix}")
    return files


def _hub_data_prefixes(readme: Path, subset: str | None, folder: str | None) -> list[str]:
    """Where in the repo the data of a subset or folder can be: path prefixes no file that datasets would pick
    lies outside of (so fetching what starts with them never leaves a file out), "" for the whole repo."""
    prefixes = [f"{folder.strip('/')}/"] if folder else []
    if subset and readme.is_file():
        from huggingface_hub import metadata_load  # noqa: PLC0415

        configs = (metadata_load(readme) or {}).get("configs") or []
        config = next((c for c in configs if isinstance(c, dict) and c.get("config_name") == subset), None)
        if config is not None:
            paths = _data_files_paths(config.get("data_files"))
            data_dir = config.get("data_dir")
            if data_dir:
                paths = [f"{str(data_dir).strip('/')}/{p}" for p in paths] or [f"{str(data_dir).strip('/')}/"]
            prefixes += [_literal_prefix(p) for p in paths] if paths else [""]
    return prefixes or [""]


def _data_files_paths(data_files: Any) -> list[str]:
    """The path patterns of a README `configs` entry's data_files (a pattern, a list, or split → patterns)."""
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, dict):
        return _data_files_paths(data_files.get("path"))
    if isinstance(data_files, list):
        return [p for item in data_files for p in _data_files_paths(item)]
    return []


def _literal_prefix(pattern: str) -> str:
    """The part of a glob pattern before its first wildcard (data/train-*.parquet → data/train-)."""
    cut = min((i for i, ch in enumerate(pattern) if ch in "*?[{"), default=len(pattern))
    return pattern[:cut].lstrip("/")


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
            return 1, f"element {bad} of the array is {_json_kind(rows[bad])}, not a row object"
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
                    return lineno, f"{_json_kind(row)}, not a row object ({{\"column\": value, ...}})"
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


def check_datasets(config) -> Registry:
    """The run's registry, its datasets checked against the stage before anything is read: each named dataset
    exists; stage pt reads raw documents and every other stage conversations; sft no ranking sets; rm, dpo and kto
    ranking sets (kto: or a kto_tag column). ConfigError naming the key and the dataset."""
    data, stage = config.data, config.finetuning.stage
    row = stage_row(stage)
    registry = load_registry(data.dataset_dir)
    named = [(key, name) for key in ("dataset", "eval_dataset") for name in getattr(data, key) or []]
    for key, name in named:
        if name not in registry:
            close = difflib.get_close_matches(name, list(registry), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            where = f"{data.dataset_dir}/dataset_info.json" if data.dataset_dir else "the built-in registry"
            raise ConfigError(f"{key}: '{name}' is not in {where}; {hint}add it to dataset_info.json")
    for key, name in named:
        spec = registry[name]
        if row.reads == "text" and not spec.reads_documents:
            raise ConfigError(
                f"{key}: '{name}' has formatting: {spec.formatting}, but stage pt trains on raw documents; "
                "use a dataset with formatting: text (e.g. demo_corpus) or another stage"
            )
        if row.reads != "text" and spec.formatting == "text":
            raise ConfigError(
                f"{key}: '{name}' is a raw text corpus (formatting: text) for stage pt; "
                f"stage {stage} needs an alpaca, sharegpt or openai dataset"
            )
        if row.reads == "supervised" and spec.ranking:  # its rows hold no answer turn: every one would drop
            raise ConfigError(
                f"{key}: '{name}' is a ranking dataset (chosen/rejected answers) for stages rm, dpo, kto, grpo "
                "and ppo; stage sft trains on conversations: use a dataset without ranking: true"
            )
    if row.pairs:
        for key, name in named:
            spec = registry[name]
            unpaired = row.reads == "unpaired"
            if not spec.ranking and not (unpaired and "kto_tag" in spec.columns):
                fix = "or map a kto_tag column (columns.kto_tag) " if unpaired else ""
                raise ConfigError(
                    f"{key}: '{name}' is not a ranking dataset, but stage {stage} trains on preference pairs; "
                    f"set ranking: true with chosen/rejected columns in dataset_info.json {fix}(e.g. demo_preference)"
                )
    return registry
