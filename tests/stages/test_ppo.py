"""Stage ppo end to end through the CLI: LoRA policy + value head over the SFT'd tiny model, scored by a
reward model folder in the stage-rm format; the adapter and the value head load back."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from tunelab.cli import main
from tunelab.run_folder import read_log


@pytest.fixture(scope="module")
def reward_model_dir(sft_model_dir, tmp_path_factory):
    """A reward model folder as stage rm saves one (sequence classification, one label, pad id set); its
    head is random here: the test is about the loop, not about what the reward means."""
    folder = tmp_path_factory.mktemp("rm")
    tokenizer = AutoTokenizer.from_pretrained(sft_model_dir)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        sft_model_dir, num_labels=1, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_ppo_trains_logs_and_saves(sft_model_dir, reward_model_dir, tmp_path, precision):
    out = tmp_path / "ppo"
    config = tmp_path / "ppo.yaml"
    config.write_text(yaml.safe_dump({
        "model_name_or_path": str(sft_model_dir), "stage": "ppo", "finetuning_type": "lora", "lora_rank": 4,
        "template": "chatml", "dataset": "demo_sort,demo_reverse", "max_samples": 8, "cutoff_len": 64,
        "max_new_tokens": 10, "reward_model": str(reward_model_dir), "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2, "max_steps": 2, "logging_steps": 1, "learning_rate": 1e-3, "seed": 0,
        "disable_tqdm": True, "plot_loss": False, "output_dir": str(out),
    }))
    assert main(["train", str(config)]) == 0

    records = read_log(out)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert {"loss", "policy_loss", "value_loss", "reward", "kl", "value", "clip_ratio", "completion_length",
                "learning_rate", "grad_norm"} <= set(record)
    metrics = json.loads((out / "all_results.json").read_text())
    assert metrics["train_steps"] == 2 and metrics["train_rounds"] == 2
    assert metrics["reward_first"] == records[0]["reward"] and metrics["reward_last"] == records[1]["reward"]

    value_head = load_file(out / "value_head.safetensors")
    assert value_head["weight"].shape == (1, 128) and value_head["weight"].abs().sum() > 0  # it trained from 0
    base = AutoModelForCausalLM.from_pretrained(sft_model_dir)
    policy = PeftModel.from_pretrained(base, out)
    adapter = load_file(out / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in adapter.items())  # the adapter moved off zero
    assert policy.peft_config["default"].r == 4
