"""GRPO (Group Relative Policy Optimization, DeepSeekMath): rollouts scored by reward functions,
advantages relative to the other completions of the same prompt, no value model.

Per batch of B prompts:
  1. sample G = num_generations completions of each prompt (B·G rows, group by group);
  2. reward each: the weighted sum of the reward functions (rewards.py);
  3. advantage of each completion: (reward - group mean) / (group std + 1e-4), one per completion,
     shared by all its tokens;
  4. loss: per token -min(ratio·A, clip(ratio, 1±ε)·A) + kl_coef·k3(policy ‖ reference),
     averaged over each completion's tokens, then over completions (losses.grpo_loss).

With num_iterations = 1 the old policy is the current one (ratio 1, its gradient the plain policy
gradient); with more, the rollout's log-probs are kept and each further step is clipped against them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tunelab.train.rl.losses import grpo_loss, group_advantages
from tunelab.train.rl.rewards import RewardFunction, score_completions
from tunelab.train.rl.rollout import Rollout, completion_log_probs, generate_rollout, reference_log_probs


@dataclass
class GRPOBatch:
    rollout: Rollout
    advantages: torch.Tensor  # B·G, one per completion
    old_log_probs: torch.Tensor | None  # B·G × C; None: the current policy is the old one (num_iterations 1)
    ref_log_probs: torch.Tensor | None  # B·G × C; None when kl_coef is 0


class GRPO:
    def __init__(self, loop, reference, tokenizer, stop_ids: list[int], rewards: list[RewardFunction], config):
        ft, gen = config.finetuning, config.generation
        self.loop, self.reference, self.tokenizer, self.stop_ids, self.rewards = loop, reference, tokenizer, stop_ids, rewards
        self.group_size, self.kl_coef, self.epsilon = ft.num_generations, ft.kl_coef, ft.epsilon
        self.num_iterations = ft.num_iterations
        self.temperature, self.max_new_tokens = gen.temperature, gen.max_new_tokens

    @property
    def policy(self):
        """The model without its DDP wrapper: generation and disabling the adapter act on it."""
        return self.loop.accelerator.unwrap_model(self.loop.model)

    @torch.no_grad()
    def rollout(self, rows: list[dict]) -> GRPOBatch:
        group = [row for row in rows for _ in range(self.group_size)]
        rollout = generate_rollout(
            self.policy, self.tokenizer, [row["prompt_ids"] for row in group], self.stop_ids,
            self.max_new_tokens, self.temperature, self.tokenizer.pad_token_id,
        )
        totals, per_function = score_completions(
            self.rewards, [row["prompt"] for row in group], rollout.completions,
            [row["reference"] for row in group], rollout.finished,
        )
        device = rollout.input_ids.device
        rewards = torch.tensor(totals, dtype=torch.float32, device=device)
        old = completion_log_probs(self.loop.model, rollout, self.temperature)[0] if self.num_iterations > 1 else None
        ref = None
        if self.kl_coef:
            with self.loop.accelerator.autocast():  # the same precision as the policy's forward
                ref = reference_log_probs(self.policy, self.reference, rollout, self.temperature)
        self.loop.record({
            "reward": rewards.mean(),
            "reward_std": rewards.view(-1, self.group_size).std(dim=1).mean(),
            **{f"reward/{name}": sum(scores) / len(scores) for name, scores in per_function.items()},
            "completion_length": rollout.completion_mask.sum(dim=1).mean(),
            "completion_finished": sum(rollout.finished) / len(rollout.finished),
        })
        return GRPOBatch(rollout, group_advantages(rewards, self.group_size), old, ref)

    def loss(self, batch: GRPOBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        log_probs, _ = completion_log_probs(self.loop.model, batch.rollout, self.temperature)
        old = batch.old_log_probs if batch.old_log_probs is not None else log_probs.detach()
        return grpo_loss(
            log_probs, old, batch.ref_log_probs, batch.advantages, batch.rollout.completion_mask,
            self.epsilon, self.kl_coef,
        )
