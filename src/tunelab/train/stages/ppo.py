"""PPO: train/recipe.py's RLRecipe workflow with stage rm's model as the scorer, a value head on the
policy, and rl/ppo.py as the step; the value head is saved beside the model (value_head.safetensors)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from tunelab.model.reward import load_reward_model
from tunelab.train.recipe import RLRecipe


class PPORecipe(RLRecipe):
    stage = "ppo"

    def algorithm(self):
        from tunelab.train.rl.ppo import PPO  # lazy: rl/ppo imports peft (7.8 s); `tunelab data` imports this module

        return PPO

    def scorer(self, device):
        from tunelab.train.rl.ppo import RewardModelScorer  # lazy: as in algorithm()

        config = self.config
        reward_model = load_reward_model(
            config.finetuning.reward_model, device=device, allow_pickle_weights=config.model.allow_pickle_weights
        )
        return RewardModelScorer(reward_model, self.tokenizer, self.template, config.data.template_kwargs)

    def policy(self, model: nn.Module) -> nn.Module:
        from tunelab.train.rl.ppo import PolicyWithValueHead  # lazy: as in algorithm()

        return PolicyWithValueHead(model)

    def after_save(self, loop) -> None:
        from tunelab.train.rl.ppo import VALUE_HEAD_FILE  # lazy: as in algorithm()

        if loop.accelerator.is_main_process:
            path = Path(self.config.training.output_dir) / VALUE_HEAD_FILE
            loop.accelerator.unwrap_model(loop.model).save_value_head(path)
