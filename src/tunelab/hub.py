"""Hugging Face Hub ids → local folders in the Hub cache, through `huggingface_hub.snapshot_download`.

    model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct   (model_revision: main)
      config time: snapshot_download(everything but the weights) → <cache>/models--Qwen--Qwen2.5-0.5B-Instruct/
                   snapshots/<commit>/; the weights' format is checked (safetensors, or pickle only when asked)
      load time:   fetch_weights(that folder) → the weight files join the same snapshot folder
    model_name_or_path: org/name-GGUF + gguf_file: name-Q4_K_M.gguf
      config time: fetch_file → that one file in the snapshot folder (its tokenizer is inside it, so it comes first)

A local folder always wins over a Hub id of the same spelling, and a missing folder that an example config writes
(saves/sft_base: run_folder.example_output_dirs) is a run not made yet, never a Hub id. Everything else is
huggingface_hub's: the cache (HF_HOME / HF_HUB_CACHE), offline mode (HF_HUB_OFFLINE: the cache only), the token
(HF_TOKEN or `hf auth login`), the endpoint (HF_ENDPOINT). huggingface_hub reads these when it is first imported,
so they are set before tunelab starts. The weights wait for load time so that the config checks (tokenizer, template, data) and the
commands that need no weights (`tunelab data`, `tunelab estimate`) do not download gigabytes first.

A snapshot folder names its repo and commit (…/models--org--name/snapshots/<commit>), so the resolved
folder is all the rest of tunelab carries: `snapshot_of` reads the repo id and commit back for the run's
records. Custom modelling code (*.py) is fetched only with trust_remote_code; pickle weights (*.bin) only with
allow_pickle_weights. Dataset repos (dataset_info.json `hf_hub_url`) come through `fetch_dataset`; choosing
their files is data/hub_datasets.py's. Every failure is one line naming the key, the repo and the fix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants, errors, snapshot_download

from tunelab import run_folder
from tunelab.errors import DataError, ModelError, TunelabError

# org/name, as the Hub spells repo ids (a name without an org, like `gpt2`, is read as a local path).
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# Everything a model or adapter folder needs but its weights: configs, tokenizer files, chat templates, shard indexes.
MODEL_FILES = ("*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken")
# The weight files transformers and peft look for, in their order of preference. An index names its shards.
SAFETENSORS_WEIGHTS = ("model.safetensors.index.json", "model.safetensors", "adapter_model.safetensors")
PICKLE_WEIGHTS = ("pytorch_model.bin.index.json", "pytorch_model.bin", "adapter_model.bin")


@dataclass(frozen=True)
class Snapshot:
    """One commit of a Hub repo in the local cache."""

    repo_id: str
    commit: str
    repo_type: str  # "model" | "dataset"
    folder: Path

    @property
    def cache_dir(self) -> Path:
        return self.folder.parents[2]

    def record(self, revision: str | None = None) -> dict[str, str]:
        """What a run writes down to load the same files again."""
        info = {"repo_id": self.repo_id, "commit": self.commit}
        return info | ({"revision": revision} if revision is not None else {})


def is_repo_id(name: str) -> bool:
    return bool(REPO_ID.fullmatch(name)) and "--" not in name and ".." not in name


def snapshot_of(folder: str | Path) -> Snapshot | None:
    """The repo and commit a folder of the Hub cache holds (…/models--org--name/snapshots/<commit>), else None."""
    folder = Path(folder)
    if len(folder.parts) < 3 or folder.parent.name != "snapshots":
        return None
    kind, _, name = folder.parent.parent.name.partition("--")
    if kind not in ("models", "datasets") or "--" not in name:
        return None
    return Snapshot(name.replace("--", "/", 1), folder.name, kind[:-1], folder)


def snapshot_containing(path: str | Path) -> Snapshot | None:
    """The cache snapshot a file or folder lies in (…/snapshots/<commit>/data/train.jsonl), else None."""
    path = Path(path)
    for folder in (path, *path.parents):
        if folder.parent.name == "snapshots":
            return snapshot_of(folder)
    return None


def resolve_model(
    name: str, key: str, revision: str = "main", *, trust_remote_code: bool = False, allow_pickle: bool = False,
    revision_key: str = "model_revision",
) -> str:
    """A local folder for a model or adapter given as a folder or a Hub id; other strings come back unchanged
    (the caller says "no such folder"). A Hub id resolves to its cache snapshot without the weights
    (`fetch_weights` brings those); either way the weights' format is checked."""
    subject = f"{key}: {name}" if key else name
    if Path(name).expanduser().is_dir():
        folder = Path(name).expanduser()
        _check_weight_format(folder, {p.name for p in folder.iterdir() if p.is_file()}, allow_pickle, subject)
        return name  # a folder without weights fails where it loads, naming the files transformers looked for
    if not Path(name).expanduser().exists():
        _check_not_a_missing_run(name, subject)
    if not is_repo_id(name):
        return name
    patterns = [*MODEL_FILES, *(["*.py"] if trust_remote_code else [])]  # never fetch code nobody will run
    snapshot = snapshot_of(_download(name, "model", revision, patterns, subject, revision_key, no_folder=True))
    # Offline, a cache without the weights is fine until they are needed (`tunelab data` needs none).
    _weight_files(snapshot, allow_pickle, subject, required_in_cache=False)
    return str(snapshot.folder)


