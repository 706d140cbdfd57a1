"""The arithmetic of grpo and ppo (train/rl/losses.py, ppo.token_rewards) against hand computations."""

from __future__ import annotations

import math

import torch

from tunelab.config.args import ADVANTAGE_ESTIMATORS, GRPO_LOSS_TYPES
from tunelab.train.rl.losses import (
    clipped_value_loss, estimate_advantages, gae, grpo_loss, group_advantages,
    high_entropy_mask, kl_k3, masked_whiten, zero_spread_groups,
)
from tunelab.train.rl.ppo import token_rewards

LN = math.log


def test_group_advantages_normalise_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    # group 1: mean 0.5, unbiased std sqrt((4 · 0.25) / 3); group 2: all equal → no signal.
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    expected = torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(rewards, 4), expected, rtol=0, atol=1e-7)


def test_rloo_advantages_by_hand():
    # G = 3. Group 1 [1, 0, 0]: 1 - (0 + 0) / 2, 0 - (1 + 0) / 2 twice. Group 2 [3, 1, 2]: 3 - 1.5, 1 - 2.5, 2 - 2.
    # (grpo with scale_rewards none would give 2/3, -1/3, -1/3, 1, -1, 0.)
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0, 1.0, 2.0])
    mask = torch.ones(6, 2)
    got = estimate_advantages("rloo", rewards, 3, mask)
    torch.testing.assert_close(got, torch.tensor([1.0, -0.5, -0.5, 1.5, -1.5, 0.0]), rtol=0, atol=1e-6)


def test_reinforce_plus_plus_advantages_by_hand():
    # Rewards [1, 0 | 3, 1] (G = 2), completions of 2, 1, 1, 2 tokens. Each token's return is its completion's
    # reward: 1 1 | 0 | 3 | 1 1, mean 7/6, population variance 29/36, so (return - 7/6) / (sqrt(29) / 6).
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    expected = torch.tensor([[-1.0, -1.0], [-7.0, 0.0], [11.0, 0.0], [-1.0, -1.0]]) / 6 / (math.sqrt(29) / 6 + 1e-4)
    got = estimate_advantages("reinforce_plus_plus", rewards, 2, mask)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # _baseline: the group means first, 0.5 -0.5 | 1 -1, then per token 0.5 0.5 | -0.5 | 1 | -1 -1: mean -1/12,
    # population variance 89/144.
    expected = torch.tensor([[7.0, 7.0], [-5.0, 0.0], [13.0, 0.0], [-11.0, -11.0]]) / 12 / (math.sqrt(89) / 12 + 1e-4)
    got = estimate_advantages("reinforce_plus_plus_baseline", rewards, 2, mask)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_every_estimator_gives_zero_to_a_batch_of_equal_rewards_and_grpo_is_the_default_path():
    rewards, mask = torch.full((4,), 0.7), torch.ones(4, 3)
    for estimator in ADVANTAGE_ESTIMATORS:
        assert estimate_advantages(estimator, rewards, 2, mask).abs().max() < 1e-5, estimator
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])
    torch.testing.assert_close(estimate_advantages("grpo", rewards, 2, mask, "none"), torch.tensor([0.5, -0.5, 0, 0]))


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


def test_scale_rewards_batch_and_none_by_hand():
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0])
    # centred on the group means (0.5, 3): [0.5, -0.5, 0, 0]; batch std = unbiased std of all four
    batch_std = math.sqrt(((1 - 1.75) ** 2 + 1.75**2 + 2 * 1.25**2) / 3)
    expected = torch.tensor([0.5, -0.5, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(rewards, 2, "none"), expected, rtol=0, atol=1e-7)
    torch.testing.assert_close(group_advantages(rewards, 2, "batch"), expected / (batch_std + 1e-4), rtol=0, atol=1e-7)
    group_std = math.sqrt(0.5)  # unbiased std of (1, 0)
    torch.testing.assert_close(group_advantages(rewards, 2, "group"), expected / torch.tensor([group_std + 1e-4] * 2 + [1e-4] * 2),
                               rtol=0, atol=1e-7)


def test_zero_spread_groups_are_the_groups_whose_rewards_are_all_equal():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    assert zero_spread_groups(rewards, 2).tolist() == [True, False, True]


# One case for every reduction: completion 1 has 3 tokens with policy ratios 1.25, 1, 1 and A = +1; completion 2 has
# 1 token (then padding, whose values must not count) with ratio 1 and A = -2. No reference (kl 0).
VARIANT_CASE = dict(
    log_probs=torch.tensor([[LN(1.25), 0.0, 0.0], [0.0, 7.0, 7.0]]),
    old_log_probs=torch.zeros(2, 3),
    ref_log_probs=None,
    advantages=torch.tensor([1.0, -2.0]),
    mask=torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]),
    epsilon=0.2, kl_coef=0.0,
)


