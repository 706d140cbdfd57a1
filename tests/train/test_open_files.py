"""Open file descriptors (seed 000 §5.1): the limit raise is logged, a limit too low for the DataLoader workers is
said before training, and running out — in a worker or in the main process — ends in one line with the fix, not
a traceback. The limits are lowered in child processes (and restored in this one)."""

from __future__ import annotations

import re
import resource
import subprocess
import sys
import textwrap

import pytest

from tunelab.train.open_files import HEADROOM, check_open_file_budget, open_descriptors, worker_descriptors
from tunelab.train.run import explain_error

from .reliability_helpers import REPO_ROOT, cli_env, write_config

FIX = (r"too many open files \(limit {limit}\): raise it with `ulimit -n 65536` before the run, or lower "
       r"dataloader_num_workers \(0 passes batches without descriptors\) / preprocessing_num_workers")

LOWER_AT_STEP = """\
import os
import resource

import transformers


class LowerOpenFileLimit(transformers.TrainerCallback):
    \"\"\"At the start of step `at`, lower the soft limit to what is open: the next descriptor the run needs fails.\"\"\"

    def __init__(self, at):
        self.at = at

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            opened = len(os.listdir("/proc/self/fd")) - 1
            resource.setrlimit(resource.RLIMIT_NOFILE, (opened, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
"""


def test_the_budget_covers_what_is_open_plus_the_workers():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert worker_descriptors(0, None) == 0
    assert worker_descriptors(4, None) == 4 * (2 * 4 + 6) == worker_descriptors(4, 2)
    try:
        opened = open_descriptors()
        limit = opened + worker_descriptors(2, 2) + HEADROOM - 1  # one short
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        message = check_open_file_budget(num_workers=2, prefetch_factor=None)
        assert message == (
            f"the open-file limit ({limit}) is too low for this run: {opened} descriptors are open before training, "
            f"dataloader_num_workers: 2 adds about 28 (each worker's pipes, and each tensor of its 2 batches in "
            f"flight), plus {HEADROOM} for files opened while training (checkpoints, logs); raise it with "
            "`ulimit -n 65536` before the run (the hard limit of the container or service caps it), or lower "
            "dataloader_num_workers"
        )
        assert check_open_file_budget(num_workers=0, prefetch_factor=None) is None  # no workers, nothing to add
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit + 1, hard))
        assert check_open_file_budget(num_workers=2, prefetch_factor=None) is None
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
def test_a_worker_running_out_of_descriptors_is_explained_in_one_line(tmp_path):
    """A real DataLoader worker hits EMFILE; torch re-raises it in the main process as an OSError without errno
    (the original only in the message). explain_error still turns it into the fix."""
    script = tmp_path / "worker_emfile.py"
    script.write_text(textwrap.dedent("""\
        import resource

        import torch
        from torch.utils.data import DataLoader, Dataset

        from tunelab.train.run import explain_error


        class OpensFiles(Dataset):
            def __len__(self):
                return 2

            def __getitem__(self, index):
                held = [open("/dev/null") for _ in range(1000)]  # more than the limit allows
                return torch.zeros(1)


        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        try:
            list(DataLoader(OpensFiles(), num_workers=1))
        except Exception as exc:
            print(type(exc).__name__, exc.errno if isinstance(exc, OSError) else None, "[Errno 24]" in str(exc))
            print(explain_error(exc))
    """))
    done = subprocess.run([sys.executable, str(script)], env=cli_env(), capture_output=True, text=True, timeout=300)
    kind, message = done.stdout.strip().splitlines()
    assert kind == "OSError None True"
    assert re.fullmatch(FIX.format(limit=64), message)


@pytest.mark.slow
def test_tunelab_train_under_a_low_limit_warns_then_ends_in_one_line(tmp_path):
    """`tunelab train` in a child whose hard limit is 90: the soft limit is raised to it (logged), the budget
    check warns before training (2 workers need more), and when the descriptors do run out at step 2 (the
    callback lowers the soft limit to what is open) the DataLoader's "Too many open files" RuntimeError ends in
    the one-line fix."""
    (tmp_path / "lower.py").write_text(LOWER_AT_STEP)
    config = write_config(
        tmp_path, max_steps=6, save_strategy="no", save_steps=None, dataloader_num_workers=2,
        callbacks="lower.py:LowerOpenFileLimit", callback_kwargs={"LowerOpenFileLimit": {"at": 2}},
    )

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 90))

    done = subprocess.run(
        [sys.executable, "-m", "tunelab.cli", "train", str(config)], cwd=REPO_ROOT, env=cli_env(),
        preexec_fn=low_limit, capture_output=True, text=True, timeout=600,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    raised = [line for line in lines if line.endswith("open-file limit raised from 48 to 90 (the soft limit, up to the hard one)")]
    assert len(raised) == 1, lines  # logged once
    warning = next(line for line in lines if "the open-file limit (90) is too low for this run" in line)
    assert "dataloader_num_workers: 2 adds about 28" in warning
    assert "Traceback" not in done.stderr
    assert re.fullmatch("tunelab: error: " + FIX.format(limit=r"\d+"), lines[-1]), lines[-1]
    assert explain_error(RuntimeError("unrelated")) is None
