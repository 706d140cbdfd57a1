"""FSDP on CPU (model/sharding.py): what the load-time sharding cannot do is one line each, before anything starts.
The runs themselves are tests/train/test_fsdp.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tunelab.errors import ConfigError
from tunelab.model.sharding import check_cpu_fsdp, load_gathered_weights


def args(**fsdp_config):
    config = {"reshard_after_forward": True, "min_num_params": 0, "xla": False, **fsdp_config}
    return SimpleNamespace(fsdp=True, fsdp_config=config, save_strategy="no", save_only_model=False)


def test_full_shard_over_two_processes_passes():
    check_cpu_fsdp(args(version=2, transformer_layer_cls_to_wrap=["LlamaDecoderLayer"],
                        state_dict_type="FULL_STATE_DICT"), 2, "sft")


@pytest.mark.parametrize("stage", ["dpo", "grpo"])
def test_stages_beyond_the_trainer_path_are_refused(stage):
    with pytest.raises(ConfigError) as error:
        check_cpu_fsdp(args(), 2, stage)
    assert str(error.value) == (
        f"fsdp on CPU runs stages pt and sft only; stage {stage} with fsdp needs GPUs (accelerate's FSDP), or drop "
        "fsdp (nproc_per_node alone trains data-parallel on CPU)")


@pytest.mark.parametrize("option, shown", [
    ({"reshard_after_forward": False}, "fsdp_config.reshard_after_forward: False"),  # shard_grad_op
    ({"state_dict_type": "SHARDED_STATE_DICT"}, "fsdp_config.state_dict_type: 'SHARDED_STATE_DICT'"),
    ({"cpu_offload": True}, "offloading"),
])
def test_what_needs_accelerates_fsdp_is_one_line(option, shown):
    with pytest.raises(ConfigError) as error:
        check_cpu_fsdp(args(**option), 2, "sft")
    assert str(error.value).startswith(f"fsdp on CPU: {shown} needs GPUs (accelerate's FSDP); ")


def test_an_unsharded_model_resumes_the_trainers_way(tmp_path):
    from torch import nn  # noqa: PLC0415

    (tmp_path / "model.safetensors").write_bytes(b"")
    assert load_gathered_weights(nn.Linear(2, 2), tmp_path) is False  # untouched: no DTensor, no read
