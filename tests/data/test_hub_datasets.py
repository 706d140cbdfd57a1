"""Datasets from the Hugging Face Hub (dataset_info.json `hf_hub_url`), read from a Hub cache laid out in
huggingface_hub's own format with HF_HUB_OFFLINE=1, through the same file readers as local files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.hub_cache import hub_env, lay_out, run_python
from tunelab.data.registry import load_registry
from tunelab.errors import ConfigError

NEW = hashlib.sha1(b"new").hexdigest()
OLD = hashlib.sha1(b"old").hexdigest()
CARD = """---
configs:
- config_name: main
  default: true
  data_files:
  - split: train
    path: data/train.jsonl
  - split: test
    path: data/test.jsonl
- config_name: extra
  data_files: extra/*.jsonl
---
# org/chat
"""


def jsonl(*outputs: str) -> str:
    return "".join(json.dumps({"instruction": "say", "output": o}) + "\n" for o in outputs)


def registry(folder: Path, entries: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dataset_info.json").write_text(json.dumps(entries))
    return folder


# ---- dataset_info.json -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry, message", [
    ({"ms_hub_url": "AI-ModelScope/alpaca"},
     " has only ms_hub_url; tunelab reads datasets from the Hugging Face Hub (hf_hub_url) or local files (file_name)"),
    ({"om_hub_url": "HaM/alpaca"},
     " has only om_hub_url; tunelab reads datasets from the Hugging Face Hub (hf_hub_url) or local files (file_name)"),
    ({"file_name": "a.json", "subset": "x"}, ": subset applies to hf_hub_url datasets only; remove it"),
    ({"file_name": "a.json", "folder": "x"}, ": folder applies to hf_hub_url datasets only; remove it"),
    ({"file_name": "a.json", "hf_hub_url": "org/a"}, " needs exactly one of file_name, hf_hub_url or generator"),
    ({"hf_hub_url": "https://huggingface.co/datasets/org/a"},
     ": hf_hub_url must be a Hub dataset id like org/name, got 'https://huggingface.co/datasets/org/a'"),
])
def test_hub_keys_are_checked(tmp_path, entry, message):
    folder = registry(tmp_path, {"d": entry})
    entries = load_registry(str(folder))  # entries are checked when a run uses them
    with pytest.raises(ConfigError) as info:
        entries["d"]
    assert str(info.value) == f"{folder / 'dataset_info.json'}: dataset 'd'{message}"


def test_llamafactory_entries_with_several_hubs_read_the_hugging_face_one(tmp_path):
    entry = {"hf_hub_url": "llamafactory/alpaca_en", "ms_hub_url": "llamafactory/alpaca_en", "om_hub_url": "HaM/alpaca_en",
             "subset": "default", "folder": "data", "split": "test", "revision": "v1"}
    spec = load_registry(str(registry(tmp_path, {"alpaca_en": entry})))["alpaca_en"]
    assert (spec.hf_hub_url, spec.subset, spec.folder, spec.split, spec.revision, spec.file_name) == (
        "llamafactory/alpaca_en", "default", "data", "test", "v1", None)


# ---- reading them, offline ----------------------------------------------------------------------------------------


@pytest.mark.slow  # a fresh interpreter (Hub variables are read at import): not make test-fast's
def test_hub_datasets_read_from_the_cache(tmp_path):
    cache = tmp_path / "hub"
    lay_out(cache, "org/chat", {
        "README.md": CARD, "data/train.jsonl": jsonl("a", "b", "c"), "data/test.jsonl": jsonl("t"),
        "extra/more.jsonl": jsonl("x", "y"),
    }, NEW, repo_type="dataset")
    lay_out(cache, "org/chat", {"README.md": CARD, "data/train.jsonl": jsonl("old"), "data/test.jsonl": jsonl("t")},
            OLD, refs=("v0",), repo_type="dataset")
    lay_out(cache, "org/plain", {  # no card: datasets' split names in file names decide
        "data/train-00000-of-00002.jsonl": jsonl("p1"), "data/train-00001-of-00002.jsonl": jsonl("p2"),
        "data/validation-00000-of-00001.jsonl": jsonl("v"), "raw/train.jsonl": jsonl("r1", "r2"),
        "bad/train.jsonl": jsonl("fine") + "{not json\n",
    }, NEW, repo_type="dataset")
    entries = {
        "chat": {"hf_hub_url": "org/chat"},
        "chat_test": {"hf_hub_url": "org/chat", "split": "test"},
        "chat_extra": {"hf_hub_url": "org/chat", "subset": "extra"},
        "chat_v0": {"hf_hub_url": "org/chat", "revision": "v0"},
        "chat_old_commit": {"hf_hub_url": "org/chat", "revision": OLD},
        "plain": {"hf_hub_url": "org/plain", "folder": "data"},
        "plain_validation": {"hf_hub_url": "org/plain", "folder": "data", "split": "validation"},
        "plain_raw": {"hf_hub_url": "org/plain", "folder": "raw"},
        "no_subset": {"hf_hub_url": "org/chat", "subset": "nope"},
        "no_split": {"hf_hub_url": "org/chat", "split": "validation"},
        "no_revision": {"hf_hub_url": "org/chat", "revision": "v9"},
        "no_repo": {"hf_hub_url": "org/missing"},
        "bad_line": {"hf_hub_url": "org/plain", "folder": "bad"},
    }
    folder = registry(tmp_path / "data", entries)
    outcomes = run_python(f"""
import json
from tunelab.data.dataset_files import describe, load_rows, resolve_files
from tunelab.data.registry import load_registry
from tunelab.errors import TunelabError

specs = load_registry({str(folder)!r})
def outcome(name):
    try:
        files = resolve_files(specs[name])
        return [[str(f) for f in files], list(load_rows(specs[name])["output"]), describe(specs[name])["hub"]["commit"]]
    except TunelabError as exc:
        return str(exc)
print(json.dumps({{name: outcome(name) for name in {list(entries)!r}}}))
""", hub_env(cache), tmp_path)

    def snapshot(repo: str, commit: str) -> Path:
        return cache / f"datasets--org--{repo}" / "snapshots" / commit

    def ok(repo: str, commit: str, files: list[str], outputs: list[str]) -> list:
        return [[str(snapshot(repo, commit) / f) for f in files], outputs, commit]

    missing_fix = "fetch it with `hf download org/{} --repo-type dataset{}` or unset HF_HUB_OFFLINE"
    assert outcomes == {
        "chat": ok("chat", NEW, ["data/train.jsonl"], ["a", "b", "c"]),
        "chat_test": ok("chat", NEW, ["data/test.jsonl"], ["t"]),
        "chat_extra": ok("chat", NEW, ["extra/more.jsonl"], ["x", "y"]),
        "chat_v0": ok("chat", OLD, ["data/train.jsonl"], ["old"]),
        "chat_old_commit": ok("chat", OLD, ["data/train.jsonl"], ["old"]),
        "plain": ok("plain", NEW, ["data/train-00000-of-00002.jsonl", "data/train-00001-of-00002.jsonl"], ["p1", "p2"]),
        "plain_validation": ok("plain", NEW, ["data/validation-00000-of-00001.jsonl"], ["v"]),
        "plain_raw": ok("plain", NEW, ["raw/train.jsonl"], ["r1", "r2"]),
        "no_subset": "dataset 'no_subset': hf_hub_url org/chat has no subset 'nope' (BuilderConfig 'nope' not found. "
                     "Available: ['main', 'extra'])",
        "no_split": f"dataset 'no_split': hf_hub_url org/chat has no 'validation' data files at commit {NEW} "
                    f"(splits: train, test) in the Hugging Face cache; {missing_fix.format('chat', ' --revision ' + NEW)}",
        "no_revision": f"dataset 'no_revision': hf_hub_url org/chat is not in the Hugging Face cache ({cache}) at "
                       f"revision 'v9', and HF_HUB_OFFLINE is set; {missing_fix.format('chat', ' --revision v9')}",
        "no_repo": f"dataset 'no_repo': hf_hub_url org/missing is not in the Hugging Face cache ({cache}), and "
                   f"HF_HUB_OFFLINE is set; {missing_fix.format('missing', '')}",
        "bad_line": f"{snapshot('plain', NEW) / 'bad' / 'train.jsonl'}:2: Expecting property name enclosed in double "
                    "quotes; fix or remove that line",
    }
