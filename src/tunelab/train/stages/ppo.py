"""PPO: the shared generating-stage workflow (rl/workflow.py) with stage rm's model as the scorer,
a value head on the policy, and rl/ppo.py as the step; the value head is saved beside the model
(value_head.safetensors)."""

from __future__ import annotations

from pathlib import Path

from tunelab.train.stages.grpo import GenerationRecipe


class PPORecipe(GenerationRecipe):
    stage = "ppo"

    def run(self) -> dict:
        # The training stack is imported when training: `tunelab data` reads the recipe without it (start-up time).
        from tunelab.model.reward import load_reward_model  # noqa: PLC0415
        from tunelab.train.rl import workflow  # noqa: PLC0415
        from tunelab.train.rl.ppo import PPO, VALUE_HEAD_FILE, PolicyWithValueHead, RewardModelScorer  # noqa: PLC0415

        config = self.config

        def reward_model(device, tokenizer, template):
            reward_model = load_reward_model(
                config.finetuning.reward_model, device=device, allow_pickle_weights=config.model.allow_pickle_weights
            )
            return RewardModelScorer(reward_model, tokenizer, template, config.data.template_kwargs)

        def save_value_head(loop) -> None:
            if loop.accelerator.is_main_process:
                path = Path(config.training.output_dir) / VALUE_HEAD_FILE
                loop.accelerator.unwrap_model(loop.model).save_value_head(path)

        return workflow.run_stage(config, PPO, reward_model, policy=PolicyWithValueHead, after_save=save_value_head)

