"""Running a completion's Python code against hidden tests in a separate, limited process.

This module owns the sandbox of executed rewards (rewards.py's `code_tests`): one child process per run, and
what that child may do. It knows nothing of models, tokens or rewards' weights.

Each run (`run_tests`) gets:
- its own fresh temporary folder, which is its working directory, HOME and TMPDIR, removed afterwards;
- an environment of five variables (PATH, HOME, TMPDIR, LANG, PYTHONDONTWRITEBYTECODE): no proxies, tokens or
  other secrets of the training process; `python -I -S`: no PYTHON* variables, no site-packages, stdlib only;
- resource limits set by the child's trusted prelude before the code runs, inherited by anything it forks:
  address space (memory_bytes), CPU seconds, size of any file written (output is written to a file in the
  folder, so printing megabytes hits this limit and kills the run), no core dumps;
- a wall-time limit: at timeout_s the whole process group is killed (SIGKILL), forks included;
- isolation at the strongest level this machine allows (`isolation()`, probed once and logged):
  "namespaces, read-only root" runs the child under `unshare` in new network, PID and mount namespaces: no
  network interface but a down loopback; its own /proc (other processes' environments are not visible); every
  process of the run dies with it, even one that left the process group; the root filesystem read-only but for
  the run's folder (other mounts such as /dev/shm keep their modes). "namespaces": the same without the read-only
  root. "audit" (no unshare works): the prelude's audit hook refuses sockets and forks (a fork could leave the
  process group), and the run dies by process group.
- the prelude's audit hook, at every level, also refuses: opening a file for writing outside the folder,
  removing or renaming files outside it, reading other processes' /proc entries, starting programs
  (subprocess, os.system, exec*, posix_spawn), ctypes (native code would bypass the hook) and more than MAX_FORKS
  forks down one line of descent. The hook is Python-level; the namespaces are the kernel's.

What it does not guarantee: the score is reported by the prelude inside the same process as the completion,
so code written to attack the prelude itself (reading its frames, writing its result file) can forge a pass.
The guarantee is containment: a run cannot outlive its limit, reach the network, read the parent's environment,
or write outside its folder through Python's file API; and a hostile run costs at most its limits.

Runs are independent; `CodeRunner.run_many` runs a batch's completions on a pool, and grpo calls it on its scoring
thread while the next batch generates (train/rl/grpo.py).
"""

from __future__ import annotations

import ast
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

logger = logging.getLogger(__name__)

TIMEOUT_S = 5.0  # wall time per run: start-up of the child (~50 ms) plus the tests
MEMORY_BYTES = 256 * 2**20  # address space of each process of a run
FILE_BYTES = 1 * 2**20  # the largest file a run may write, its captured output included
# Forks down one line of descent: a fork bomb stays at 2^2 processes, so a run holds at most 4 x MEMORY_BYTES.
MAX_FORKS = 2
GROUP_EXIT_POLLS = 500  # every 10 ms: up to 5 s for a killed run's processes to exit
RESULT_FILE = ".tunelab_result"
OUTPUT_FILE = "output.txt"
_NAMESPACES = ("--net", "--pid", "--fork", "--kill-child", "--mount-proc")  # --mount-proc: its own /proc, --mount
_USER = ("--user", "--map-root-user")  # unprivileged user namespaces; root needs none
# Inside the new mount namespace: the run's folder stays writable, every other file of the root mount is read-only.
# sh stays the namespace's PID 1 (python is not exec'd into it): the kernel ignores signals PID 1 has no handler
# for, so a python there would survive its own segfault signal.
_READ_ONLY_ROOT = ("sh", "-c", 'mount --rbind "$HOME" "$HOME" && mount -o remount,bind,ro / && cd "$HOME" && "$0" "$@"')
_INIT = ("sh", "-c", '"$0" "$@"')
ISOLATIONS = (  # strongest first: (level, command prefix without the unshare binary)
    ("namespaces, read-only root", (*_USER, *_NAMESPACES, *_READ_ONLY_ROOT)),
    ("namespaces, read-only root", (*_NAMESPACES, *_READ_ONLY_ROOT)),
    ("namespaces", (*_USER, *_NAMESPACES, *_INIT)),
    ("namespaces", (*_NAMESPACES, *_INIT)),
)

