"""A Hugging Face Hub cache laid out by hand, in huggingface_hub's own format, and subprocesses that use it.

    <cache>/models--org--name/blobs/<sha256>                      the file contents
    <cache>/models--org--name/snapshots/<commit>/<path> → ../../blobs/<sha256>   (relative symlinks)
    <cache>/models--org--name/refs/main                           the commit `main` points at

huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE once, when first imported, so tests that resolve Hub ids
run tunelab in a subprocess with them set: the path a user's run takes.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.fixture_paths import REPO_ROOT


def lay_out(
    cache: Path, repo_id: str, files: dict[str, Path | bytes | str], commit: str, refs: tuple[str, ...] = ("main",),
    repo_type: str = "model",
) -> Path:
    """One commit of a repo in the cache; returns its snapshot folder."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content.encode() if isinstance(content, str) else content
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def folder_files(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, Path]:
    return {p.name: p for p in sorted(folder.iterdir()) if p.is_file() and p.name not in skip}


def hub_env(cache: Path, offline: bool = True, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)]), HF_HUB_CACHE=str(cache),
        HF_HOME=str(cache.parent / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1", **extra,
    )
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def run_tunelab(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tunelab.cli", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def run_python(code: str, env: dict[str, str], cwd: Path, timeout: float = 600):
    """Run `code` in a fresh interpreter; it prints one JSON value last, which comes back parsed."""
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def config_outcomes(cases: dict[str, tuple[str, list[str]]], env: dict[str, str], cwd: Path) -> dict[str, str]:
    """load_config(path, overrides) of every case, in one fresh interpreter: "ok <model folder>", or the
    one-line error `tunelab train` would print after "tunelab: error: "."""
    code = f"""
import json
from tunelab.preflight import load_config
from tunelab.errors import TunelabError

def outcome(path, overrides):
    try:
        return "ok " + load_config(path, overrides).model.model_name_or_path
    except TunelabError as exc:
        return str(exc)

cases = json.loads({json.dumps(cases)!r})
print(json.dumps({{name: outcome(path, overrides) for name, (path, overrides) in cases.items()}}))
"""
    return run_python(code, env, cwd)


def resolve_outcomes(cases: dict[str, dict], env: dict[str, str], cwd: Path) -> dict[str, str]:
    """tunelab/hub.py's resolve_model(**case) of every case, in one fresh interpreter (no torch, no transformers):
    "ok <folder>", or its one-line error."""
    code = f"""
import json
from tunelab.errors import TunelabError
from tunelab.hub import resolve_model

def outcome(case):
    try:
        return "ok " + resolve_model(**case)
    except TunelabError as exc:
        return str(exc)

cases = json.loads({json.dumps(cases)!r})
print(json.dumps({{name: outcome(case) for name, case in cases.items()}}))
"""
    return run_python(code, env, cwd)
