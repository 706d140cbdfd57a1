"""Stage grpo end to end through the CLI, from the SFT'd tiny model: it trains, logs and saves a model that loads back."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tunelab.cli import main
from tunelab.run_folder import read_log
from tunelab.train.rl import grpo as grpo_module
from tunelab.train.rl.grpo import GRPO, ZERO_SPREAD_WARN_AFTER, GRPOBatch, zero_spread_warning
from tunelab.train.rl.rollout import Rollout


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


@pytest.mark.slow
def test_grpo_with_executed_rewards_and_rloo_trains_and_scores_the_held_out_answers(tmp_path):
    # The embedded tiny model writes no Python: every run fails (0), the loop goes on, the log counts the runs and
    # the results hold the held-out code_tests score before and after.
    out = tmp_path / "grpo_code"
    config = tmp_path / "grpo_code.yaml"
    config.write_text(yaml.safe_dump({
        "model_name_or_path": "tiny", "stage": "grpo", "finetuning_type": "full", "template": "chatml",
        "dataset": "demo_code", "max_samples": 8, "eval_dataset": "demo_code_test", "eval_generation": True,
        "eval_generation_samples": 2, "cutoff_len": 128, "max_new_tokens": 6, "reward_funcs": "code_tests",
        "advantage_estimator": "rloo", "num_generations": 2, "per_device_train_batch_size": 2, "max_steps": 1,
        "logging_steps": 1, "seed": 0, "disable_tqdm": True, "plot_loss": False, "output_dir": str(out),
    }))
    assert main(["train", str(config)]) == 0
    (record,) = read_log(out)
    assert record["reward/code_tests"] == 0.0 and record["reward/code_tests/runs"] == 4.0
    assert record["reward/code_tests/timeouts"] == 0.0
    metrics = json.loads((out / "all_results.json").read_text())
    assert metrics["code_tests_before"] == metrics["code_tests_solved_after"] == 0.0
    # Every rollout of the step, as sampled and scored: 2 prompts x 2 completions.
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [(s["step"], s["group"]) for s in samples] == [(1, 0), (1, 0), (1, 1), (1, 1)]
    assert all(s["reward"] == s["reward/code_tests"] == 0.0 and s["prompt"].startswith("<|im_start|>") for s in samples)


def _grpo_with(loss_type: str = "grpo", processes: int = 1, dynamic_sampling: bool = False) -> GRPO:
    finetuning = SimpleNamespace(
        num_generations=2, kl_coef=0.0, epsilon=0.2, num_iterations=1, loss_type=loss_type, scale_rewards="none",
        advantage_estimator="grpo",
        epsilon_high=None, importance_sampling_level="token", mask_truncated_completions=False,
        dynamic_sampling=dynamic_sampling, top_entropy_quantile=1.0, finetuning_type="full",
        rollout_merge_adapter=True,
    )
    config = SimpleNamespace(finetuning=finetuning, generation=SimpleNamespace(temperature=1.0, max_new_tokens=4))
    accelerator = SimpleNamespace(num_processes=processes, is_main_process=True, unwrap_model=lambda model: model)
    recorded: list[dict] = []
    loop = SimpleNamespace(accelerator=accelerator, model=None, record=recorded.append, recorded=recorded,
                           record_samples=lambda samples: None)
    return GRPO(loop, None, SimpleNamespace(pad_token_id=0), [0], [], config.finetuning, config.generation)


def _batch(tokens: int, zero_spread: bool) -> GRPOBatch:
    mask = torch.zeros(2, 4)
    mask.view(-1)[:tokens] = 1.0
    return GRPOBatch(None, torch.zeros(2), mask, zero_spread, None, None)


def test_zero_spread_warns_once_after_rounds_in_a_row_with_no_spread(caplog):
    grpo = _grpo_with()
    caplog.set_level(logging.WARNING, logger="tunelab.train.rl.grpo")
    learning, stuck = [_batch(3, False), _batch(3, True)], [_batch(3, True), _batch(3, True)]
    for batches in [stuck] * (ZERO_SPREAD_WARN_AFTER - 1) + [learning] + [stuck] * (ZERO_SPREAD_WARN_AFTER - 1):
        grpo.begin_round(batches)  # a round with one group that has spread starts the count again
    assert caplog.messages == []
    for _ in range(3):
        grpo.begin_round(stuck)
    assert caplog.messages == [zero_spread_warning(ZERO_SPREAD_WARN_AFTER, 2)]  # once, however long it lasts
    assert "partial credit" in caplog.messages[0] and "num_generations" in caplog.messages[0]


def test_dapo_token_count_spans_the_round():
    grpo = _grpo_with("dapo")
    grpo.begin_round([_batch(3, False), _batch(5, False)])
    assert grpo.dapo_tokens == 8 / 2  # the loop divides each batch's loss by 2: together sum(L) / 8
    assert _grpo_with("grpo").dapo_tokens is None


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo"])
def test_a_grpo_run_whose_reward_never_varies_logs_it_and_warns_once(tmp_path, caplog, loss_type):
    """A reward that gives every completion the same score (as exact_match does on a model that is never exactly
    right) leaves nothing to learn: every log line says all groups had zero spread, and the run says why, once."""
    (tmp_path / "flat.py").write_text("def zero(prompts, completions, references):\n    return [0.0] * len(completions)\n")
    out = tmp_path / "grpo"
    config = tmp_path / "grpo.yaml"
    config.write_text(yaml.safe_dump({
        "model_name_or_path": "tiny", "stage": "grpo", "finetuning_type": "full", "template": "chatml",
        "dataset": "demo_sort", "max_samples": 4, "cutoff_len": 64, "max_new_tokens": 4,
        "reward_funcs": "flat.py:zero", "num_generations": 2, "per_device_train_batch_size": 2, "kl_coef": 0.0,
        "loss_type": loss_type, "scale_rewards": "none", "epsilon_high": 0.28, "mask_truncated_completions": True,
        "dynamic_sampling": loss_type == "dapo", "top_entropy_quantile": 0.2 if loss_type == "dr_grpo" else 1.0,
        "max_steps": ZERO_SPREAD_WARN_AFTER + 1, "logging_steps": 1, "seed": 0, "disable_tqdm": True,
        "plot_loss": False, "output_dir": str(out),
    }))
    caplog.set_level(logging.WARNING, logger="tunelab.train.rl.grpo")
    assert main(["train", str(config)]) == 0
    records = read_log(out)
    assert [r["zero_spread_groups"] for r in records] == [1.0] * (ZERO_SPREAD_WARN_AFTER + 1)
    assert all(r["loss"] == 0.0 for r in records)
    if loss_type == "dapo":  # dynamic sampling drops both groups of every batch (and trains on nothing)
        assert [r["dropped_groups"] for r in records] == [2.0] * (ZERO_SPREAD_WARN_AFTER + 1)
        assert all(r["grad_norm"] == 0.0 for r in records)
    assert caplog.messages.count(zero_spread_warning(ZERO_SPREAD_WARN_AFTER, 2)) == 1


@pytest.mark.parametrize("rewards, kept, dropped", [
    ([1.0, 1.0, 0.0, 1.0, 2.0, 2.0], [2, 3], 2),  # the groups of equal rewards leave; advantages of the rest
    ([1.0, 1.0, 0.0, 0.0, 2.0, 2.0], [0, 1, 2, 3, 4, 5], 3),  # none would be left: all stay, loss mask empty
])
def test_dynamic_sampling_drops_the_groups_whose_rewards_are_all_equal(monkeypatch, rewards, kept, dropped):
    rollout = Rollout(torch.arange(6)[:, None].repeat(1, 3), torch.ones(6, 3), torch.ones(6, 2), 1,
                      [f"c{i}" for i in range(6)], [True] * 6)
    monkeypatch.setattr(grpo_module, "generate_rollout", lambda *args, **kwargs: rollout)
    monkeypatch.setattr(grpo_module, "score_completions", lambda *args: (rewards, {}))
    grpo = _grpo_with(dynamic_sampling=True)
    rows = [{"prompt_ids": [1], "prompt": "p", "reference": "r"}] * 3
    batch = grpo.finish_rollout(grpo.start_rollout(rows))
    assert batch.rollout.input_ids[:, 0].tolist() == kept and batch.rollout.completions == [f"c{i}" for i in kept]
    assert {"dropped_groups": dropped} in [{k: int(v) for k, v in r.items()} for r in grpo.loop.recorded
                                          if "dropped_groups" in r]
    if len(kept) == 2:
        torch.testing.assert_close(batch.advantages, torch.tensor([-0.5, 0.5]))  # scale_rewards none
        assert batch.loss_mask.sum() == 4
    else:
        assert batch.loss_mask.sum() == 0 and batch.all_zero_spread
    plain = _grpo_with()  # without dynamic sampling every row stays and nothing is dropped
    plain = plain.finish_rollout(plain.start_rollout(rows))
    assert plain.rollout.input_ids.shape[0] == 6 and plain.loss_mask.sum() == 12
