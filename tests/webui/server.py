"""`tunelab webui` started as a real process on a loopback port, and the HTTP calls the tests make to it."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

SRC = Path(__file__).resolve().parents[2] / "src"
QUICK_FORM = {  # examples/quickstart.yaml, cut to a few steps of 4 samples, a checkpoint every 2 steps
    "model_name_or_path": "tiny", "stage": "sft", "finetuning_type": "full", "template": "chatml",
    "dataset": "demo_sort", "max_samples": "200", "cutoff_len": "64", "per_device_train_batch_size": "4",
    "learning_rate": "2.0e-3", "lr_scheduler_type": "cosine", "logging_steps": "1", "save_steps": "2",
    "seed": "42",
}


def run_cli(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "tunelab.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@contextmanager
def webui_server(cwd: Path, args: list[str] = ()) -> Iterator[str]:
    """The base URL (no trailing slash) of `tunelab webui --port 0 ARGS` running in cwd; stopped afterwards
    (the runs it started are the test's to stop)."""
    env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    process = subprocess.Popen([sys.executable, "-m", "tunelab.cli", "webui", "--port", "0", *args], cwd=cwd,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = process.stdout.readline()
        match = re.search(r"(http://[\d.]+:\d+)/", line)
        assert match, f"no URL in the first line of tunelab webui: {line!r}"
        yield match.group(1)
    finally:
        process.terminate()
        process.wait(timeout=30)


def call(url: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict | str]:
    """(status, JSON or text) of a GET (body None) or JSON POST."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            status, raw, kind = response.status, response.read().decode(), response.headers.get("content-type", "")
    except urllib.error.HTTPError as error:
        status, raw, kind = error.code, error.read().decode(), error.headers.get("content-type", "")
    return status, json.loads(raw) if kind.startswith("application/json") else raw


def basic(user_password: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(user_password.encode()).decode()}


def wait_for(condition, timeout: float, what: str):
    """condition()'s first truthy value, polled; fails naming `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)