def test_each_loss_type_by_hand():
    # per-token losses: -min(1.25, 1.2) = -1.2, -1, -1 (sum -3.2); 2 (sum 2)
    expected = {
        "grpo": (-3.2 / 3 + 2) / 2,  # mean of the completions' token means
        "bnpo": (-3.2 + 2) / 4,  # token mean over the batch
        "dr_grpo": (-3.2 + 2) / (2 * 5),  # N · max_completion_length (5)
        "dapo": (-3.2 + 2) / 10,  # the optimizer step's tokens, here given as 10
    }
    for loss_type, value in expected.items():
        loss, _ = grpo_loss(**VARIANT_CASE, loss_type=loss_type, max_completion_length=5, dapo_tokens=10)
        assert abs(loss.item() - value) < 1e-6, loss_type
    loss, _ = grpo_loss(**VARIANT_CASE, loss_type="dapo")  # without the step's count: this batch's tokens (= bnpo)
    assert abs(loss.item() - expected["bnpo"]) < 1e-6


def test_epsilon_high_clips_higher_only_above():
    # clip-higher: ratio 1.25 is inside [0.8, 1.28], so it is no longer clipped: -1.25 instead of -1.2
    loss, stats = grpo_loss(**VARIANT_CASE, loss_type="bnpo", epsilon_high=0.28)
    assert abs(loss.item() - (-3.25 + 2) / 4) < 1e-6 and stats["clip_ratio"].item() == 0.0
    _, stats = grpo_loss(**VARIANT_CASE, loss_type="bnpo")
    assert abs(stats["clip_ratio"].item() - 1 / 4) < 1e-6
    # a low ratio with A < 0 is still clipped at 1 - epsilon: -min(0.5 · -1, 0.8 · -1) = 0.8
    one = dict(old_log_probs=torch.zeros(1, 1), ref_log_probs=None, advantages=torch.tensor([-1.0]),
               mask=torch.ones(1, 1), epsilon=0.2, kl_coef=0.0)
    loss, _ = grpo_loss(torch.tensor([[LN(0.5)]]), **one, epsilon_high=0.28)
    assert abs(loss.item() - 0.8) < 1e-6


def test_sequence_level_importance_sampling_by_hand():
    # token ratios 2, 1, 0.5 (padding's log-ratio 9 ignored): the completion's ratio is exp(mean log-ratio) = 1,
    # so nothing is clipped: loss -A = -1. Per token: -min(2, 1.2) = -1.2, -1, -min(0.5, 0.8) = -0.5 → -0.9.
    log_probs = torch.tensor([[LN(2), 0.0, LN(0.5), 9.0]], requires_grad=True)
    case = dict(old_log_probs=torch.zeros(1, 4), ref_log_probs=None, advantages=torch.tensor([1.0]),
                mask=torch.tensor([[1.0, 1.0, 1.0, 0.0]]), epsilon=0.2, kl_coef=0.0)
    loss, stats = grpo_loss(log_probs, **case, importance_sampling_level="sequence")
    assert abs(loss.item() + 1.0) < 1e-6 and stats["clip_ratio"].item() == 0.0
    loss.backward()  # d/d lp_t of -exp(mean_t lp_t) = -1/3 on each real token, 0 on padding
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-1 / 3, -1 / 3, -1 / 3, 0.0]]), rtol=0, atol=1e-6)
    token_loss, _ = grpo_loss(log_probs.detach(), **case)
    assert abs(token_loss.item() + 0.9) < 1e-6


