"""Executed rewards (code_tests): right code scores, and a hostile completion suite: each hostile run scores 0,
ends within its limits, leaves no process or file behind, sees nothing of the parent, and the batch goes on."""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from tunelab.errors import DataError
from tunelab.train.rl import code_sandbox
from tunelab.train.rl.code_sandbox import extract_code, run_tests, split_tests
from tunelab.train.rl.rewards import CodeTestsReward, load_reward_functions, reward_run_stats, score_completions

TESTS = "assert f(2) == 4\nassert f(3) == 9\nassert f(-1) == 1"
RIGHT = "def f(x):\n    return x * x"
TIMEOUT_S = 2.0  # the limit the hostile runs get


def run(code: str, tests: str = TESTS, timeout_s: float = TIMEOUT_S):
    return run_tests(code, split_tests(tests), timeout_s=timeout_s)


def leftover_processes(polls: int = 1000) -> list[int]:
    """Processes whose environment names a run's folder (HOME=.../tunelab-run-...), polled until there are none
    (killed processes take a moment to exit; up to 10 s): what a run left alive."""
    for _ in range(polls):
        found = _processes_of_runs()
        if not found:
            return found
        time.sleep(0.01)
    return found


def _processes_of_runs() -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if b"tunelab-run-" in handle.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def test_extract_code_takes_the_first_python_block_or_the_whole_text():
    assert extract_code("Here:\n```python\ndef f(): pass\n```\nThen ```python\nx\n```") == "\ndef f(): pass\n"
    assert extract_code("```py\ndef f(): pass") == "\ndef f(): pass"  # cut by max_new_tokens: to the end
    assert extract_code("```\ndef f(): pass\n```") == "\ndef f(): pass\n"
    assert extract_code("def f(): pass") == "def f(): pass"


def test_split_tests_counts_asserts_and_keeps_setup():
    assert split_tests("import math\nassert f(1) == 1\nassert f(2) == 4") == [
        ("import math", False), ("assert f(1) == 1", True), ("assert f(2) == 4", True)]


def test_right_code_passes_every_assert_and_partly_right_code_some():
    assert run(RIGHT).score == 1.0
    partial = run("def f(x):\n    return x + x")  # right for 2 only
    assert (partial.passed, partial.total, partial.status) == (1, 3, "ok")
    assert partial.score == pytest.approx(1 / 3)


def test_code_that_fails_to_load_scores_zero():
    assert run("def f(x) return x").score == 0.0  # SyntaxError
    assert run("raise SystemExit(0)\ndef f(x): return x * x").score == 0.0


