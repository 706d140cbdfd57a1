"""GRPO: the shared generating-stage workflow (rl/workflow.py) with reward functions as the scorer
and rl/grpo.py as the step."""

from __future__ import annotations

from tunelab.train.plan import RunPlan
from tunelab.train.rl import workflow
from tunelab.train.rl.grpo import GRPO


def run_grpo(plan: RunPlan) -> dict:
    def reward_functions(device, tokenizer, template):
        return list(plan.reward_functions)  # imported once, by tunelab/preflight.py

    return workflow.run_stage(plan.config, GRPO, reward_functions)
