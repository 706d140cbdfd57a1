"""The real-model recipes (examples/real/) load their GGUF file directly: each names the file scripts/fetch_real.py
puts in the cache, and the Qwen2.5-Coder ones pass `tunelab data verify` with the real file (its tokenizer and chat
template read from it). Skipped, saying why, when the file cannot be had."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.real_assets import fetch_real, real
from tunelab.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "real"
RECIPES = {  # recipe -> the fetch_real item whose file it loads
    "sft_lora": "smollm2", "sft_full": "smollm2", "dpo": "smollm2", "grpo": "smollm2",
    "qwen2.5-coder-0.5b_sft_lora": "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b_sft_lora": "qwen2.5-coder-1.5b",
    "grpo_tools": "qwen2.5-coder-0.5b",
}


@pytest.mark.parametrize("recipe, item", RECIPES.items())
def test_each_recipe_names_its_gguf_file_in_the_cache(recipe, item):
    named = yaml.safe_load((EXAMPLES / f"{recipe}.yaml").read_text())["model_name_or_path"]
    default_cache = Path.home() / ".cache" / "tunelab" / "real"
    assert Path(named).expanduser() == default_cache / item / fetch_real.ITEMS[item].main_file


@pytest.mark.slow
# The 1.5B recipe differs only in its file (the same tokenizer and template) and its config parse costs the suite
# about two minutes more: the test above checks the file it names.
@pytest.mark.parametrize("recipe", ["qwen2.5-coder-0.5b_sft_lora"])
def test_the_qwen_recipes_pass_data_verify_with_the_real_file(recipe, tmp_path, capsys):
    path = real(RECIPES[recipe])
    assert main(["data", "verify", str(EXAMPLES / f"{recipe}.yaml"), f"model_name_or_path={path}",
                 f"output_dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert "ok: every check passed" in out and "vocab_size 151936" in out
    assert "ending with '<|im_end|>' as one token" in out  # the file's ChatML template, its end token whole


def test_the_real_recipes_rewards_pay_the_answer_not_an_echo_in_a_call():
    # Resolved as the recipes name them, by the loader training uses.
    from tunelab.train.rl.rewards import resolve_reward_fn

    root = Path(__file__).parents[1]
    sum_reward, number_reward = (resolve_reward_fn(f"examples/real/rewards.py:{name}", base_dir=root)
                                 for name in ("sum_reward", "number_reward"))
    answers = ["68", "The sum is 68.", "67", '{"name": "python", "arguments": {"code": "68"}}']
    assert sum_reward([""] * 4, answers, ["68"] * 4) == [1.0, 0.5, 0.0, 0.5]
    assert number_reward([""] * 4, answers, ["68"] * 4) == [1.0, 0.5, 0.0, 0.0]
