"""Config checks of stages grpo and ppo: one line naming the key and the fix, before anything loads."""

from __future__ import annotations

import pytest

from tunelab.preflight import load_config
from tunelab.errors import ConfigError


def _check(tmp_path, **overrides) -> str:
    base = {"stage": "grpo", "template": "chatml", "dataset": "demo_sort", "output_dir": str(tmp_path / "out"),
            "reward_funcs": "exact_match,format"}
    with pytest.raises(ConfigError) as info:
        load_config(None, {**base, **overrides})
    return str(info.value)


def test_grpo_and_ppo_configs_that_pass(tmp_path):
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "config.json").write_text("{}")
    grpo = load_config(None, {"stage": "grpo", "template": "chatml", "dataset": "demo_sort",
                              "output_dir": str(tmp_path / "a"), "reward_funcs": "exact_match,format",
                              "reward_weights": "1,0.5", "num_generations": "4", "temperature": "0.8",
                              "loss_type": "dapo", "scale_rewards": "batch", "epsilon_high": "0.28",
                              "importance_sampling_level": "sequence", "mask_truncated_completions": "true",
                              "dynamic_sampling": "true", "top_entropy_quantile": "0.2"})
    rloo = load_config(None, {"stage": "grpo", "template": "chatml", "dataset": "demo_sort",
                              "output_dir": str(tmp_path / "b"), "reward_funcs": "code_tests",
                              "advantage_estimator": "rloo"})
    assert rloo.finetuning.advantage_estimator == "rloo"
    ft = grpo.finetuning
    assert ft.top_entropy_quantile == 0.2
    assert (ft.loss_type, ft.scale_rewards, ft.epsilon_high, ft.importance_sampling_level,
            ft.mask_truncated_completions, ft.dynamic_sampling) == ("dapo", "batch", 0.28, "sequence", True, True)
    assert grpo.finetuning.reward_funcs == ["exact_match", "format"] and grpo.finetuning.reward_weights == [1.0, 0.5]
    assert grpo.generation.temperature == 0.8
    ppo = load_config(None, {"stage": "ppo", "template": "chatml", "dataset": "demo_sort",
                             "output_dir": str(tmp_path / "b"), "reward_model": str(tmp_path / "rm")})
    assert ppo.finetuning.reward_model == str(tmp_path / "rm")