# The trusted prelude: it reads the job, sets the limits, installs the audit hook, then runs the completion and
# each test statement in one namespace and writes how many assert statements passed. Output of the completion
# goes to OUTPUT_FILE (capped by RLIMIT_FSIZE).
PRELUDE = r"""
import json, os, resource, sys
job = json.loads(sys.stdin.read())
limit = lambda what, value: resource.setrlimit(what, (value, value))
limit(resource.RLIMIT_AS, job["memory_bytes"])
limit(resource.RLIMIT_CPU, job["cpu_s"])
limit(resource.RLIMIT_FSIZE, job["file_bytes"])
limit(resource.RLIMIT_CORE, 0)
home = os.path.realpath(os.getcwd())
out = os.open("output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
os.dup2(out, 1); os.dup2(out, 2); os.close(out)
sys.stdin = open(os.devnull)

def _inside(path, realpath=os.path.realpath, join=os.path.join, fsdecode=os.fsdecode, prefix=home + os.sep):
    # The functions are bound now: the completion shares sys.modules and could replace os.path's.
    if isinstance(path, int):  # an open file descriptor
        return True
    try:
        return realpath(join(home, fsdecode(path))).startswith(prefix)
    except TypeError:
        return False

def _hook(event, args, forks=[0], audit_only=job["audit_only"], max_forks=job["max_forks"], _inside=_inside,
          write_flags=os.O_WRONLY | os.O_RDWR):
    if event == "open":
        path, mode, flags = args
        writes = (mode is not None and any(c in mode for c in "wax+")) or (flags & write_flags)
        if writes and not _inside(path):
            raise PermissionError(f"sandbox: no writing outside the run's folder: {path}")
        if isinstance(path, str) and path.startswith("/proc/") and not path.startswith("/proc/self/"):
            raise PermissionError("sandbox: no reading other processes")  # their environ holds the parent's secrets
    elif event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.symlink", "os.link",
                   "os.truncate", "shutil.rmtree"):
        if not all(_inside(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))):
            raise PermissionError(f"sandbox: {event} outside the run's folder")
    elif event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile",
                   "os.forkpty", "pty.spawn"):
        raise PermissionError(f"sandbox: {event} is not allowed")
    elif event == "os.fork":
        forks[0] += 1
        if forks[0] > max_forks:
            raise PermissionError("sandbox: too many forks")
    elif event.startswith("ctypes."):  # native calls would bypass this hook
        raise PermissionError(f"sandbox: {event} is not allowed")
    elif audit_only and event.startswith("socket."):
        raise PermissionError(f"sandbox: {event} is not allowed (no network)")

sys.addaudithook(_hook)
namespace = {"__name__": "__solution__", "__builtins__": __builtins__}
passed = total = 0
try:
    exec(compile(job["code"], "<completion>", "exec"), namespace)
    loaded = True
except BaseException as error:
    print(f"completion failed: {type(error).__name__}: {error}")
    loaded = False
for statement, is_test in job["tests"]:
    total += is_test
    if not loaded:
        continue
    try:
        exec(compile(statement, "<tests>", "exec"), namespace)
        passed += is_test
    except BaseException as error:
        print(f"test failed: {statement[:200]}: {type(error).__name__}")
sys.stdout.flush()
with open(".tunelab_result", "w") as result:
    result.write(json.dumps({"passed": passed, "total": total}))
os._exit(0)
"""


@dataclass(frozen=True)
class RunResult:
    passed: int  # assert statements that passed
    total: int  # assert statements of the tests
    status: str  # "ok" (the prelude reported), "timeout" (killed at the wall-time limit), "crash" (no report)
    output: str = ""  # the start of what the run printed, for the log

    @property
    def score(self) -> float:
        return self.passed / self.total if self.status == "ok" and self.total else 0.0


def extract_code(completion: str) -> str:
    """The completion's code: its first ```python (or ```py, or bare ```) block, up to its closing fence or the
    end of the text (a completion cut by max_new_tokens); the whole text when it has no fenced block."""
    for opener in ("```python", "```py", "```"):
        start = completion.find(opener)
        if start == -1:
            continue
        body = completion[start + len(opener):]
        if opener == "```" and body[:1].isalpha():  # ```js and friends: skip the language tag's line
            body = body.split("\n", 1)[1] if "\n" in body else ""
        end = body.find("```")
        return body if end == -1 else body[:end]
    return completion


def split_tests(tests: str) -> list[tuple[str, bool]]:
    """The test program's top-level statements, each with whether it is an assert (what a score counts).
    Other statements (imports, helper definitions) run in order as setup. Raises SyntaxError on a broken program:
    the tests come from the dataset, so that is the dataset's fault, not the completion's."""
    tree = ast.parse(tests)
    return [(ast.get_source_segment(tests, node) or ast.unparse(node), isinstance(node, ast.Assert))
            for node in tree.body]


