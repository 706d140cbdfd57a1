"""GRPO: the shared generating-stage workflow (rl/workflow.py) with reward functions as the scorer
and rl/grpo.py as the step."""

from __future__ import annotations

from tunelab.config.args import RunConfig
from tunelab.train.rl import workflow
from tunelab.train.rl.grpo import GRPO
from tunelab.train.rl.rewards import load_reward_functions


def run_grpo(config: RunConfig) -> dict:
    ft = config.finetuning

    def reward_functions(device, tokenizer, template):
        return load_reward_functions(ft.reward_funcs or [], ft.reward_weights, workflow.config_dir(config))

    return workflow.run_stage(config, GRPO, reward_functions)