def test_rl_check_messages(tmp_path):
    (tmp_path / "rewards.py").write_text("def score(prompts, completions, references):\n    return [0.0] * len(completions)\n")
    (tmp_path / "empty_rm").mkdir()
    cases = [
        ({"reward_funcs": None},
         "reward_funcs: stage grpo needs reward functions; set reward_funcs: exact_match,format (built-ins) or "
         "path/to/file.py:function"),
        ({"reward_funcs": "exact_match,accuracy"},
         "reward_funcs: 'accuracy' is not a built-in reward (exact_match, format, item_match, code_tests); "
         "name your own as "
         "path/to/file.py:function or package.module:function"),
        ({"reward_funcs": "nowhere/rewards.py:score"},
         "reward_funcs: file nowhere/rewards.py does not exist; give a path relative to the working directory or "
         "the config file"),
        ({"reward_funcs": f"{tmp_path}/rewards.py:scores"},
         f"reward_funcs: {tmp_path}/rewards.py has no function 'scores'; define scores(prompts, completions, references)"),
        ({"reward_weights": "1,2,3"}, "reward_weights has 3 values for 2 reward_funcs: give one weight per function"),
        ({"num_generations": "1"},
         "num_generations must be at least 2 (advantages compare completions of the same prompt), got 1"),
        ({"stage": "ppo", "reward_funcs": None},
         "reward_model: stage ppo needs a reward model; train one with stage: rm and set reward_model to its output_dir"),
        ({"stage": "ppo", "reward_funcs": None, "reward_model": str(tmp_path / "none")},
         f"reward_model: {tmp_path / 'none'} is not a folder; set it to the output_dir of a stage rm run"),
        ({"stage": "ppo", "reward_funcs": None, "reward_model": str(tmp_path / "empty_rm")},
         f"reward_model: {tmp_path / 'empty_rm'} has neither config.json nor adapter_config.json; set it to the "
         "output_dir of a stage rm run"),
        ({"stage": "ppo"}, "reward_funcs only applies to stage grpo (got stage: ppo): remove it"),
        ({"stage": "sft", "reward_funcs": None, "kl_coef": "0.1"},
         "kl_coef only applies to stage grpo / ppo (got stage: sft): remove it"),
        ({"reward_model": str(tmp_path)}, "reward_model only applies to stage ppo (got stage: grpo): remove it"),
        ({"temperature": "0"}, "temperature must be > 0 (rollouts are sampled), got 0.0"),
        ({"kl_coef": "-1"}, "kl_coef must be >= 0, got -1.0"),
        ({"epsilon": "0"}, "epsilon must be > 0 (the ratio is clipped to 1 ± epsilon), got 0.0"),
        ({"num_iterations": "0"}, "num_iterations must be at least 1, got 0"),
        ({"loss_type": "gspo"}, "loss_type: 'gspo' is not one of grpo, dapo, dr_grpo, bnpo"),
        ({"scale_rewards": "true"}, "scale_rewards: 'true' is not one of group, batch, none"),
        ({"importance_sampling_level": "sequence_token"},
         "importance_sampling_level: 'sequence_token' is not one of token, sequence"),
        ({"epsilon_high": "0.1"},
         "epsilon_high must be >= epsilon (the ratio is clipped to [1 - epsilon, 1 + epsilon_high]), got 0.1 < 0.2"),
        ({"stage": "ppo", "reward_funcs": None, "reward_model": str(tmp_path / "rm"), "loss_type": "dapo"},
         "loss_type only applies to stage grpo (got stage: ppo): remove it"),
        ({"stage": "sft", "reward_funcs": None, "epsilon_high": "0.28"},
         "epsilon_high only applies to stage grpo (got stage: sft): remove it"),
        ({"stage": "sft", "reward_funcs": None, "mask_truncated_completions": "true"},
         "mask_truncated_completions only applies to stage grpo (got stage: sft): remove it"),
        ({"advantage_estimator": "rloo", "scale_rewards": "none"},
         "scale_rewards only applies to advantage_estimator: grpo (got rloo): remove it"),
        ({"advantage_estimator": "reinforce"},
         "advantage_estimator: 'reinforce' is not one of grpo, rloo, reinforce_plus_plus, "
         "reinforce_plus_plus_baseline"),
        ({"stage": "sft", "reward_funcs": None, "advantage_estimator": "rloo"},
         "advantage_estimator only applies to stage grpo (got stage: sft): remove it"),
        ({"stage": "dpo", "reward_funcs": None, "scale_rewards": "none"},
         "scale_rewards only applies to stage grpo (got stage: dpo): remove it"),
        ({"stage": "sft", "reward_funcs": None, "importance_sampling_level": "sequence"},
         "importance_sampling_level only applies to stage grpo (got stage: sft): remove it"),
        ({"stage": "sft", "reward_funcs": None, "dynamic_sampling": "true"},
         "dynamic_sampling only applies to stage grpo (got stage: sft): remove it"),
        ({"top_entropy_quantile": "1.5"}, "top_entropy_quantile must be in [0, 1] (the share of tokens kept), got 1.5"),
        ({"stage": "sft", "reward_funcs": None, "top_entropy_quantile": "0.2"},
         "top_entropy_quantile only applies to stage grpo (got stage: sft): remove it"),
        ({"packing": "true"},
         "packing: true does not apply to stage grpo (it trains on its own generations); set packing: false"),
        ({"padding_free": "true"},
         "padding_free: true does not apply to stage grpo (it trains on its own generations); remove it"),
        ({"eval_strategy": "steps", "eval_dataset": "demo_sort_test"},
         "eval_strategy: stage grpo has no eval loss; remove eval_strategy and use eval_generation (held-out exact "
         "match before and after)"),
    ]
    for overrides, message in cases:
        assert _check(tmp_path, **overrides) == message, overrides
