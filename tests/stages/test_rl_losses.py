"""The arithmetic of grpo and ppo (train/rl/losses.py, ppo.token_rewards) against hand computations."""

from __future__ import annotations

import math

import torch

from tunelab.train.rl.losses import clipped_value_loss, gae, grpo_loss, group_advantages, kl_k3, masked_whiten
from tunelab.train.rl.ppo import token_rewards

LN = math.log


def test_group_advantages_normalise_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    # group 1: mean 0.5, unbiased std sqrt((4 · 0.25) / 3); group 2: all equal → no signal.
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    expected = torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(rewards, 4), expected, rtol=0, atol=1e-7)


def test_k3_kl_by_hand():
    # r = ref - policy; k3 = e^r - r - 1
    log_probs = torch.tensor([LN(0.5), LN(0.25), LN(0.3)])
    ref = torch.tensor([LN(0.25), LN(0.5), LN(0.3)])
    expected = torch.tensor([0.5 + LN(2) - 1, 2 - LN(2) - 1, 0.0])
    torch.testing.assert_close(kl_k3(log_probs, ref), expected, rtol=0, atol=1e-7)


def test_grpo_loss_by_hand():
    log_probs = torch.tensor([[LN(0.5), LN(0.5)], [LN(0.5), 5.0]])
    old = torch.tensor([[LN(0.5), LN(0.25)], [0.0, -3.0]])
    ref = torch.tensor([[LN(0.5), LN(0.5)], [LN(0.25), 9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])  # the second completion has one token, then padding
    advantages = torch.tensor([1.0, -1.0])
    loss, stats = grpo_loss(log_probs, old, ref, advantages, mask, epsilon=0.2, kl_coef=0.1)
    # completion 1: ratios 1 and 2, A = +1 → -min(1, 1) = -1 and -min(2, 1.2) = -1.2; k3 = 0 → mean -1.1
    # completion 2: ratio 0.5, A = -1 → -min(-0.5, -0.8) = 0.8; k3 = ln 2 - 0.5 → 0.8 + 0.1 (ln 2 - 0.5)
    second = 0.8 + 0.1 * (LN(2) - 0.5)
    assert abs(loss.item() - (-1.1 + second) / 2) < 1e-6
    assert abs(stats["clip_ratio"].item() - 2 / 3) < 1e-6
    assert abs(stats["kl"].item() - (LN(2) - 0.5) / 3) < 1e-6


def test_grpo_loss_without_reference_is_the_clipped_surrogate():
    log_probs = torch.tensor([[LN(0.5)]])
    loss, stats = grpo_loss(log_probs, log_probs, None, torch.tensor([2.0]), torch.ones(1, 1), 0.2, 0.0)
    assert loss.item() == -2.0 and "kl" not in stats


def test_gae_by_hand():
    rewards = torch.tensor([[0.1, 0.0, 1.0, 9.0]])
    values = torch.tensor([[0.5, 0.4, 0.3, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # δ2 = 1 - 0.3 = 0.7;  δ1 = 0.9·0.3 - 0.4 = -0.13;  δ0 = 0.1 + 0.9·0.4 - 0.5 = -0.04;  γλ = 0.72
    a2 = 0.7
    a1 = -0.13 + 0.72 * a2
    a0 = -0.04 + 0.72 * a1
    torch.testing.assert_close(advantages, torch.tensor([[a0, a1, a2, 0.0]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(returns, torch.tensor([[a0 + 0.5, a1 + 0.4, a2 + 0.3, 0.0]]), rtol=0, atol=1e-6)


def test_ppo_token_rewards_by_hand():
    scores = torch.tensor([2.0, -1.0])
    log_probs = torch.tensor([[LN(0.5), LN(0.5), 0.0], [LN(0.2), 0.0, 0.0]])
    ref = torch.tensor([[LN(0.25), LN(0.5), 0.0], [LN(0.4), 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    rewards = token_rewards(scores, log_probs, ref, mask, kl_coef=0.1)
    expected = torch.tensor([[-0.1 * LN(2), 2.0, 0.0], [0.1 * LN(2) - 1.0, 0.0, 0.0]])
    torch.testing.assert_close(rewards, expected, rtol=0, atol=1e-6)


def test_clipped_value_loss_by_hand():
    values, old, returns = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.0]]), torch.tensor([[2.0, 0.0]])
    # clipped value 0.5 + 0.2 = 0.7: max((1 - 2)², (0.7 - 2)²) = 1.69, halved; the padded token does not count
    loss = clipped_value_loss(values, old, returns, torch.tensor([[1.0, 0.0]]), clip=0.2)
    assert abs(loss.item() - 0.845) < 1e-6


def test_masked_whiten_uses_only_masked_entries():
    values = torch.tensor([[1.0, 3.0, 100.0]])
    whitened = masked_whiten(values, torch.tensor([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(whitened[0, :2], torch.tensor([-1.0, 1.0]), rtol=0, atol=1e-6)
