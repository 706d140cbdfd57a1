"""Training runs as the web UI sees them: launched as `tunelab train` processes, found on disk, read from their files.

Launch: the form's YAML is written to the UI's state folder (`.tunelab_webui/launches/<n>/config.yaml`) and
`python -m tunelab.cli train config.yaml` starts in its own session (start_new_session), its output going to
console.log beside it, so closing the browser or stopping the UI does not end it. A thread waits for it and
records the exit code in launch.json. Stop sends SIGTERM: the trainer finishes the step, saves a checkpoint and
exits 143 (train/signals.py). Resume starts the same config with resume_from_checkpoint=true.

Watch: everything shown comes from the run's files, read through tunelab/run_folder.py — trainer_log.jsonl,
all_results.json, the checkpoint folders — so runs started with the CLI into a folder under the allowed roots show
up too.
Eval and export run the same way, as `tunelab eval` / `tunelab export` processes (jobs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunelab.errors import ConfigError
from tunelab.run_folder import (
    CHECKPOINT_PREFIX, LOG_FILE, RESULTS, RUN_RECORD, STAGING_PREFIX, checkpoint_folders, checkpoint_step, is_complete, read_json,
    read_log,
)
from tunelab.webui.security import Roots

STATE_DIR = ".tunelab_webui"
LAUNCH_FILE = "launch.json"
CONSOLE_FILE = "console.log"
CONFIG_FILE = "config.yaml"
RECENT_SECONDS = 120  # a run started elsewhere counts as running while its log changed this recently
SKIPPED_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", STATE_DIR}
SEARCH_DEPTH = 4


class Refused(ConfigError):
    """A request the UI turns down with a reason (HTTP 409)."""


def error_line(console: str) -> str | None:
    """The line that says why a process failed: tunelab's own one-line error, else a traceback's last line."""
    lines = [line.strip() for line in console.replace("\r", "\n").splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("tunelab: error:"):
            return line
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if ":" in line and head.replace(".", "").isidentifier() and (head.endswith("Error") or head.endswith("Exception")):
            return line
    return lines[-1] if lines else None


def tail(path: Path, lines: int = 40) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            text = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    text = text.replace("\r", "\n")  # progress bars redraw with \r
    return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) is not running
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


@dataclass
class Launch:
    """One process the UI started: a training run or a job (eval, export)."""

    folder: Path  # its state folder
    kind: str
    output_dir: Path
    pid: int
    started: float
    command: list[str]
    exit_code: int | None = None
    child: bool = False  # a process of this UI that its waiting thread has not seen end yet

    @classmethod
    def read(cls, folder: Path) -> "Launch | None":
        data = read_json(folder / LAUNCH_FILE)
        if not isinstance(data, dict):
            return None
        return cls(folder, data["kind"], Path(data["output_dir"]), data["pid"], data["started"], data["command"],
                   data.get("exit_code"))

    def write(self) -> None:
        data = {"kind": self.kind, "output_dir": str(self.output_dir), "pid": self.pid, "started": self.started,
                "command": self.command, "exit_code": self.exit_code}
        tmp = self.folder / (LAUNCH_FILE + ".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        tmp.replace(self.folder / LAUNCH_FILE)

    @property
    def alive(self) -> bool:
        return self.exit_code is None and (self.child or _pid_alive(self.pid))

    @property
    def console(self) -> Path:
        return self.folder / CONSOLE_FILE


class RunManager:
    def __init__(self, roots: Roots, python: str | None = None):
        self.roots = roots
        self.state = roots.base / STATE_DIR / "launches"
        self.python = python or sys.executable
        self.lock = threading.Lock()
        self.children: dict[int, subprocess.Popen] = {}

    # ---- starting processes -------------------------------------------------------------------------------

    def _start(self, kind: str, output_dir: Path, args: list[str], config_text: str | None = None) -> Launch:
        self.state.mkdir(parents=True, exist_ok=True)
        number = 1 + max((int(p.name) for p in self.state.iterdir() if p.name.isdigit()), default=0)
        folder = self.state / f"{number:04d}"
        folder.mkdir()
        if config_text is not None:
            (folder / CONFIG_FILE).write_text(config_text, encoding="utf-8")
        args = [str(folder / CONFIG_FILE) if a == CONFIG_FILE else a for a in args]
        command = [self.python, "-m", "tunelab.cli", *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with (folder / CONSOLE_FILE).open("wb") as console:
            process = subprocess.Popen(command, cwd=self.roots.base, stdout=console, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        launch = Launch(folder, kind, output_dir, process.pid, time.time(), command)
        launch.write()
        self.children[process.pid] = process
        threading.Thread(target=self._wait, args=(launch, process), daemon=True).start()
        return launch

    def _wait(self, launch: Launch, process: subprocess.Popen) -> None:
        launch.exit_code = process.wait()
        launch.write()
        self.children.pop(process.pid, None)

    def launches(self, kind: str | None = None) -> list[Launch]:
        if not self.state.is_dir():
            return []
        children = dict(self.children)  # before the files: a child that ends meanwhile is in one or the other
        found = [Launch.read(p) for p in sorted(self.state.iterdir()) if p.is_dir()]
        for launch in found:
            child = children.get(launch.pid) if launch is not None and launch.exit_code is None else None
            if child is not None:  # a child of this UI: running until its waiting thread has the exit code
                launch.exit_code, launch.child = child.returncode, True
        return [launch for launch in found if launch is not None and (kind is None or launch.kind == kind)]

    def latest_launch(self, output_dir: Path, kind: str = "train") -> Launch | None:
        matching = [launch for launch in self.launches(kind) if launch.output_dir == output_dir]
        return matching[-1] if matching else None

    def live_launch(self, output_dir: Path) -> Launch | None:
        return next((launch for launch in reversed(self.launches("train"))
                     if launch.output_dir == output_dir and launch.alive), None)

    def refuse_if_live(self, out: Path) -> None:
        live = self.live_launch(out)
        if live is not None:
            raise Refused(f"output_dir: {out} already has a live run (pid {live.pid}, started "
                          f"{time.strftime('%H:%M:%S', time.localtime(live.started))}); stop it or choose "
                          "another output_dir")

    def launch(self, config_text: str, output_dir: str, resume: bool = False) -> Launch:
        """Start `tunelab train config.yaml`; refused while a run the UI started into output_dir still runs."""
        out = self.roots.resolve(output_dir, "output_dir")
        with self.lock:  # two tabs pressing Start at once: one launches, the other is refused
            self.refuse_if_live(out)
            if not resume:
                return self._start("train", out, ["train", CONFIG_FILE], config_text)
            return self._start("train", out, ["train", CONFIG_FILE, "resume_from_checkpoint=true"], config_text)

    def resume(self, output_dir: str) -> Launch:
        """The same config again with resume_from_checkpoint=true: the UI's own config.yaml for a run it
        launched, else the tunelab_config.yaml the run recorded."""
        out = self.roots.resolve(output_dir, "output_dir")
        previous = self.latest_launch(out)
        if previous is not None and (previous.folder / CONFIG_FILE).is_file():
            text = (previous.folder / CONFIG_FILE).read_text(encoding="utf-8")
        elif (out / RUN_RECORD).is_file():
            text = (out / RUN_RECORD).read_text(encoding="utf-8")
        else:
            raise Refused(f"{out}: no config to resume from (neither a launch of this UI nor {RUN_RECORD})")
        return self.launch(text, str(out), resume=True)

    def stop(self, output_dir: str) -> Launch:
        out = self.roots.resolve(output_dir, "output_dir")
        live = self.live_launch(out)
        if live is None:
            raise Refused(f"{out}: no run that this UI started is running there")
        os.kill(live.pid, signal.SIGTERM)  # the trainer saves a checkpoint and exits 143
        return live

    def job(self, kind: str, output_dir: Path, args: list[str]) -> Launch:
        return self._start(kind, output_dir, args)

    def find_job(self, number: str) -> Launch:
        launch = next((launch for launch in self.launches() if launch.folder.name == number), None)
        if launch is None:
            raise Refused(f"no job {number}")
        return launch

    # ---- what is on disk ----------------------------------------------------------------------------------

    def run_dirs(self) -> list[Path]:
        """Folders under the allowed roots that hold a run (its log or its record), and those the UI launched into."""
        found: dict[Path, None] = {}

        def walk(folder: Path, depth: int) -> None:
            try:
                entries = list(folder.iterdir())
            except OSError:
                return
            names = {e.name for e in entries}
            if LOG_FILE in names or (RUN_RECORD in names and not folder.name.startswith(f"{CHECKPOINT_PREFIX}-")):
                found[folder] = None
            if depth >= SEARCH_DEPTH:
                return
            for entry in sorted(entries):
                if entry.is_dir() and not entry.is_symlink() and entry.name not in SKIPPED_DIRS \
                        and not entry.name.startswith((".", f"{CHECKPOINT_PREFIX}-", STAGING_PREFIX)):
                    walk(entry, depth + 1)

        for root in self.roots.folders:
            walk(root, 0)
        for launch in self.launches("train"):
            found[launch.output_dir] = None
        return list(found)

    def status(self, output_dir: Path) -> dict[str, Any]:
        """What a run is doing, from its launch record (when the UI started it) and its files."""
        launch = self.latest_launch(output_dir)
        log = output_dir / LOG_FILE
        results = output_dir / RESULTS
        info: dict[str, Any] = {"dir": str(output_dir), "name": self._name(output_dir), "error": None,
                                "launched_here": launch is not None}
        if launch is not None and launch.alive:
            info["state"] = "running"
        elif launch is not None and launch.exit_code is not None:
            code = launch.exit_code
            info["exit_code"] = code
            if code == 0:
                info["state"] = "finished"
            elif code in (128 + signal.SIGTERM, 128 + signal.SIGINT, -signal.SIGTERM):
                info["state"] = "stopped"
            else:
                info["state"] = "crashed"
                info["error"] = error_line(launch.console.read_text(encoding="utf-8", errors="replace")) \
                    if launch.console.is_file() else None
        elif results.is_file() and (not log.is_file() or results.stat().st_mtime >= log.stat().st_mtime - 1):
            info["state"] = "finished"
        elif log.is_file() and time.time() - log.stat().st_mtime < RECENT_SECONDS:
            info["state"] = "running (started outside this UI)"
        elif not log.is_file() and launch is None:
            info["state"] = "model folder"  # an export, or a folder a run recorded without a log
        else:
            info["state"] = "ended" if launch is not None else "incomplete"
        records = read_log(output_dir)
        last = next((r for r in reversed(records) if "loss" in r or "eval_loss" in r), records[-1] if records else None)
        if last:
            info.update(step=last.get("step"), max_steps=last.get("max_steps"), eta_seconds=last.get("eta_seconds"),
                        elapsed_seconds=last.get("elapsed_seconds"))
        info["checkpoints"] = self.checkpoints(output_dir)
        info["metrics"] = read_json(results) if results.is_file() else None
        info["has_model"] = any((output_dir / name).is_file() for name in
                                ("model.safetensors", "adapter_model.safetensors", "model.safetensors.index.json"))
        return info

    def _name(self, output_dir: Path) -> str:
        for root in self.roots.folders:
            if output_dir.is_relative_to(root):
                return str(output_dir.relative_to(root)) or "."
        return str(output_dir)

    @staticmethod
    def checkpoints(output_dir: Path) -> list[dict[str, Any]]:
        try:
            folders = checkpoint_folders(output_dir)
        except OSError:
            return []
        return [{"name": f.name, "step": checkpoint_step(f), "complete": is_complete(f)} for f in folders]

    def console_of(self, output_dir: Path) -> str:
        launch = self.latest_launch(output_dir)
        return tail(launch.console) if launch is not None else ""
