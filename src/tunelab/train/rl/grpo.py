"""GRPO (Group Relative Policy Optimization, DeepSeekMath): rollouts scored by reward functions,
advantages relative to the other completions of the same prompt, no value model.

Per batch of B prompts:
  1. sample G = num_generations completions of each prompt (B·G rows, group by group);
  2. reward each: the weighted sum of the reward functions (rewards.py);
  3. advantage of each completion: (reward - group mean) / (group std + 1e-4), one per completion,
     shared by all its tokens (scale_rewards: the batch's std, or none); advantage_estimator picks another
     estimator by verl's names: rloo (leave-one-out baseline), reinforce_plus_plus (per token, whitened over
     the batch), reinforce_plus_plus_baseline (the same after the group mean) (losses.estimate_advantages);
  4. loss: per token -min(ratio·A, clip(ratio, 1 - ε, 1 + ε_high)·A) + kl_coef·k3(policy ‖ reference),
     reduced as loss_type says (grpo, dapo, dr_grpo, bnpo: losses.grpo_loss); the ratio per token or,
     with importance_sampling_level sequence (GSPO), per completion.

With num_iterations = 1 the old policy is the current one (ratio 1, its gradient the plain policy
gradient); with more, the rollout's log-probs are kept and each further step is clipped against them.

A group whose G rewards are all equal has advantage 0 and teaches nothing. The share of such groups is
logged (`zero_spread_groups`); when every group of every batch has zero spread for
ZERO_SPREAD_WARN_AFTER rounds in a row, the run warns once with the likely cause and the fixes.
dynamic_sampling (DAPO) takes such groups out of the batch, counted as `dropped_groups`.

With tools (a ToolUse), step 1 is a tool-using rollout (tool_rollout.py): the completions call tools and read their
results before their final answer; only the policy's own tokens are in the loss mask, and the log gains tools/...

Step 2 runs in the background: start_rollout generates a batch on the calling thread and hands its scoring to one
scoring thread, so the loop can generate the round's next batch while the reward functions (code_tests' sandboxed
runs among them) score this one; finish_rollout computes the old and reference log-probs (with dynamic_sampling
after the scores, which drop rows), waits for the scores and records the statistics, on the calling thread: all
that touches the model stays there. So scoring overlaps the round's later generations and the batch's own log-prob
forwards (a round of one batch too). It cannot change results:
- the completions are sampled in the same order from the same RNG (scoring draws no random numbers);
- the log-probs are of the same weights (no optimizer step is taken within a round);
- the one scoring thread calls the reward functions batch by batch in generation order, and reads what they counted
  (pop_stats) right after the batch it belongs to;
- a reward function's exception reaches the loop unchanged when its batch is finished.
Reward functions therefore run off the main thread: one that installs a signal handler (a signal.alarm timeout)
cannot, and ends the run with one line naming it (rewards.RewardFunction); code_tests' limits are those of its own
child processes.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tunelab.config.args import FinetuningArguments, GenerationArguments
from tunelab.train.rl import merged_sampling
from tunelab.train.rl.losses import estimate_advantages, grpo_loss, high_entropy_mask, zero_spread_groups
from tunelab.train.rl.rewards import RewardFunction, reward_run_stats, score_completions
from tunelab.train.rl.rollout import (
    Rollout, completion_log_probs, generate_rollout, reference_log_probs, select_rows,
)
from tunelab.train.rl.tool_rollout import ToolUse, tool_rollout

logger = logging.getLogger(__name__)

ZERO_SPREAD_WARN_AFTER = 3  # rounds in a row in which no group had any reward spread


@dataclass
class GRPOBatch:
    rollout: Rollout
    advantages: torch.Tensor  # B·G, one per completion; B·G × C per token (the reinforce_plus_plus estimators)
    loss_mask: torch.Tensor  # B·G × C: the completion mask, less truncated completions (mask_truncated_completions)
    # and, with dynamic_sampling, empty when every group of the batch had zero spread
    all_zero_spread: bool  # every group's rewards are equal: this batch teaches nothing
    old_log_probs: torch.Tensor | None  # B·G × C; None: the current policy is the old one (num_iterations 1)
    ref_log_probs: torch.Tensor | None  # B·G × C; None when kl_coef is 0


@dataclass
class StartedRollout:
    """A generated batch whose rewards the scoring thread is computing."""
    rollout: Rollout
    tool_stats: dict[str, float]
    scores: Future  # of score_in_background's (totals, per function, run stats)
    prompts: list[str]  # one per row (B·G)
    messages: list[list[dict]] | None  # with tools: each row's turns after the prompt


def score_in_background(rewards: list[RewardFunction], *batch) -> tuple[list[float], dict, dict[str, float]]:
    """On the scoring thread: score_completions of one batch and what the functions counted while scoring it."""
    totals, per_function = score_completions(rewards, *batch)
    return totals, per_function, reward_run_stats(rewards)


class GRPO:
    def __init__(self, loop, reference, tokenizer, stop_ids: list[int], rewards: list[RewardFunction],
                 finetuning: FinetuningArguments, generation: GenerationArguments, tool_use: ToolUse | None = None):
        ft, gen = finetuning, generation
        self.tool_use = tool_use
        self.loop, self.reference, self.tokenizer, self.stop_ids, self.rewards = loop, reference, tokenizer, stop_ids, rewards
        self.group_size, self.kl_coef, self.epsilon = ft.num_generations, ft.kl_coef, ft.epsilon
        self.num_iterations = ft.num_iterations
        self.temperature, self.max_new_tokens = gen.temperature, gen.max_new_tokens
        self.loss_type, self.scale_rewards, self.epsilon_high = ft.loss_type, ft.scale_rewards, ft.epsilon_high
        self.advantage_estimator = ft.advantage_estimator
        self.importance_sampling_level, self.mask_truncated = ft.importance_sampling_level, ft.mask_truncated_completions
        self.dynamic_sampling, self.top_entropy_quantile = ft.dynamic_sampling, ft.top_entropy_quantile
        self.dapo_tokens: float | None = None  # set per round by begin_round (loss_type dapo)
        self.zero_spread_rounds, self.warned_zero_spread = 0, False
        self.merge_for_sampling = merged_sampling.sampling_plan(self.policy, loop.accelerator, finetuning)
        # One thread: batches are scored one at a time in the order they were generated (see the module docstring).
        self.scoring = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-scoring")

    @property
    def policy(self):
        """The model without its DDP wrapper: generation and disabling the adapter act on it."""
        return self.loop.accelerator.unwrap_model(self.loop.model)

    @torch.no_grad()
    def start_rollout(self, rows: list[dict]) -> StartedRollout:
        """Generate the batch's completions (step 1) and start scoring them on the scoring thread (step 2)."""
        group = [row for row in rows for _ in range(self.group_size)]
        messages, tool_stats = None, {}
        with merged_sampling.sampling_weights(self.policy, self.merge_for_sampling):
            if self.tool_use is None:
                rollout = generate_rollout(
                    self.policy, self.tokenizer, [row["prompt_ids"] for row in rows], self.stop_ids,
                    self.max_new_tokens, self.temperature, self.tokenizer.pad_token_id, group_size=self.group_size,
                )
            else:
                used = tool_rollout(
                    self.policy, self.tokenizer, self.tool_use, rows, self.stop_ids, self.max_new_tokens,
                    self.temperature, self.tokenizer.pad_token_id, self.group_size,
                )
                rollout, messages, tool_stats = used.rollout, used.completion_messages, used.stats
        prompts = [row["prompt"] for row in group]
        scores = self.scoring.submit(
            score_in_background, self.rewards, prompts, rollout.completions,
            [row["reference"] for row in group], rollout.finished, messages,
        )
        return StartedRollout(rollout, tool_stats, scores, prompts, messages)

    @torch.no_grad()
    def finish_rollout(self, started: StartedRollout) -> GRPOBatch:
        """Old and reference log-probs, the batch's scores, advantages (steps 3 and 4's inputs)."""
        rollout, tool_stats = started.rollout, started.tool_stats
        # The log-probs need no reward (but for dynamic sampling, which drops rows first): the forwards run while
        # the scoring thread works on this batch.
        log_probs = None if self.dynamic_sampling else self._old_and_reference_log_probs(rollout)
        totals, per_function, run_stats = started.scores.result()  # a raised error ends the run: the loop closes
        device = rollout.input_ids.device
        rewards = torch.tensor(totals, dtype=torch.float32, device=device)
        zero_spread = zero_spread_groups(rewards, self.group_size)
        self.loop.record({
            "reward": rewards.mean(),
            "reward_std": rewards.view(-1, self.group_size).std(dim=1).mean(),
            "zero_spread_groups": zero_spread.float().mean(),
            **{f"reward/{name}": sum(scores) / len(scores) for name, scores in per_function.items()},
            **run_stats,
            "completion_length": rollout.completion_mask.sum(dim=1).mean(),
            "completion_finished": sum(rollout.finished) / len(rollout.finished),
            **tool_stats,
        })
        self.loop.record_samples(samples(started, totals, per_function))
        all_zero_spread = bool(zero_spread.all())
        if self.dynamic_sampling:
            # DAPO's dynamic sampling: groups with equal rewards leave the batch (they would only dilute it).
            # With none left the batch stays, its loss mask empty: a zero gradient that DDP still synchronises.
            self.loop.record({"dropped_groups": zero_spread.sum()})
            if not all_zero_spread:
                keep = (~zero_spread).repeat_interleave(self.group_size)
                rollout, rewards = select_rows(rollout, keep), rewards[keep]
            log_probs = self._old_and_reference_log_probs(rollout)
        old, ref = log_probs
        loss_mask = rollout.completion_mask
        if self.mask_truncated:
            loss_mask = loss_mask * torch.tensor(rollout.finished, dtype=loss_mask.dtype, device=device)[:, None]
        if self.dynamic_sampling and all_zero_spread:
            loss_mask = torch.zeros_like(loss_mask)
        advantages = estimate_advantages(self.advantage_estimator, rewards, self.group_size, loss_mask,
                                         self.scale_rewards)
        return GRPOBatch(rollout, advantages, loss_mask, all_zero_spread, old, ref)

    def _old_and_reference_log_probs(self, rollout: Rollout) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        old = completion_log_probs(self.loop.model, rollout, self.temperature)[0] if self.num_iterations > 1 else None
        ref = None
        if self.kl_coef:
            with self.loop.accelerator.autocast():  # the same precision as the policy's forward
                ref = reference_log_probs(self.policy, self.reference, rollout, self.temperature)
        return old, ref

    def close(self) -> None:
        """The scoring thread exits: a pending batch (the run failed) is dropped, since no step will use it."""
        self.scoring.shutdown(wait=False, cancel_futures=True)

    def begin_round(self, batches: list[GRPOBatch]) -> None:
        """Before the optimizer steps on one round of rollouts: count the round's completion tokens (dapo's
        normaliser) and watch for rounds that cannot teach anything."""
        accelerator = self.loop.accelerator
        if self.loss_type == "dapo":
            tokens = torch.stack([batch.loss_mask.sum() for batch in batches]).sum()
            if accelerator.num_processes > 1:
                tokens = accelerator.reduce(tokens, reduction="sum")
            # The loop divides each batch's loss by the batches per step and DDP averages over processes:
            # dividing each batch's token sum by tokens / (batches · processes) makes the step's gradient that
            # of sum(L) / tokens over every token of the step, on every process.
            self.dapo_tokens = float(tokens) / (len(batches) * accelerator.num_processes)
        self.zero_spread_rounds = self.zero_spread_rounds + 1 if all(b.all_zero_spread for b in batches) else 0
        if self.zero_spread_rounds >= ZERO_SPREAD_WARN_AFTER and not self.warned_zero_spread:
            self.warned_zero_spread = True
            if accelerator.is_main_process:
                logger.warning(zero_spread_warning(self.zero_spread_rounds, self.group_size))

    def loss(self, batch: GRPOBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        select = self.top_entropy_quantile < 1.0
        log_probs, entropy = completion_log_probs(self.loop.model, batch.rollout, self.temperature, output_entropy=select)
        old = batch.old_log_probs if batch.old_log_probs is not None else log_probs.detach()
        entropy_mask = high_entropy_mask(entropy, batch.loss_mask, self.top_entropy_quantile) if select else None
        return grpo_loss(
            log_probs, old, batch.ref_log_probs, batch.advantages, batch.loss_mask, self.epsilon, self.kl_coef,
            loss_type=self.loss_type, epsilon_high=self.epsilon_high,
            importance_sampling_level=self.importance_sampling_level, max_completion_length=self.max_new_tokens,
            dapo_tokens=self.dapo_tokens, entropy_mask=entropy_mask,
        )


def samples(started: StartedRollout, totals: list[float], per_function: dict[str, list[float]]) -> list[dict]:
    """One record per rollout for completions.jsonl: what was asked, answered and scored."""
    rollout = started.rollout
    records = []
    for i, (prompt, completion) in enumerate(zip(started.prompts, rollout.completions, strict=True)):
        record = {"group": i // rollout.group_size, "prompt": prompt, "completion": completion,
                  "finished": rollout.finished[i], "reward": totals[i],
                  **{f"reward/{name}": scores[i] for name, scores in per_function.items()}}
        if started.messages is not None:
            record["messages"] = started.messages[i]
        records.append(record)
    return records


def zero_spread_warning(rounds: int, group_size: int) -> str:
    return (
        f"grpo cannot learn: in each of the last {rounds} rounds of rollouts every prompt's {group_size} "
        "completions got the same reward, so every advantage is 0 and nothing but the KL term moves the model. "
        "Likely cause: the reward never fires for this model (exact_match on answers that are never exactly "
        "right). Fixes: a reward with partial credit (item_match, or your own), a format reward beside it "
        "(reward_funcs: exact_match,format), stage sft on the task first, or a larger group (num_generations, "
        f"now {group_size}). zero_spread_groups in trainer_log.jsonl is the share of such groups."
    )
