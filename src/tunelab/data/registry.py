"""The dataset registry: dataset_info.json → DatasetSpec, the lookup of a run's datasets and their check.

A registry maps dataset names to where the rows come from (a file, folder or glob under
`dataset_dir`, a Hugging Face Hub dataset repo (`hf_hub_url`), or one of the built-in generators:
synthetic.py's tasks, corpus.py's plain text) and how their columns map onto the canonical conversation
(see formats.py), or, with `"formatting": "text"`, that its rows are raw documents for stage pt (see
pretrain.py). The built-in registry (data/dataset_info.json) is always available; a user's
`dataset_dir/dataset_info.json` adds to it and wins on equal names. An entry is checked when a run
looks it up (`Registry`), so an entry no run uses cannot stop the others.

This module owns the entries and specs; reading a spec's rows is dataset_files.py's (a Hub repo's files:
hub_datasets.py's).
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunelab import hub
from tunelab.config.args import DataArguments
from tunelab.config.stages import stage_row
from tunelab.errors import ConfigError

BUILTIN_REGISTRY = Path(__file__).resolve().parent / "dataset_info.json"
# The file types a file_name (or a Hub repo's data file) may be, and the datasets reader of each.
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
            f"{path}: dataset_info.json holds {json_kind(raw)}; it must map each dataset name to an object of its "
            f"settings, e.g. {example}"
        )
    for name, entry in raw.items():
        if not isinstance(entry, dict):
            raise ConfigError(
                f"{path}: dataset '{name}' is {json_kind(entry)}, not an object of settings; write it as "
                f"{{\"file_name\": ...}}, e.g. {example}"
            )
    return {name: (path, entry) for name, entry in raw.items()}


def json_kind(value: Any) -> str:
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


def check_datasets(data: DataArguments, stage: str) -> Registry:
    """The run's registry, its datasets checked against the stage before anything is read: each named dataset
    exists; stage pt reads raw documents and every other stage conversations; sft no ranking sets; rm, dpo and kto
    ranking sets (kto: or a kto_tag column). ConfigError naming the key and the dataset."""
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