def _check_not_a_missing_run(name: str, subject: str) -> None:
    """saves/sft_base is spelled like org/name, but when an example config writes it, or writes its runs beside it
    (a typo under saves/), it is a folder not made yet: say so instead of asking the Hub."""
    outputs = run_folder.example_output_dirs()
    path = Path(name).expanduser().resolve()
    if path in outputs:
        raise ModelError(f"{subject}: no such folder in {Path.cwd()}; {outputs[path]} writes it: "
                         f"run `tunelab train {outputs[path]}` first")
    if path.parent != Path.cwd().resolve() and path.parent in {folder.parent for folder in outputs}:
        parent = Path(name).expanduser().parent
        held = sorted(p.name for p in parent.iterdir() if p.is_dir()) if parent.is_dir() else []
        raise ModelError(f"{subject}: no such folder in {Path.cwd()}; {parent}/ (where the examples write their "
                         f"runs) holds {', '.join(held) or 'no folders'}")


def fetch_file(repo_id: str, filename: str, revision: str, what: str) -> Path:
    """One file of a model repo (a GGUF: weights, config and tokenizer in one) in the cache snapshot, fetched now;
    `what` starts the error messages ("model_name_or_path: org/name (gguf_file: x.gguf)")."""
    snapshot = _download(repo_id, "model", revision, [filename], what, "model_revision", no_folder=True)
    if not (snapshot / filename).is_file():
        if is_offline():  # snapshot_download answered with what the cache holds of the repo
            raise ModelError(f"{what} is not in the Hugging Face cache ({snapshot.parents[2]}), and HF_HUB_OFFLINE is "
                             f"set; fetch it with `hf download {repo_id} {filename}` or unset HF_HUB_OFFLINE")
        raise ModelError(f"{what}: the repo has no file {filename} at revision '{revision}'")
    return snapshot / filename


def fetch_weights(folder: str | Path, allow_pickle: bool = False, key: str = "model_name_or_path") -> None:
    """Bring the weight files of a Hub cache snapshot into it (cached ones are not fetched again). Other
    folders are left alone: their files are what they are."""
    snapshot = snapshot_of(folder)
    if snapshot is None:
        return
    subject = f"{key}: {snapshot.repo_id}" if key else snapshot.repo_id
    names = _weight_files(snapshot, allow_pickle, subject)
    if not all((snapshot.folder / n).is_file() for n in names):
        _download(snapshot.repo_id, "model", snapshot.commit, names, f"{subject} ({names[0]})", None, snapshot.cache_dir)
    missing = [n for n in names if not (snapshot.folder / n).is_file()]
    if missing:  # an index naming a shard the repo does not have, or a download that stopped short
        raise ModelError(
            f"{subject}: {missing[0]} is not in the Hugging Face cache ({snapshot.cache_dir}) at revision "
            f"'{snapshot.commit}'; {_fetch_hint(snapshot)}"
        )


def fetch_dataset(repo_id: str, revision: str, patterns: Sequence[str], what: str) -> Path:
    """The cache snapshot of a dataset repo holding (at least) the files that match `patterns`."""
    return _download(repo_id, "dataset", revision, list(patterns), what, "revision", error=DataError)


# ---- weights ---------------------------------------------------------------------------------------------------


def _weight_files(snapshot: Snapshot, allow_pickle: bool, subject: str, required_in_cache: bool = True) -> list[str]:
    """The weight files of a snapshot's repo to load; a repo without any is refused (and, with
    required_in_cache, a cache without any when the Hub cannot list the repo)."""
    files, complete = _repo_files(snapshot)
    names = _check_weight_format(snapshot.folder, files, allow_pickle, subject)
    if not names and (complete or required_in_cache):
        where = "" if complete else f" in the Hugging Face cache ({snapshot.cache_dir}); {_fetch_hint(snapshot)}"
        raise ModelError(
            f"{subject} (commit {snapshot.commit}) has no model.safetensors or adapter_model.safetensors{where}"
        )
    return names


