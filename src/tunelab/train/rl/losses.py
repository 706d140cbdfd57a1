"""The arithmetic of grpo and ppo, as pure functions on tensors (each tested against a hand computation).

Shapes: N sequences × C completion tokens; `mask` is 1.0 on completion tokens (through the
end-of-turn token) and 0.0 on padding. Nothing here knows about models or data.
"""

from __future__ import annotations

import torch

from tunelab.config.args import ADVANTAGE_ESTIMATORS, GRPO_LOSS_TYPES

# The option values by what they do (their names are TRL's and verl's, declared with the options).
PER_COMPLETION, STEP_TOKENS, DR_GRPO, BATCH_TOKENS = GRPO_LOSS_TYPES  # grpo, dapo, dr_grpo, bnpo
GROUP_MEAN, RLOO, REINFORCE_PP, REINFORCE_PP_BASELINE = ADVANTAGE_ESTIMATORS


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / std over the masked entries (population variance)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    return (values - mean) * torch.rsqrt(var + eps)


def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy ‖ reference), Schulman's k3 estimator: exp(r) - r - 1 with r = ref - policy.
    Unbiased for tokens sampled from the policy, and never negative."""
    ratio = ref_log_probs - log_probs
    return torch.exp(ratio) - ratio - 1


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by a spread (+ eps) that `scale` picks
    (TRL's `scale_rewards`): "group" the group's standard deviation, "batch" the standard deviation of all
    the rewards given (one rollout batch), "none" nothing (Dr. GRPO). Standard deviations are unbiased, as
    torch.std. Rewards are laid out group by group: [p0 g0, p0 g1, ..., p1 g0, ...]. A group whose rewards
    are all equal gets advantage 0: it says nothing about which answer is better."""
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (rewards.std() + eps)
    elif scale != "none":
        raise ValueError(f"group_advantages: unknown scale {scale!r} (group, batch, none)")
    return centred.reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): each reward minus the mean of the other G - 1 rewards of its group,
    which is G / (G - 1) · (reward - group mean). Not divided by any spread. One per completion."""
    grouped = rewards.view(-1, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).reshape(-1)


def reinforce_plus_plus_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, group_size: int | None = None, eps: float = 1e-4
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, as verl computes it with gamma 1): every token of a completion gets its reward as
    its return, and the returns are whitened over all masked tokens of the batch: (return - mean) / (std + eps),
    population std, so a long completion weighs in the statistics by its tokens. With group_size
    (verl's reinforce_plus_plus_baseline) each reward first loses its group's mean. Per token: N × C, 0 off
    the mask."""
    if group_size is not None:
        grouped = rewards.view(-1, group_size)
        rewards = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    # Statistics in float64: equal rewards must give 0, not float32's rounding of their mean divided by eps.
    returns, weights = rewards[:, None].double().expand_as(mask), mask.double()
    mean = masked_mean(returns, weights)
    std = masked_mean((returns - mean) ** 2, weights).sqrt()
    return ((returns - mean) / (std + eps) * weights).to(mask.dtype)


def estimate_advantages(
    estimator: str, rewards: torch.Tensor, group_size: int, mask: torch.Tensor, scale: str = "group"
) -> torch.Tensor:
    """The advantages `estimator` (option advantage_estimator) gives: one per completion (grpo, rloo) or one
    per token (the reinforce_plus_plus pair). `scale` (scale_rewards) acts on grpo only."""
    if estimator == GROUP_MEAN:
        return group_advantages(rewards, group_size, scale)
    if estimator == RLOO:
        return rloo_advantages(rewards, group_size)
    if estimator == REINFORCE_PP:
        return reinforce_plus_plus_advantages(rewards, mask)
    if estimator == REINFORCE_PP_BASELINE:
        return reinforce_plus_plus_advantages(rewards, mask, group_size)
    raise ValueError(f"unknown advantage_estimator {estimator!r} ({', '.join(ADVANTAGE_ESTIMATORS)})")


def zero_spread_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per group, whether all its rewards are equal (bool, one per group): such a group has advantage 0
    whatever the scaling, so it adds nothing to the policy gradient."""
    grouped = rewards.view(-1, group_size)
    return grouped.max(dim=1).values == grouped.min(dim=1).values


def clipped_surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, epsilon: float, epsilon_high: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(ratio·A, clip(ratio, 1 - ε, 1 + ε_high)·A) with ratio = exp(log_ratio), and whether the clip
    was the one taken. ε_high (DAPO's clip-higher) defaults to ε. Shapes broadcast: log_ratio N × C (per
    token) or N × 1 (per sequence), advantages N (one per sequence) or N × C."""
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    high = epsilon if epsilon_high is None else epsilon_high
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high) * advantages
    return -torch.min(unclipped, clipped), (clipped < unclipped).float()


