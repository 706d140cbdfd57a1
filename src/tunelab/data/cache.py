"""The tokenized-dataset cache: same inputs ⇒ reuse, any change ⇒ rebuild.

A run's datasets are keyed by a fingerprint of everything that can change them: the data files
(path, size, mtime), the registry entries (and a generator's source code), the tokenizer (its
serialized vocabulary, merges and special tokens), the chat template source, the stage, every data
option that shapes examples, the seed (splits, interleaving) and the cache format version. The first launch builds and saves the
datasets as Arrow files under `<cache_dir>/<fingerprint>/`; the next launch with the same inputs
memory-maps them and starts training without tokenising again.

Writes are atomic (build in a temporary folder, then rename), so a crash never leaves a cache entry
that looks complete. In multi-process runs the main process builds; the others wait by polling for
the finished entry instead of sitting in a collective barrier, so a long tokenisation cannot trip
the distributed timeout (PEERS.md row 3).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets

from tunelab import __version__
from tunelab.data.pipeline import DatasetBundle
from tunelab.data.dataset_files import generator_module, resolve_files
from tunelab.data.registry import load_registry

logger = logging.getLogger(__name__)

# 2: per-segment ids, truncation by exchanges, empty answers kept, reasoning, pt BOS; new report keys;
# 3: non-text values refused, numbers_as_text and texts_cut counted, long texts cut before tokenising
CACHE_FORMAT_VERSION = 3
DONE_MARKER = "complete.json"

# DataArguments that never change the examples (they only say where/whether to cache or how many
# processes tokenise).
NEUTRAL_DATA_OPTIONS = {"preprocessing_num_workers", "overwrite_cache", "tokenized_cache_dir", "dataset_dir", "streaming", "buffer_size"}


def default_cache_dir() -> Path:
    root = os.environ.get("TUNELAB_CACHE") or Path.home() / ".cache" / "tunelab"
    return Path(root) / "tokenized"


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of what decides token ids: the serialized fast tokenizer (vocab, merges, normalizer,
    pre-tokenizer, added tokens) plus the special-token strings the templates write."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode("utf-8"))
    else:  # slow tokenizers: the vocabulary is the best cheap proxy
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode("utf-8"))
    specials = {name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    digest.update(json.dumps(specials, sort_keys=True, default=str).encode("utf-8"))
    return digest.hexdigest()


def files_fingerprint(paths: list[Path]) -> list[dict[str, Any]]:
    """Path, size and modification time of each file: changes when a file is edited or replaced,
    without reading terabytes of data at every launch."""
    out = []
    for path in paths:
        stat = Path(path).stat()
        out.append({"path": str(Path(path).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return out


def generator_fingerprint(spec) -> str:
    """sha256 of the source file of the module that generates a generator dataset's rows."""

    return hashlib.sha256(Path(generator_module(spec).__file__).read_bytes()).hexdigest()


def fingerprint(inputs: dict[str, Any]) -> str:
    payload = json.dumps({"format": CACHE_FORMAT_VERSION, "tunelab": __version__, **inputs}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:24]


def data_options(data_args) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(data_args).items() if k not in NEUTRAL_DATA_OPTIONS}


def dataset_inputs(data_args, tokenizer, template_source: str | None, stage: str, seed: int) -> dict[str, Any]:
    """Everything that shapes a run's tokenized datasets, as a JSON-able dict."""

    registry = load_registry(data_args.dataset_dir)
    sources = {}
    for name in [*(data_args.dataset or []), *(data_args.eval_dataset or [])]:
        spec = registry[name]
        entry = {k: v for k, v in dataclasses.asdict(spec).items() if k != "root"}
        if spec.file_name:
            entry["files"] = files_fingerprint(resolve_files(spec))
        if spec.generator:  # the rows are the generator code's: a change to it must not reuse old rows
            entry["generator_source"] = generator_fingerprint(spec)
        sources[name] = entry
    return {
        "stage": stage,
        "seed": seed,
        "data_options": data_options(data_args),
        "sources": sources,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "template": hashlib.sha256(template_source.encode("utf-8")).hexdigest() if template_source else None,
    }


@dataclasses.dataclass
class CachedDatasets:
    """What is cached: named Arrow datasets plus a JSON-able report."""

    datasets: dict[str, datasets.Dataset]
    report: dict[str, Any]