def _check_weight_format(folder: Path, files: set[str], allow_pickle: bool, subject: str) -> list[str]:
    """The weight files to load, safetensors first ([] if the folder has none); pickle files only when allowed."""
    safe = _weights_among(files, folder, SAFETENSORS_WEIGHTS)
    if safe:
        return safe
    pickled = _weights_among(files, folder, PICKLE_WEIGHTS)
    if pickled and not allow_pickle:
        raise ModelError(
            f"{subject} has only pickle weights ({pickled[0]}), which can run code when loaded; tunelab reads "
            "safetensors: use a safetensors copy of the model, or set allow_pickle_weights: true if you trust its source"
        )
    return pickled


def _weights_among(files: set[str], folder: Path, names: Iterable[str]) -> list[str]:
    for name in names:
        if name not in files:
            continue
        if not name.endswith(".index.json"):
            return [name]
        try:
            weight_map = json.loads((folder / name).read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelError(f"{folder / name}: not a readable shard index ({exc}); the download is damaged") from None
        return sorted(set(weight_map.values()))
    return []


def _repo_files(snapshot: Snapshot) -> tuple[set[str], bool]:
    """(the repo's files at that commit, whether that is the Hub's complete listing): the Hub's listing when it
    can be reached, else what the cache holds."""
    if not is_offline():
        try:  # one request, not retried when the Hub is unreachable (a tree listing would be)
            info = HfApi().repo_info(snapshot.repo_id, revision=snapshot.commit, repo_type=snapshot.repo_type)
            return {sibling.rfilename for sibling in info.siblings or []}, True
        except Exception:  # noqa: BLE001 - unreachable or refusing: snapshot_download fell back on the cache too
            pass
    cached = snapshot.folder.iterdir() if snapshot.folder.is_dir() else ()
    return {p.name for p in cached if p.is_file()}, False  # weight files lie at the top of a repo


# ---- downloads and their errors ----------------------------------------------------------------------------------


def _download(
    repo_id: str, repo_type: str, revision: str, patterns: list[str], what: str, revision_key: str | None,
    cache_dir: Path | None = None, error: type[TunelabError] = ModelError, no_folder: bool = False,
) -> Path:
    """snapshot_download, its failures as one line each. `what` starts the message ("model_name_or_path:
    org/name"); `no_folder` adds that no local folder has that name either."""
    cache = cache_dir or Path(constants.HF_HUB_CACHE)
    neither = "no local folder, " if no_folder else ""
    try:
        folder = snapshot_download(
            repo_id, repo_type=repo_type, revision=revision, allow_patterns=patterns, cache_dir=cache_dir
        )
    except errors.GatedRepoError:
        raise error(
            f"{what} is gated on the Hugging Face Hub: accept its terms on {_hub_url(repo_id, repo_type)}, "
            "then set HF_TOKEN (or run `hf auth login`)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise error(f"{what} is {neither}not a {repo_type} on the Hugging Face Hub (a private one needs HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise error(f"{revision_key}: '{revision}' is not a branch, tag or commit of {repo_id} on the Hugging Face Hub") from None
    except errors.LocalEntryNotFoundError as exc:  # not (completely) cached, and the Hub not reachable
        at = "" if revision == "main" else f" at revision '{revision}'"
        state = "incomplete in" if type(exc).__name__ == "IncompleteSnapshotError" else "not in"
        reason = "HF_HUB_OFFLINE is set" if is_offline() else f"the Hub cannot be reached ({_cause(exc)})"
        raise error(
            f"{what} is {neither}{state} the Hugging Face cache ({cache}){at}, and {reason}; "
            f"{fetch_hint(repo_id, repo_type, revision)}"
        ) from None
    except errors.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        token = "; check HF_TOKEN" if status in (401, 403) else ""
        raise error(f"{what}: the Hugging Face Hub answered {status or _cause(exc)}{token}") from None
    except errors.HFValidationError as exc:
        raise error(f"{what} is {neither}not a valid Hugging Face Hub id ({_cause(exc)})") from None
    return Path(folder)


def _cause(exc: BaseException) -> str:
    """The error underneath huggingface_hub's own (a connection error, say), by its class name."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    return type(root).__name__


def _hub_url(repo_id: str, repo_type: str) -> str:
    return f"{constants.ENDPOINT}/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"


def is_offline() -> bool:
    """HF_HUB_OFFLINE, as huggingface_hub read it when first imported."""
    return bool(constants.HF_HUB_OFFLINE)


def fetch_hint(repo_id: str, repo_type: str, revision: str) -> str:
    """How to bring a repo into the cache by hand."""
    command = f"hf download {repo_id}" + (" --repo-type dataset" if repo_type == "dataset" else "")
    command += "" if revision == "main" else f" --revision {revision}"
    return f"fetch it with `{command}`" + (" or unset HF_HUB_OFFLINE" if is_offline() else "")


def _fetch_hint(snapshot: Snapshot) -> str:
    return fetch_hint(snapshot.repo_id, snapshot.repo_type, snapshot.commit)
