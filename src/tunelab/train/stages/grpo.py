"""GRPO: the shared generating-stage workflow (rl/workflow.py) with reward functions as the scorer
and rl/grpo.py as the step."""

from __future__ import annotations

from tunelab.train.stages.sft import SFTRecipe


class GenerationRecipe(SFTRecipe):
    """What the generating stages (grpo, ppo) share. `tunelab data` reads their rows as sft does (each prompt with
    its reference answer, which held-out exact match compares with); training reads the prompts and samples the
    answers (rl/workflow.py)."""

    inspection_packs = False


class GRPORecipe(GenerationRecipe):
    stage = "grpo"

    def run(self) -> dict:
        # The training stack is imported when training: `tunelab data` reads the recipe without it (start-up time).
        from tunelab.train.rl import workflow  # noqa: PLC0415
        from tunelab.train.rl.grpo import GRPO  # noqa: PLC0415

        reward_functions = self.plan.reward_functions  # imported once, by tunelab/preflight.py
        return workflow.run_stage(self.config, GRPO, lambda device, tokenizer, template: list(reward_functions))