def _save(entry: Path, value: CachedDatasets, inputs: dict[str, Any]) -> None:
    tmp = entry.parent / f".{entry.name}.tmp-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir(parents=True)
    try:
        for name, dataset in value.datasets.items():
            dataset.save_to_disk(str(tmp / _safe(name)))
        (tmp / "report.json").write_text(json.dumps(value.report, indent=2, default=str))
        names = {name: _safe(name) for name in value.datasets}
        (tmp / DONE_MARKER).write_text(json.dumps({"datasets": names, "inputs": inputs}, indent=2, default=str))
        try:
            tmp.rename(entry)
        except OSError:  # another process finished the same entry first; theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
            logger.warning("tokenized cache: another process finished %s first; using its copy", entry)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load(entry: Path) -> CachedDatasets:
    done = json.loads((entry / DONE_MARKER).read_text())
    loaded = {name: datasets.load_from_disk(str(entry / folder)) for name, folder in done["datasets"].items()}
    return CachedDatasets(loaded, json.loads((entry / "report.json").read_text()))


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)


def load_or_build(
    inputs: dict[str, Any],
    build: Callable[[], CachedDatasets],
    cache_dir: str | Path | None = None,
    overwrite: bool = False,
    is_main_process: bool = True,
    wait_timeout_s: float = 24 * 3600,
) -> tuple[CachedDatasets, bool, Path]:
    """Return (datasets, was_cache_hit, entry folder). Only the main process builds."""
    key = fingerprint(inputs)
    entry = Path(cache_dir or default_cache_dir()) / key
    entry.parent.mkdir(parents=True, exist_ok=True)
    if (entry / DONE_MARKER).is_file() and not overwrite:
        logger.info("tokenized cache hit: %s (same data, tokenizer, template and options)", entry)
        return _load(entry), True, entry
    if not is_main_process:
        started, deadline = time.time(), time.time() + wait_timeout_s
        marker = entry / DONE_MARKER
        # With overwrite, an entry finished before this launch is the stale one being rebuilt.
        while not marker.is_file() or (overwrite and marker.stat().st_mtime < started - 1):
            if time.time() > deadline:
                raise TimeoutError(f"waited {wait_timeout_s:.0f}s for the main process to build {entry}")
            time.sleep(2.0)
        return _load(entry), True, entry
    if entry.exists():
        shutil.rmtree(entry)  # overwrite_cache, or a stale entry without its marker
    logger.info("tokenized cache miss: building %s", entry)
    value = build()
    _save(entry, value, inputs)
    return _load(entry), False, entry


def cached_bundle(data_args, tokenizer, template_source: str | None, stage: str, seed: int,
                  build: Callable[[], Any], is_main_process: bool = True):
    """A stage's DatasetBundle through the cache: built once, memory-mapped on every later launch.

    The local main process of each node builds (atomic rename makes concurrent builders on a shared
    file system safe); the others wait for the finished entry and read it.
    """

    inputs = dataset_inputs(data_args, tokenizer, template_source, stage, seed)

    def build_cached() -> CachedDatasets:
        bundle = build()
        named = {"train": bundle.train} if bundle.train is not None else {}
        named.update({f"eval/{name}": ds for name, ds in bundle.eval.items()})
        named.update({f"eval_rows/{name}": ds for name, ds in bundle.eval_rows.items()})
        return CachedDatasets(named, bundle.report)

    value, hit, entry = load_or_build(
        inputs, build_cached, data_args.tokenized_cache_dir, overwrite=data_args.overwrite_cache,
        is_main_process=is_main_process,
    )
    groups: dict[str, dict[str, datasets.Dataset]] = {"eval": {}, "eval_rows": {}}
    for name, dataset in value.datasets.items():
        if "/" in name:
            group, _, key = name.partition("/")
            groups[group][key] = dataset
    report = {**value.report, "cache": {"hit": hit, "path": str(entry)}}
    logger.info("datasets %s: %s", "reused from the tokenized cache" if hit else "tokenized and cached", entry)
    return DatasetBundle(train=value.datasets.get("train"), eval=groups["eval"], eval_rows=groups["eval_rows"], report=report)
