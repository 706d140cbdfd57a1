"""Every preference loss against values computed by hand (math module, float64) from explicit inputs."""

from __future__ import annotations

import math

import pytest
import torch

from tunelab.train import preference_losses as L


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# Two pairs: policy / reference log-probs of the chosen (pc, rc) and rejected (pr, rr) answers.
PC, PR, RC, RR = t(-4.0, -7.5), t(-6.0, -7.0), t(-5.0, -7.0), t(-5.5, -6.0)
# h = (pc - rc) - (pr - rr): pair 0: 1.0 - (-0.5) = 1.5; pair 1: -0.5 - (-1.0) = 0.5
H = (1.5, 0.5)


def test_bradley_terry():
    losses = L.bradley_terry_loss(t(2.0, -1.0), t(0.5, 1.0))
    assert losses.tolist() == pytest.approx([-log_sigmoid(1.5), -log_sigmoid(-2.0)], abs=1e-6)
    assert losses[0].item() == pytest.approx(0.2014132779827524, abs=1e-6)


def test_sigmoid_dpo_with_label_smoothing():
    beta, eps = 0.1, 0.2
    losses, chosen, rejected = L.dpo_loss(PC, PR, RC, RR, beta, "sigmoid", eps)
    expected = [-(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h) for h in H]
    assert losses.tolist() == pytest.approx(expected, abs=1e-6)
    assert chosen.tolist() == pytest.approx([0.1, -0.05], abs=1e-6)  # beta * (pc - rc)
    assert rejected.tolist() == pytest.approx([-0.05, -0.1], abs=1e-6)  # beta * (pr - rr)
    plain, _, _ = L.dpo_loss(PC, PR, RC, RR, beta, "sigmoid")
    assert plain[0].item() == pytest.approx(-log_sigmoid(0.15), abs=1e-6)


def test_ipo():
    beta = 0.25  # 1 / (2 beta) = 2
    losses, _, _ = L.dpo_loss(PC, PR, RC, RR, beta, "ipo")
    assert losses.tolist() == pytest.approx([(1.5 - 2) ** 2, (0.5 - 2) ** 2], abs=1e-6)  # 0.25, 2.25


def test_hinge():
    losses, _, _ = L.dpo_loss(PC, PR, RC, RR, 0.5, "hinge")
    assert losses.tolist() == pytest.approx([max(0, 1 - 0.75), max(0, 1 - 0.25)], abs=1e-6)
    zero, _, _ = L.dpo_loss(PC, PR, RC, RR, 1.0, "hinge")
    assert zero[0].item() == 0.0  # margin 1.5 beyond the hinge


def test_orpo():
    pc, pr, beta = t(-0.5), t(-1.2), 0.3  # averaged log-probs
    losses, chosen, rejected = L.orpo_loss(pc, pr, beta)
    log_odds = (-0.5 - math.log(1 - math.exp(-0.5))) - (-1.2 - math.log(1 - math.exp(-1.2)))
    assert losses.item() == pytest.approx(0.5 - beta * log_sigmoid(log_odds), abs=1e-6)
    assert (chosen.item(), rejected.item()) == pytest.approx((-0.15, -0.36), abs=1e-6)


def test_simpo():
    pc, pr, beta, gamma = t(-0.8, -1.0), t(-1.1, -0.9), 2.0, 0.5
    losses, chosen, _ = L.simpo_loss(pc, pr, beta, gamma)
    assert losses.tolist() == pytest.approx([-log_sigmoid(2.0 * 0.3 - 0.5), -log_sigmoid(2.0 * -0.1 - 0.5)], abs=1e-6)
    assert chosen.tolist() == pytest.approx([-1.6, -2.0], abs=1e-6)


def test_kto():
    policy, reference = t(-3.0, -5.0, -4.0), t(-4.0, -4.5, -4.0)  # log-ratios 1.0, -0.5, 0.0
    desirable = torch.tensor([True, False, True])
    kl = L.kto_kl_estimate(t(-10.0, -12.0), t(-10.5, -12.3))  # mean(0.5, 0.3) = 0.4
    assert kl.item() == pytest.approx(0.4, abs=1e-6)
    assert L.kto_kl_estimate(t(-10.0), t(-9.0)).item() == 0.0  # clamped at 0
    beta, wd, wu = 0.5, 1.0, 1.5
    losses, rewards = L.kto_loss(policy, reference, desirable, kl, beta, wd, wu)
    expected = [
        wd * (1 - sigmoid(beta * (1.0 - 0.4))),
        wu * (1 - sigmoid(beta * (0.4 - -0.5))),
        wd * (1 - sigmoid(beta * (0.0 - 0.4))),
    ]
    assert losses.tolist() == pytest.approx(expected, abs=1e-6)
    assert rewards.tolist() == pytest.approx([0.5, -0.25, 0.0], abs=1e-6)


def test_sequence_log_probs_sum_only_supervised_tokens():
    # vocab 3; row 0 supervises positions 2 and 3 (predicted from positions 1 and 2)
    logits = torch.log(t(0.2, 0.3, 0.5)).repeat(1, 4, 1)
    logits[0, 2] = torch.log(t(0.6, 0.3, 0.1))
    labels = torch.tensor([[-100, -100, 2, 0]])
    total, count = L.sequence_log_probs(logits, labels)
    assert count.tolist() == [2]
    assert total.item() == pytest.approx(math.log(0.5) + math.log(0.6), abs=1e-6)
