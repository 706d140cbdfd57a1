"""Resuming continues the run exactly: the losses after a resume equal the uninterrupted run's, step for
step, and so do the final weights, for map-style (unpacked and packed) and streaming SFT.

The uninterrupted run saves checkpoint-3 and checkpoint-6; the resumed run starts in a new output_dir
holding only a copy of checkpoint-3 (non-empty: the output_dir check must let it through) and finds it
with `resume_from_checkpoint: true`. 48 rows in batches of 4 (or fewer packed rows) make 6 steps cross
an epoch boundary for packed data; the streaming set repeats and shuffles within a buffer.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.train.reliability_helpers import assert_same_weights, losses, train, weights, write_config
from tunelab.preflight import load_config
from tunelab.errors import ConfigError
from tunelab.run_folder import latest_checkpoint
from tunelab.train.resume import checkpoint_problem

MODES = {
    "unpacked": {},
    "packed": {"packing": True, "finetuning_type": "full", "per_device_train_batch_size": 2},
    "streaming": {"streaming": True, "buffer_size": 8},
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One uninterrupted 6-step run per mode, made on first use."""
    runs = {}

    def get(mode: str):
        if mode not in runs:
            folder = tmp_path_factory.mktemp(f"full-{mode}")
            config = write_config(folder, **MODES[mode])
            assert train(config) == 0
            runs[mode] = (config, folder / "out")
        return runs[mode]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_resumed_run_equals_the_uninterrupted_one(tmp_path, uninterrupted, mode):
    _, reference = uninterrupted(mode)
    config = write_config(tmp_path, **MODES[mode], resume_from_checkpoint=True)
    out = tmp_path / "out"
    shutil.copytree(reference / "checkpoint-3", out / "checkpoint-3")

    assert train(config) == 0

    expected = losses(reference)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    assert losses(out) == {step: loss for step, loss in expected.items() if step > 3}  # exact floats
    assert_same_weights(weights(out), weights(reference))
    assert_same_weights(weights(out / "checkpoint-6"), weights(reference / "checkpoint-6"))
    state = json.loads((out / "checkpoint-6" / "tunelab_state.json").read_text())
    assert state == json.loads((reference / "checkpoint-6" / "tunelab_state.json").read_text())  # token counts too


@pytest.mark.slow
def test_a_checkpoint_between_log_lines_resumes_the_same_log_line_and_replaces_a_newer_folder(tmp_path):
    """Logged every 2 steps, saved every 3: checkpoint-3 holds the loss of step 3, so the resumed run's line at
    step 4 averages steps 3-4 as the uninterrupted run's does. Resumed explicitly from checkpoint-3 beside the
    earlier run's checkpoint-6, the new save at step 6 replaces that folder whole."""
    options = {"logging_steps": 2}
    reference = tmp_path / "full" / "out"
    assert train(write_config(tmp_path / "full", **options)) == 0
    out = tmp_path / "out"
    for name in ("checkpoint-3", "checkpoint-6"):
        shutil.copytree(reference / name, out / name)
    (out / "checkpoint-6" / "from-the-earlier-run").write_bytes(b"")

    assert train(write_config(tmp_path, **options, resume_from_checkpoint=str(out / "checkpoint-3"))) == 0

    expected = losses(reference)
    assert sorted(expected) == [2, 4, 6]
    assert losses(out) == {4: expected[4], 6: expected[6]}  # exact floats
    state = json.loads((out / "checkpoint-6" / "tunelab_state.json").read_text())
    assert state == json.loads((reference / "checkpoint-6" / "tunelab_state.json").read_text())
    assert not (out / "checkpoint-6" / "from-the-earlier-run").exists()
    assert checkpoint_problem(out / "checkpoint-6") is None


@pytest.mark.slow
def test_raising_max_steps_continues_a_finished_run(tmp_path, uninterrupted):
    _, reference = uninterrupted("unpacked")
    config = write_config(tmp_path, resume_from_checkpoint=True, max_steps=8)
    shutil.copytree(reference / "checkpoint-6", tmp_path / "out" / "checkpoint-6")

    assert train(config) == 0

    assert sorted(losses(tmp_path / "out")) == [7, 8]
    assert latest_checkpoint(tmp_path / "out").name == "checkpoint-8"
    before, after = weights(reference), weights(tmp_path / "out")
    assert all(not before[k].equal(after[k]) for k in before if "lora_B" in k)  # it trained