def clipped_policy_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token -min(ratio·A, clip(ratio, 1-ε, 1+ε)·A) and whether the clip was the one taken.
    advantages: per token (N × C) or per sequence (N, broadcast over its tokens)."""
    return clipped_surrogate(log_probs - old_log_probs, advantages, epsilon)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """1.0 on the masked tokens whose entropy is in the top `quantile` of this batch's masked tokens (the
    "80/20" forking tokens), else 0.0: the tokens at or above the (1 - quantile) quantile. quantile 1 keeps
    every token, 0 only the highest-entropy one(s)."""
    real = mask.bool()
    if not real.any():
        return mask
    threshold = torch.quantile(entropy[real].float(), 1 - quantile)
    return ((entropy >= threshold) & real).to(mask.dtype)



def grpo_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, ref_log_probs: torch.Tensor | None,
    advantages: torch.Tensor, mask: torch.Tensor, epsilon: float, kl_coef: float, *,
    loss_type: str = PER_COMPLETION, epsilon_high: float | None = None, importance_sampling_level: str = "token",
    max_completion_length: int | None = None, dapo_tokens: float | None = None,
    entropy_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO objective, negated: per token the clipped surrogate plus kl_coef · k3 KL to the reference
    (L_it below), reduced over the N completions × C tokens as `loss_type` says (TRL's names):

        grpo     mean over completions of (sum_t L_it / T_i)       DeepSeekMath eq. 3: each completion weighs
                                                                   the same, so a long one's tokens weigh less
        bnpo     sum_it L_it / sum_i T_i                           token mean over this batch
        dr_grpo  sum_it L_it / (N · max_completion_length)         Dr. GRPO: a constant, no length bias
        dapo     sum_it L_it / dapo_tokens                         DAPO: token mean over the whole optimizer step

    T_i are completion i's tokens (the mask). dapo_tokens defaults to this batch's tokens (then dapo equals
    bnpo); the caller passes the step's token count scaled to what one batch's loss should be divided by
    (grpo.GRPO.loss). importance_sampling_level "sequence" (GSPO) replaces each token's log-ratio by its
    completion's mean log-ratio: one ratio, clipped once, per completion. entropy_mask (N × C, from
    high_entropy_mask) keeps the policy term on those tokens only; the KL term stays on every token.

    Returns the loss and detached statistics (kl, clip_ratio)."""
    log_ratio = log_probs - old_log_probs
    if importance_sampling_level == "sequence":
        log_ratio = masked_mean(log_ratio, mask, dim=1)[:, None]
    elif importance_sampling_level != "token":
        raise ValueError(f"grpo_loss: unknown importance_sampling_level {importance_sampling_level!r} (token, sequence)")
    per_token, was_clipped = clipped_surrogate(log_ratio, advantages, epsilon, epsilon_high)
    stats = {"clip_ratio": masked_mean(was_clipped.expand_as(mask), mask).detach()}
    if entropy_mask is not None:
        per_token = per_token * entropy_mask
    if ref_log_probs is not None:
        kl = kl_k3(log_probs, ref_log_probs)
        if kl_coef:
            per_token = per_token + kl_coef * kl
        stats["kl"] = masked_mean(kl, mask).detach()
    per_token = per_token.expand_as(mask)
    if loss_type == PER_COMPLETION:
        loss = masked_mean(per_token, mask, dim=1).mean()
    elif loss_type == BATCH_TOKENS:
        loss = masked_mean(per_token, mask)
    elif loss_type == DR_GRPO:
        if max_completion_length is None:
            raise ValueError("grpo_loss: loss_type dr_grpo needs max_completion_length")
        loss = (per_token * mask).sum() / (mask.shape[0] * max_completion_length)
    elif loss_type == STEP_TOKENS:
        tokens = mask.sum() if dapo_tokens is None else torch.as_tensor(dapo_tokens)
        loss = (per_token * mask).sum() / tokens.clamp(min=1)
    else:
        raise ValueError(f"grpo_loss: unknown loss_type {loss_type!r} ({', '.join(GRPO_LOSS_TYPES)})")
    return loss, stats


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each completion's tokens (N × C).

        δ_t = r_t + γ·V_{t+1} - V_t        (V after the last token = 0)
        A_t = δ_t + γ·λ·A_{t+1}
        returns_t = A_t + V_t

    Padding (mask 0) sits after a completion's last token; its values are zeroed so nothing leaks back."""
    values = values * mask
    rewards = rewards * mask
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = next_advantage * mask[:, t]
        next_value, next_advantage = values[:, t], advantages[:, t]
    return advantages, advantages + values


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float
) -> torch.Tensor:
    """0.5 · max((V - R)², (V_clipped - R)²), V_clipped = old V ± clip, averaged over the masked tokens."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    loss = torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * masked_mean(loss, mask)