HOSTILE = {
    "infinite loop": "while True:\n    pass",
    "sleeps forever": "import time\ntime.sleep(3600)",
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "child that outlives": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)",
    "prints megabytes": "print('x' * 10_000_000)\n" + RIGHT,
    "huge allocation": "block = bytearray(8 * 2**30)\n" + RIGHT,
    "os._exit before the tests": RIGHT + "\nimport os\nos._exit(0)",
    "segfault": "import faulthandler\nfaulthandler._sigsegv()\n" + RIGHT,
    "deep recursion": "import sys\nsys.setrecursionlimit(10**7)\ndef g(n): return g(n + 1)\ng(0)\n" + RIGHT,
    "subprocess": "import subprocess\nsubprocess.run(['sleep', '3600'])\n" + RIGHT,
    "ctypes": "import ctypes\nctypes.string_at(0)\n" + RIGHT,
    "socket": "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\n" + RIGHT,
    "reads the parent's environment": (
        "import os\nassert 'TUNELAB_TEST_SECRET' not in os.environ, 'leaked'\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n"
        "        assert b'TUNELAB_TEST_SECRET' not in open(f'/proc/{pid}/environ', 'rb').read(), 'leaked'\n"
        "    except (OSError, ValueError):\n"
        "        pass\n" + RIGHT
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_hostile_completion_scores_zero_and_leaves_nothing_behind(name, monkeypatch):
    monkeypatch.setenv("TUNELAB_TEST_SECRET", "s3cret")
    result = run(HOSTILE[name])
    if name == "reads the parent's environment":
        # Nothing to read: the code passes its own checks and the tests (what it does is harmless).
        assert result.score == 1.0 and "leaked" not in result.output
    else:
        assert result.score == 0.0, (name, result)
    assert leftover_processes() == []
    assert "s3cret" not in result.output


def test_writing_outside_the_folder_is_refused(tmp_path):
    target = tmp_path / "written.txt"
    code = (f"import os\nopen({str(target)!r}, 'w').write('x')\n" + RIGHT)
    assert run(code).score == 0.0
    code = (f"import os\nos.close(os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT))\n" + RIGHT)
    assert run(code).score == 0.0
    assert not target.exists()
    inside = run("open('scratch.txt', 'w').write('ok')\n" + RIGHT)  # its own folder is writable
    assert inside.score == 1.0


def test_the_run_folder_is_fresh_and_removed():
    code = "import os\nfolder = os.getcwd()\nnames = os.listdir('.')\nprint(folder)\n" + RIGHT
    tests = "assert os.environ['HOME'] == folder\nassert names == ['output.txt']\n" + TESTS
    result = run(code, tests)
    assert (result.passed, result.total) == (5, 5)
    folder = result.output.splitlines()[0]
    assert "tunelab-run-" in folder and not os.path.exists(folder)


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_reward_scores_a_mixed_batch_and_counts_timeouts_and_crashes():
    reward = CodeTestsReward(code_sandbox.CodeRunner(workers=2, timeout_s=TIMEOUT_S))
    completions = [
        f"```python\n{RIGHT}\n```", HOSTILE["infinite loop"], HOSTILE["os._exit before the tests"],
        "def f(x):\n    return x + x", HOSTILE["prints megabytes"],
    ]
    scores = reward(["p"] * 5, completions, [TESTS] * 5)
    assert scores == [1.0, 0.0, 0.0, pytest.approx(1 / 3), 0.0]
    assert reward.pop_stats() == {"runs": 5.0, "timeouts": 1.0, "crashes": 2.0}
    assert reward.pop_stats() == {"runs": 0.0, "timeouts": 0.0, "crashes": 0.0}


def test_code_tests_is_a_built_in_with_its_counts_in_the_log():
    functions = load_reward_functions(["code_tests"])
    totals, per_function = score_completions(functions, ["p"], [RIGHT], [TESTS], [True])
    assert totals == [1.0] and per_function == {"code_tests": [1.0]}
    assert reward_run_stats(functions) == {
        "reward/code_tests/runs": 1.0, "reward/code_tests/timeouts": 0.0, "reward/code_tests/crashes": 0.0}


def test_a_reference_that_is_not_a_test_program_is_one_clear_error():
    reward = CodeTestsReward()
    with pytest.raises(DataError, match="not a Python test program"):
        reward(["p"], [RIGHT], ["the answer is 4"])
    with pytest.raises(DataError, match="no assert statement"):
        reward(["p"], [RIGHT], ["x = 1"])


def test_isolation_level_is_probed_and_named():
    level, prefix = code_sandbox.isolation()
    assert level in {"namespaces, read-only root", "namespaces", "audit"}
    assert (level == "audit") == (prefix == ())


@pytest.mark.skipif(code_sandbox.isolation()[0] == "audit", reason="needs network namespaces (unshare)")
def test_with_namespaces_the_network_is_gone_not_only_refused():
    code = textwrap.dedent("""
        import socket
        try:
            socket.create_connection(('1.1.1.1', 80), timeout=1)
            reached = True
        except OSError:
            reached = False
    """)
    result = run(code, "assert not reached")
    assert result.score == 1.0


@pytest.mark.parametrize("name", ["socket", "fork bomb", "child that outlives", "infinite loop", "subprocess"])
@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_without_namespaces_the_audit_hook_still_contains_the_run(name, monkeypatch):
    # A machine where unshare cannot make namespaces: the prelude's hook refuses sockets and forks instead.
    monkeypatch.setattr(code_sandbox, "isolation", lambda: ("audit", ()))
    assert run(HOSTILE[name]).score == 0.0
    assert leftover_processes() == []
    assert run(RIGHT).score == 1.0


def test_threads_asking_at_once_probe_the_isolation_once(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    probes = []
    real_run = code_sandbox.subprocess.run

    def counting_run(*args, **kwargs):
        probes.append(args[0])
        time.sleep(0.05)  # the probe takes a while: the other threads arrive meanwhile
        return real_run(*args, **kwargs)

    monkeypatch.setattr(code_sandbox.subprocess, "run", counting_run)
    code_sandbox._probe_isolation.cache_clear()
    try:
        with ThreadPoolExecutor(4) as pool:
            levels = set(pool.map(lambda _: code_sandbox.isolation(), range(4)))
        single = len(probes)
        code_sandbox._probe_isolation.cache_clear()
        probes.clear()
        code_sandbox.isolation()
        assert len(levels) == 1 and single == len(probes)
    finally:
        code_sandbox._probe_isolation.cache_clear()
