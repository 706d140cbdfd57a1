"""GRPO: train/recipe.py's RLRecipe workflow with reward functions as the scorer and rl/grpo.py as the step."""

from __future__ import annotations

from tunelab.train.recipe import RLRecipe


class GRPORecipe(RLRecipe):
    stage = "grpo"

    def algorithm(self):
        # lazy: rl/grpo imports peft (7.8 s); `tunelab data` imports this module
        from tunelab.train.rl.grpo import GRPO

        return GRPO

    def scorer(self, device):
        return list(self.plan.reward_functions)  # imported once, by tunelab/preflight.py
