"""Stage grpo end to end through the CLI, from the SFT'd tiny model: it trains, logs and saves a model that loads back."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tunelab.cli import main
from tunelab.run_folder import read_log


@pytest.mark.slow
def test_grpo_trains_logs_and_saves(sft_model_dir, tmp_path, precision):
    (tmp_path / "my_rewards.py").write_text(
        "def short(prompts, completions, references):\n    return [-0.01 * len(c) for c in completions]\n"
    )
    out = tmp_path / "grpo"
    config = tmp_path / "grpo.yaml"
    config.write_text(yaml.safe_dump({
        "model_name_or_path": str(sft_model_dir), "stage": "grpo", "finetuning_type": "full", "template": "chatml",
        "dataset": "demo_sort", "max_samples": 8, "eval_dataset": "demo_sort_test", "eval_generation": True,
        "eval_generation_samples": 4, "cutoff_len": 64, "max_new_tokens": 10,
        "reward_funcs": "exact_match,format,my_rewards.py:short",  # the file is found beside the config
        "reward_weights": "1,0.5,1", "num_generations": 4, "per_device_train_batch_size": 2,
        "num_iterations": 2, "max_steps": 2, "logging_steps": 2, "learning_rate": 1e-4, "seed": 0,
        "disable_tqdm": True, "plot_loss": False, "output_dir": str(out),
    }))
    assert main(["train", str(config)]) == 0

    (record,) = read_log(out)  # one log line at step 2: both iterations on the one batch of rollouts
    assert record["step"] == 2 and record["max_steps"] == 2
    assert {"loss", "reward", "reward_std", "reward/exact_match", "reward/format", "reward/my_rewards.py:short",
            "kl", "clip_ratio", "completion_length", "learning_rate", "grad_norm", "elapsed_seconds"} <= set(record)
    assert record["reward"] == pytest.approx(
        record["reward/exact_match"] + 0.5 * record["reward/format"] + record["reward/my_rewards.py:short"], abs=1e-5
    )
    metrics = json.loads((out / "all_results.json").read_text())
    assert metrics["train_steps"] == 2 and metrics["train_rounds"] == 1
    assert {"exact_match_before", "exact_match_after", "reward_first", "reward_last"} <= set(metrics)
    assert yaml.safe_load((out / "tunelab_config.yaml").read_text())["stage"] == "grpo"

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert "<|im_start|>" in tokenizer.chat_template
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    model = AutoModelForCausalLM.from_pretrained(out)
    trained, start = load_file(out / "model.safetensors"), load_file(sft_model_dir / "model.safetensors")
    assert any(not torch.equal(trained[k], start[k]) for k in start)  # the policy moved
    assert model.config.vocab_size == 864
