"""GRPO: train/recipe.py's RLRecipe workflow with reward functions as the scorer and rl/grpo.py as the step; with
the option tools, the rollouts and the held-out greedy answers call them (rl/tool_rollout.py)."""

from __future__ import annotations

import functools
import logging

from tunelab.infer.generate import exact_match, stop_token_ids
from tunelab.train.recipe import RLRecipe

logger = logging.getLogger(__name__)


class GRPORecipe(RLRecipe):
    stage = "grpo"

    def algorithm(self):
        # lazy: rl/grpo imports peft (7.8 s); `tunelab data` imports this module
        from tunelab.train.rl.grpo import GRPO

        return functools.partial(GRPO, tool_use=self.tool_use) if self.plan.tools else GRPO

    def scorer(self, device):
        return list(self.plan.reward_functions)  # imported once, by tunelab/preflight.py

    def tool_schemas(self) -> list[dict]:
        if self.plan.tools:
            self.tool_use  # noqa: B018  (made now: a template that cannot render tool turns fails before any weights)
        return [tool.schema for tool in self.plan.tools]

    @functools.cached_property
    def tool_use(self):
        """The template, syntax and runner of the run's tools (option tools), made once."""
        # lazy: the rollout imports rl/grpo's training stack (peft, 7.8 s), as above
        from tunelab.train.rl.tool_rollout import ToolUse

        ft = self.config.finetuning
        return ToolUse.build(self.template, self.tokenizer, self.plan.tools, ft.max_tool_turns,
                             self.config.data.template_kwargs)

    def held_out_scores(self, model, rows, when: str, vision=None) -> dict[str, float]:
        """With tools, the held-out greedy answers may call them too (as the rollouts do): exact match and the reward
        functions' scores of the final answers, and the tool calls per answer."""
        if not self.plan.tools:
            return super().held_out_scores(model, rows, when, vision)
        config = self.config
        predictions, calls = self.tool_use.held_out_answers(
            model, self.tokenizer, rows, stop_token_ids(self.tokenizer, self.template),
            config.generation.max_new_tokens, config.training.per_device_eval_batch_size * 4,
        )
        logger.info("greedy answers to %d held-out rows %s training: %.2f tool calls per answer", len(predictions),
                    when, calls)
        return {f"exact_match_{when}": exact_match(predictions), f"tool_calls_per_answer_{when}": calls,
                **self.score_answers(predictions, when)}