def test_resume_true_without_a_checkpoint_names_output_dir(tmp_path):
    config = write_config(tmp_path, resume_from_checkpoint=True)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoint-4").mkdir()  # half-written: no trainer_state.json
    with pytest.raises(ConfigError) as error:
        load_config(config)
    assert str(error.value).startswith(
        f"resume_from_checkpoint: true, but output_dir {tmp_path / 'out'} holds no complete checkpoint"
    )


def test_resume_from_a_path_that_is_not_a_checkpoint_fails_early(tmp_path):
    config = write_config(tmp_path, resume_from_checkpoint=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"^resume_from_checkpoint: .*nowhere is not a folder"):
        load_config(config)


@pytest.mark.slow
def test_resuming_a_finished_run_changes_nothing(tmp_path, uninterrupted, capsys):
    config, reference = uninterrupted("unpacked")
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.suffix != ".yaml"}

    assert train(write_config(tmp_path, resume_from_checkpoint=True)) == 0

    assert capsys.readouterr().err.splitlines()[-1] == (
        f"tunelab: {out}/checkpoint-6 is at step 6 and this run ends at step 6: nothing is left to train and the "
        "weights in output_dir are unchanged; raise max_steps (or num_train_epochs) to train further"
    )
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.suffix != ".yaml"}
    unchanged = {"data_report.json", "run_info.json"}  # rewritten at the start, with the same content
    assert {k for k in after if before.get(k) != after[k] and str(k) not in unchanged} == set()
    assert set(after) == set(before)  # no checkpoint-7, no new file


@pytest.mark.slow
def test_overwrite_output_dir_deletes_the_earlier_runs_checkpoints(tmp_path, uninterrupted, caplog):
    _, reference = uninterrupted("unpacked")
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    config = write_config(tmp_path, overwrite_output_dir=True, max_steps=1, save_strategy="no")
    del_note = "overwrite_output_dir: deleted 2 checkpoint folder(s) of the earlier run in"

    assert train(config) == 0

    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == []
    assert f"{del_note} {out} (checkpoint-3, checkpoint-6)" in caplog.messages
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):  # so nothing old can be continued
        load_config(config, ["resume_from_checkpoint=true"])


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path, uninterrupted):
    _, reference = uninterrupted("unpacked")
    shutil.copytree(reference / "checkpoint-3", tmp_path / "out" / "checkpoint-3")
    found = tmp_path / "out" / "checkpoint-3"
    other = write_config(tmp_path, resume_from_checkpoint=True, learning_rate=1e-3, dataset="demo_sort", lora_rank=4)
    with pytest.raises(ConfigError) as error:
        load_config(other)
    assert str(error.value) == (
        f"resume_from_checkpoint: {found} comes from a run with other options: dataset (['demo_reverse'] → "
        "['demo_sort']), lora_rank (8 → 4), learning_rate (0.002 → 0.001); resuming would continue that run, not this "
        "one. Start a fresh run (another output_dir, or overwrite_output_dir: true without resume_from_checkpoint), "
        "restore those values, or set resume_config_mismatch: allow"
    )
    allowed = load_config(other, ["resume_config_mismatch=allow"])  # the expert's override
    assert allowed.training.resume_from_checkpoint == str(found)
    # what does not change the trajectory may change: more steps, other logging and saving
    same = load_config(write_config(tmp_path, resume_from_checkpoint=True, max_steps=9, logging_steps=2, save_steps=4))
    assert same.training.resume_from_checkpoint == str(found)


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_skipped_and_the_run_continues_exactly(tmp_path, uninterrupted, caplog):
    _, reference = uninterrupted("unpacked")
    out = tmp_path / "out"
    for name in ("checkpoint-3", "checkpoint-6"):
        shutil.copytree(reference / name, out / name)
    (out / "checkpoint-6" / "adapter_model.safetensors").write_bytes(b"truncated")
    (out / "checkpoint-6" / "trainer_state.json").write_text("{}")  # no longer the run's step 6 either

    assert train(write_config(tmp_path, resume_from_checkpoint=True)) == 0

    assert any(m.startswith("resume_from_checkpoint: true skips checkpoint-6: adapter_model.safetensors is 9 bytes")
               for m in caplog.messages)
    expected = losses(reference)
    assert losses(out) == {step: loss for step, loss in expected.items() if step > 3}
    assert_same_weights(weights(out), weights(reference))
