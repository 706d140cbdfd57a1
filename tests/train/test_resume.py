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
from tunelab.config.loader import load_config
from tunelab.errors import ConfigError
from tunelab.train.checkpoints import latest_checkpoint

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