def test_high_entropy_mask_keeps_the_top_share_of_the_real_tokens():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 9.0], [0.3, 0.7, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # padding's 9.0 must not count
    # real entropies 0.1 0.3 0.5 0.7 0.9: the 0.5 quantile is 0.5 → keep 0.5, 0.7, 0.9
    assert high_entropy_mask(entropy, mask, 0.5).tolist() == [[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    assert high_entropy_mask(entropy, mask, 1.0).tolist() == mask.tolist()
    assert high_entropy_mask(entropy, mask, 0.0).tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


def test_entropy_mask_keeps_the_policy_term_on_the_chosen_tokens_and_the_kl_on_all():
    # VARIANT_CASE with a reference: per-token policy losses -1.2, -1, -1 | 2; keep tokens 0 and 3 (index 1, 0)
    case = {**VARIANT_CASE, "ref_log_probs": torch.tensor([[LN(1.25), LN(0.5), 0.0], [0.0, 0.0, 0.0]]),
            "kl_coef": 0.1}
    keep = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    loss, _ = grpo_loss(**case, loss_type="bnpo", entropy_mask=keep)
    kl_token_2 = 0.5 - LN(0.5) - 1  # k3 with r = ln 0.5; the other tokens' policy and reference agree
    assert abs(loss.item() - (-1.2 + 0.1 * kl_token_2 + 2) / 4) < 1e-6


def test_dapo_over_accumulated_batches_equals_one_token_mean_over_the_step():
    """What grpo.GRPO.begin_round sets up: each batch's loss / accum (the loop) with dapo_tokens = step tokens /
    accum sums to the token mean over the whole step, whatever the batches' lengths."""
    generator = torch.Generator().manual_seed(0)
    log_probs, old = torch.randn(4, 5, generator=generator), torch.randn(4, 5, generator=generator)
    ref, advantages = torch.randn(4, 5, generator=generator), torch.randn(4, generator=generator)
    mask = torch.tensor([[1.0] * 5, [1.0, 1.0, 0, 0, 0], [1.0, 0, 0, 0, 0], [1.0] * 4 + [0.0]])
    whole, _ = grpo_loss(log_probs, old, ref, advantages, mask, 0.2, 0.1, loss_type="bnpo")
    parts = sum(
        grpo_loss(log_probs[rows], old[rows], ref[rows], advantages[rows], mask[rows], 0.2, 0.1,
                  loss_type="dapo", dapo_tokens=mask.sum().item() / 2)[0] / 2
        for rows in (slice(0, 2), slice(2, 4))
    )
    assert abs(parts.item() - whole.item()) < 1e-6
    bnpo_parts = sum(grpo_loss(log_probs[rows], old[rows], ref[rows], advantages[rows], mask[rows], 0.2, 0.1,
                               loss_type="bnpo")[0] / 2 for rows in (slice(0, 2), slice(2, 4)))
    assert abs(bnpo_parts.item() - whole.item()) > 1e-3  # bnpo per batch is not that


def trl_documented_loss(log_probs, old, ref, advantages, mask, beta, eps_low, eps_high, loss_type, level,
                        max_completion_length, num_items_in_batch, entropies=None, top_entropy_quantile=1.0):
    """TRL's GRPO loss as its GRPOTrainer docs and GRPOConfig describe it (trl is not a tunelab dependency and its
    loss is a method of a trainer holding a model, so the formulas are written out here, not imported):
    importance weight exp(log π - log π_old) per token, or per sequence exp(masked mean of the log-ratios);
    coef_2 = clamp(w, 1 - epsilon, 1 + epsilon_high); L = -min(w·A, coef_2·A) + beta·k3;
    grpo: mean over sequences of masked token means; bnpo: masked sum / mask sum; dr_grpo: masked sum /
    (sequences · max_completion_length); dapo: masked sum / num_items_in_batch (tokens of the accumulated batch).
    top_entropy_quantile ρ: the policy term only on tokens whose entropy is >= the (1 - ρ) quantile of the
    non-padding tokens' entropies, before the KL term is added."""
    log_ratio = log_probs - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * advantages.unsqueeze(1), coef_2 * advantages.unsqueeze(1))
    if entropies is not None:
        threshold = torch.quantile(entropies[mask.bool()], 1 - top_entropy_quantile)
        per_token = per_token * ((entropies * mask >= threshold) & mask.bool())
    per_token = per_token + beta * (torch.exp(ref - log_probs) - (ref - log_probs) - 1)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * max_completion_length)
    return (per_token * mask).sum() / num_items_in_batch


def test_every_variant_equals_trls_documented_formula_on_the_same_inputs():
    generator = torch.Generator().manual_seed(1)
    log_probs = torch.randn(6, 7, generator=generator) * 0.3 - 1
    old = log_probs + torch.randn(6, 7, generator=generator) * 0.3  # ratios around 1, some clipped
    ref = log_probs + torch.randn(6, 7, generator=generator) * 0.2
    advantages = torch.randn(6, generator=generator)
    lengths = torch.tensor([7, 3, 1, 5, 6, 2])
    mask = (torch.arange(7)[None, :] < lengths[:, None]).float()
    for loss_type in GRPO_LOSS_TYPES:
        for level in ("token", "sequence"):
            for eps_high in (0.2, 0.28):
                ours, _ = grpo_loss(log_probs, old, ref, advantages, mask, 0.2, 0.04, loss_type=loss_type,
                                    epsilon_high=eps_high, importance_sampling_level=level,
                                    max_completion_length=8, dapo_tokens=40.0)
                theirs = trl_documented_loss(log_probs, old, ref, advantages, mask, 0.04, 0.2, eps_high, loss_type,
                                             level, 8, 40.0)
                assert abs(ours.item() - theirs.item()) < 1e-6, (loss_type, level, eps_high)
    entropies = torch.rand(6, 7, generator=generator) * 3
    for quantile in (0.0, 0.2, 0.7):
        ours, _ = grpo_loss(log_probs, old, ref, advantages, mask, 0.2, 0.04, loss_type="bnpo",
                            entropy_mask=high_entropy_mask(entropies, mask, quantile))
        theirs = trl_documented_loss(log_probs, old, ref, advantages, mask, 0.04, 0.2, 0.2, "bnpo", "token", 8, 40.0,
                                     entropies, quantile)
        assert abs(ours.item() - theirs.item()) < 1e-6, quantile


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
