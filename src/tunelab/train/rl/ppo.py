"""PPO with a reward model (the RLHF recipe of InstructGPT): policy + value head, rollouts scored by
the reward model of stage rm, a per-token KL penalty to the reference, GAE, clipped losses.

The value head is a linear layer on the policy's last hidden state — a shared backbone: one
forward gives both the log-probs and the values, and the value loss (× ppo_vf_coef) trains the
backbone's trainable parameters too. The head starts at zero (values 0) and is saved beside the
model as value_head.safetensors.

Per batch of B prompts (one completion each):
  1. sample a completion; reward model score = its score of the full render (prompt + answer);
  2. per-token rewards: r_t = -kl_coef · (log π(c_t) - log π_ref(c_t)), plus the score on the last token;
  3. GAE over the tokens (γ = ppo_gamma, λ = ppo_lam) with the rollout's values → advantages
     (whitened over the batch) and returns;
  4. loss: clipped policy loss (1 ± ε) + ppo_vf_coef · clipped value loss (old value ± ε), token means.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from safetensors.torch import save_file
from torch import nn

from tunelab.data.encode import parse_tools
from tunelab.model.reward import sequence_rewards
from tunelab.model.text_config import text_config
from tunelab.config.args import FinetuningArguments, GenerationArguments
from tunelab.train.rl import merged_sampling
from tunelab.train.rl.losses import clipped_policy_loss, clipped_value_loss, gae, masked_mean, masked_whiten
from tunelab.train.rl.rollout import Rollout, completion_log_probs, generate_rollout, reference_log_probs

VALUE_HEAD_FILE = "value_head.safetensors"


class PolicyWithValueHead(nn.Module):
    """The policy and its value head as one trainable module (one DDP wrapper, one optimizer)."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy
        config = text_config(policy.config)
        self.value_head = nn.Linear(config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, rollout: Rollout, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, values), each N × C: the value at the position that predicts completion token t
        is the value of the state before t."""
        log_probs, hidden = completion_log_probs(self.policy, rollout, temperature, output_hidden=True)
        values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)
        return log_probs, values

    def save_value_head(self, path) -> None:
        save_file({k: v.detach().cpu().contiguous() for k, v in self.value_head.state_dict().items()}, str(path))


@dataclass
class PPOBatch:
    rollout: Rollout
    old_log_probs: torch.Tensor  # N × C
    old_values: torch.Tensor  # N × C
    advantages: torch.Tensor  # N × C, whitened
    returns: torch.Tensor  # N × C


def token_rewards(
    scores: torch.Tensor, log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """N × C rewards: -kl_coef · (log π - log π_ref) on every completion token, the sequence score added
    on its last one."""
    rewards = -kl_coef * (log_probs - ref_log_probs) * mask
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)
    rewards[torch.arange(len(scores)), last] += scores
    return rewards


class RewardModelScorer:
    """Scores (prompt, answer) pairs with a stage-rm reward model: the full template render, right-padded,
    read at the last non-pad token (model/reward.py)."""

    def __init__(self, reward_model: nn.Module, tokenizer, template, template_vars: dict | None = None):
        self.model, self.tokenizer, self.template = reward_model, tokenizer, template
        self.template_vars = template_vars or {}

    @torch.no_grad()
    def __call__(self, rows: list[dict], completions: list[str]) -> torch.Tensor:
        tok = self.tokenizer
        texts = [
            self.template.render(
                [*json.loads(row["messages"]), {"role": "assistant", "content": completion}],
                parse_tools(row["tools"] or None), bos_token=tok.bos_token or "", eos_token=tok.eos_token or "",
                **self.template_vars,
            )
            for row, completion in zip(rows, completions)
        ]
        ids = [tok(text, add_special_tokens=False)["input_ids"] for text in texts]
        width = max(len(i) for i in ids)
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i in ids], device=device)
        attention_mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids], device=device)
        return sequence_rewards(self.model, input_ids, attention_mask)


class PPO:
    def __init__(self, loop, reference, tokenizer, stop_ids: list[int], scorer: RewardModelScorer,
                 finetuning: FinetuningArguments, generation: GenerationArguments):
        ft, gen = finetuning, generation
        self.loop, self.reference, self.tokenizer, self.stop_ids, self.scorer = loop, reference, tokenizer, stop_ids, scorer
        self.kl_coef, self.epsilon, self.vf_coef = ft.kl_coef, ft.epsilon, ft.ppo_vf_coef
        self.gamma, self.lam = ft.ppo_gamma, ft.ppo_lam
        self.temperature, self.max_new_tokens = gen.temperature, gen.max_new_tokens
        self.merge_for_sampling = merged_sampling.sampling_plan(self.unwrapped.policy, loop.accelerator, finetuning)

    @property
    def unwrapped(self) -> PolicyWithValueHead:
        return self.loop.accelerator.unwrap_model(self.loop.model)

    @torch.no_grad()
    def start_rollout(self, rows: list[dict]) -> tuple[list[dict], Rollout]:
        """Sample the batch's completions (step 1). Nothing runs in the background: the reward model is a model."""
        with merged_sampling.sampling_weights(self.unwrapped.policy, self.merge_for_sampling):
            rollout = generate_rollout(
                self.unwrapped.policy, self.tokenizer, [row["prompt_ids"] for row in rows], self.stop_ids,
                self.max_new_tokens, self.temperature, self.tokenizer.pad_token_id,
            )
        return rows, rollout

    @torch.no_grad()
    def finish_rollout(self, started: tuple[list[dict], Rollout]) -> PPOBatch:
        """Scores, values, reference log-probs and advantages of a sampled batch (steps 1 to 3)."""
        rows, rollout = started
        policy = self.unwrapped.policy
        mask = rollout.completion_mask
        log_probs, values = self.loop.model(rollout, self.temperature)
        if self.kl_coef:
            with self.loop.accelerator.autocast():  # the same precision as the policy's forward
                ref_log_probs = reference_log_probs(policy, self.reference, rollout, self.temperature)
        else:
            ref_log_probs = log_probs
        scores = self.scorer(rows, rollout.completions).to(log_probs.device)
        rewards = token_rewards(scores, log_probs, ref_log_probs, mask, self.kl_coef)
        advantages, returns = gae(rewards, values, mask, self.gamma, self.lam)
        self.loop.record({
            "reward": scores.mean(),
            "kl": ((log_probs - ref_log_probs) * mask).sum(dim=1).mean(),
            "value": masked_mean(values, mask),
            "completion_length": mask.sum(dim=1).mean(),
            "completion_finished": sum(rollout.finished) / len(rollout.finished),
        })
        return PPOBatch(rollout, log_probs, values, masked_whiten(advantages, mask), returns)

    def begin_round(self, batches: list[PPOBatch]) -> None:
        """Nothing in ppo spans a round of rollouts."""

    def close(self) -> None:
        """ppo starts nothing in the background."""

    def loss(self, batch: PPOBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = batch.rollout.completion_mask
        log_probs, values = self.loop.model(batch.rollout, self.temperature)
        per_token, was_clipped = clipped_policy_loss(log_probs, batch.old_log_probs, batch.advantages, self.epsilon)
        policy_loss = masked_mean(per_token, mask)
        value_loss = clipped_value_loss(values, batch.old_values, batch.returns, mask, self.epsilon)
        stats = {
            "policy_loss": policy_loss.detach(), "value_loss": value_loss.detach(),
            "clip_ratio": masked_mean(was_clipped, mask).detach(),
        }
        return policy_loss + self.vf_coef * value_loss, stats
