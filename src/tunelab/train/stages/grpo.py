"""GRPO: train/recipe.py's RLRecipe workflow with reward functions as the scorer and rl/grpo.py as the step."""

from __future__ import annotations

from tunelab.train.recipe import RLRecipe


class GRPORecipe(RLRecipe):
    stage = "grpo"

    def algorithm(self):
        from tunelab.train.rl.grpo import GRPO  # noqa: PLC0415  (the training stack: imported when training)

        return GRPO

    def scorer(self, device):
        return list(self.plan.reward_functions)  # imported once, by tunelab/preflight.py
