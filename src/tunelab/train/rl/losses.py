"""The arithmetic of grpo and ppo, as pure functions on tensors (each tested against a hand computation).

Shapes: N sequences × C completion tokens; `mask` is 1.0 on completion tokens (through the
end-of-turn token) and 0.0 on padding. Nothing here knows about models or data.
"""

from __future__ import annotations

import torch


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


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, over the group's standard deviation
    (unbiased, as torch.std) + eps. Rewards are laid out group by group: [p0 g0, p0 g1, ..., p1 g0, ...].
    A group whose rewards are all equal gets advantage 0: it says nothing about which answer is better."""
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True)
    return ((grouped - mean) / (std + eps)).view(-1)


def clipped_policy_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token -min(ratio·A, clip(ratio, 1-ε, 1+ε)·A) and whether the clip was the one taken.
    advantages: per token (N × C) or per sequence (N, broadcast over its tokens)."""
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * advantages
    return -torch.min(unclipped, clipped), (clipped < unclipped).float()


def grpo_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, ref_log_probs: torch.Tensor | None,
    advantages: torch.Tensor, mask: torch.Tensor, epsilon: float, kl_coef: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO objective (DeepSeekMath eq. 3), negated: per token the clipped surrogate plus
    kl_coef · k3 KL to the reference, averaged over each completion's tokens, then over completions.

    Returns the loss and detached statistics (kl, clip_ratio)."""
    per_token, was_clipped = clipped_policy_loss(log_probs, old_log_probs, advantages, epsilon)
    stats = {"clip_ratio": masked_mean(was_clipped, mask).detach()}
    if ref_log_probs is not None:
        kl = kl_k3(log_probs, ref_log_probs)
        if kl_coef:
            per_token = per_token + kl_coef * kl
        stats["kl"] = masked_mean(kl, mask).detach()
    loss = masked_mean(per_token, mask, dim=1).mean()
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