_PROBE_LOCK = threading.Lock()


def isolation() -> tuple[str, tuple[str, ...]]:
    """(level, command prefix) of the strongest ISOLATIONS that works here (probed once), else ("audit", ())."""
    with _PROBE_LOCK:  # the pool's threads ask at once: one probe, one log line
        return _probe_isolation()


@functools.lru_cache(maxsize=1)
def _probe_isolation() -> tuple[str, tuple[str, ...]]:
    unshare = shutil.which("unshare")
    for level, flags in ISOLATIONS if unshare else ():
        folder = tempfile.mkdtemp(prefix="tunelab-probe-")
        try:
            probe = subprocess.run([unshare, *flags, "true"], capture_output=True, timeout=10,
                                   env=child_environment(folder))
        except (OSError, subprocess.TimeoutExpired):
            continue
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if probe.returncode == 0:
            options = " ".join(flag for flag in flags if flag.startswith("--"))
            logger.info("code_tests: runs are isolated by %s (unshare %s)", level, options)
            return level, (unshare, *flags)
    logger.warning(
        "code_tests: unshare cannot create network namespaces here; runs are kept off the network by an audit "
        "hook only (sockets refused), and a run's processes are killed by process group"
    )
    return "audit", ()


def child_environment(folder: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1"}


def run_tests(code: str, tests: list[tuple[str, bool]], timeout_s: float = TIMEOUT_S,
              memory_bytes: int = MEMORY_BYTES, file_bytes: int = FILE_BYTES) -> RunResult:
    """Run `code`, then each statement of `tests` (split_tests), in a fresh limited child process."""
    level, prefix = isolation()
    job = {"code": code, "tests": tests, "memory_bytes": memory_bytes, "cpu_s": int(timeout_s) + 1,
           "file_bytes": file_bytes, "audit_only": level == "audit",
           # Without a PID namespace a fork could leave the process group (setsid) and outlive the run: none then.
           "max_forks": 0 if level == "audit" else MAX_FORKS}
    folder = tempfile.mkdtemp(prefix="tunelab-run-")
    try:
        process = subprocess.Popen(
            [*prefix, sys.executable, "-I", "-S", "-c", PRELUDE], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, cwd=folder, env=child_environment(folder), start_new_session=True,
        )
        try:
            process.communicate(json.dumps(job).encode(), timeout=timeout_s)
            status = "ok"
        except subprocess.TimeoutExpired:
            status = "timeout"
        finally:
            _kill_group(process)
        return _read_result(folder, status)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the run's process group (its forks too; under unshare the PID namespace then dies with them), and
    wait until the group is gone: killed processes take a moment to exit, and the next run should not share the
    cores with them."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    for _ in range(GROUP_EXIT_POLLS):
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)
    logger.warning("code_tests: processes of a killed run are still exiting after %d s", GROUP_EXIT_POLLS // 100)


def _read_result(folder: str, status: str) -> RunResult:
    output = _head(os.path.join(folder, OUTPUT_FILE), 500)
    if status == "timeout":
        return RunResult(0, 0, "timeout", output)
    try:
        report = json.loads(_head(os.path.join(folder, RESULT_FILE), 200))
        return RunResult(int(report["passed"]), int(report["total"]), "ok", output)
    except (ValueError, KeyError, TypeError):
        return RunResult(0, 0, "crash", output)


def _head(path: str, limit: int) -> str:
    try:
        with open(path, "rb") as handle:
            return handle.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


class CodeRunner:
    """A pool of threads, each waiting on one child process: runs go in as they are submitted, up to `workers`
    at a time (default: one per CPU core)."""

    def __init__(self, workers: int | None = None, timeout_s: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES):
        self.timeout_s, self.memory_bytes = timeout_s, memory_bytes
        self.pool = ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1, thread_name_prefix="code-run")

    def submit(self, code: str, tests: list[tuple[str, bool]]) -> Future[RunResult]:
        return self.pool.submit(run_tests, code, tests, self.timeout_s, self.memory_bytes)

    def run_many(self, jobs: list[tuple[str, list[tuple[str, bool]]]]) -> list[RunResult]:
        futures = [self.submit(code, tests) for code, tests in jobs]
        return [future.result() for future in futures]
