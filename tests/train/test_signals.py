"""SIGTERM / SIGINT: finish the step, save a checkpoint, exit 128 + signum with the command that resumes."""

from __future__ import annotations

import shlex
import signal
import subprocess
import time

import pytest
import transformers

from tests.train.reliability_helpers import cli_command, cli_env, losses, train, write_config
from tunelab.cli import main
from tunelab.run_folder import is_complete, latest_checkpoint
from tunelab.train.signals import StopOnSignal


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_prints_how_to_resume(tmp_path):
    config = write_config(tmp_path, save_strategy="no", max_steps=400)  # no scheduled saves at all
    out = tmp_path / "out"
    process = subprocess.Popen(
        cli_command(config, "learning_rate=1e-3"), env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, cwd=tmp_path,
    )
    try:
        log = out / "trainer_log.jsonl"
        while not (log.is_file() and len(log.read_text().splitlines()) >= 2):  # two steps done
            assert process.poll() is None, process.stderr.read()[-2000:]
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()

    assert process.returncode == 128 + signal.SIGTERM == 143
    last = stderr.strip().splitlines()[-1]
    checkpoint = latest_checkpoint(out)
    step = int(checkpoint.name.split("-")[1])
    assert last == (
        f"tunelab: SIGTERM received: training stopped at step {step}, checkpoint saved to {checkpoint}; "
        f"resume with: tunelab train {config} learning_rate=1e-3 resume_from_checkpoint=true"
    )
    assert is_complete(checkpoint) and 2 <= step < 400
    assert not (out / "adapter_model.safetensors").exists()  # the final save did not run

    command = shlex.split(last.split("resume with: ")[1])
    assert main([*command[1:], "max_steps=" + str(step + 2)]) == 0  # the printed command, run to 2 more steps
    assert sorted(losses(out)) == list(range(1, step + 3))  # one log, no step twice
    assert (out / "adapter_model.safetensors").is_file()


def test_the_handler_flags_sigint_and_stops_at_the_step_boundary():
    before = signal.getsignal(signal.SIGINT)
    stop = StopOnSignal()
    stop.install()
    try:
        # A real signal, raised in this (the main) thread: os.kill may be delivered to another thread of the
        # process (a server or streamer left by an earlier test), and the handler would run a little later.
        signal.raise_signal(signal.SIGINT)
        assert stop.received == signal.SIGINT
        control = transformers.TrainerControl()
        stop.on_step_end(None, transformers.TrainerState(), control)
        assert control.should_save and control.should_training_stop
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C does not wait
            signal.raise_signal(signal.SIGINT)
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGINT) is before
