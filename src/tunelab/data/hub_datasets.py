"""A Hub dataset's files: the `hf_hub_url` entry of a registry spec → the local files of its split.

The repo is fetched into the Hugging Face cache by tunelab/hub.py; this module picks which files of it to fetch
and which of them make the split, so dataset_files.py reads them like local files.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import datasets
from huggingface_hub import metadata_load

from tunelab import hub
from tunelab.data.registry import FILE_TYPES
from tunelab.errors import DataError


@functools.cache  # one run reads one commit of a Hub dataset, however often its files are asked for
def hub_files(
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
