"""The preference losses as pure functions on tensors: Bradley–Terry, the DPO family, KTO.

Nothing here knows about models, batches or trainers (train/preference_trainer.py calls these).
Every loss returns one value per pair (or per example for KTO), unreduced, with the implicit
rewards it logs. Inputs are sequence log-probabilities from `sequence_log_probs`:

    labels   [-100 -100 -100  a1  a2  <eot>  -100]     (only the answer is supervised)
    logp     = log p(a1|..) + log p(a2|..) + log p(<eot>|..)   (sum; `count` = 3)

Which losses use the sum and which the per-token average (divide by count) follows each paper:
sigmoid (DPO) and hinge (SLiC) the sum; IPO, ORPO and SimPO the average (IPO as in TRL and
LlamaFactory; ORPO and SimPO define their losses on length-normalised log-probs). KTO the sum.

Notation: pc / pr = policy log-probs of the chosen / rejected answer, rc / rr = the reference's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tunelab.data.encode import IGNORE_INDEX
from tunelab.train.losses import kept_pairs, next_token_order, token_log_probs

DPO_LOSSES = ("sigmoid", "ipo", "hinge", "orpo", "simpo")
AVERAGED_LOSSES = ("ipo", "orpo", "simpo")  # log-probs averaged over the answer's tokens


def sequence_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, sequence_ids: torch.Tensor | None = None,
    sequence_count: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of log-probs over supervised tokens, number of supervised tokens), one per sequence.

    logits: (N, L, V) of every position, or of the positions that predict a label only (the model ran with
    `logits_to_keep`, train/losses.py): (K, V) for a bool mask, (N, W, V) for a host-built index. labels: (N, L),
    -100 where nothing is supervised. Token t's logits predict label t+1. Computed in float32 chunks
    (losses.token_log_probs), without a log-softmax copy of the logits. A sequence is a row, or with `sequence_ids`
    ((N, L): the owner 0..S-1 of each position, -1 at padding; padding-free pair batches) every position with that
    id; a sequence's first label is -100, so no prediction crosses from one sequence into the next. With an index
    and `sequence_count` (S, counted on the host) nothing here makes a GPU report a value back: the owners follow
    the index's order (losses.next_token_order) and both sums are scatter-adds.
    """
    labels = labels.to(logits.device)
    kept, targets = kept_pairs(logits, labels)
    token_logps = token_log_probs(kept, targets)[0]
    if sequence_ids is None:
        owner = torch.arange(labels.shape[0], device=labels.device)[:, None].expand(-1, labels.shape[1] - 1)
        count = labels.shape[0]
    else:
        owner = sequence_ids.to(labels.device)[:, 1:]
        count = sequence_count if sequence_count is not None else int(sequence_ids.max()) + 1
    if logits.dim() == 3 and logits.shape[:2] != labels.shape:  # an index: filling positions add 0 to any owner
        owners = owner.gather(1, next_token_order(labels, logits.shape[1])).clamp(min=0).reshape(-1)
    else:
        owners = owner[labels[:, 1:] != IGNORE_INDEX]
    supervised = (targets != IGNORE_INDEX).long()
    sums = token_logps.new_zeros(count).index_add(0, owners, token_logps)
    return sums, torch.zeros(count, dtype=torch.long, device=owners.device).index_add(0, owners, supervised)


def bradley_terry_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """Reward-model loss per pair: -log sigmoid(r_chosen - r_rejected)."""
    return -F.logsigmoid(chosen_rewards - rejected_rewards)


def dpo_loss(
    pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor,
    beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference-based losses per pair, with the implicit rewards beta * (policy - reference).

    h = (pc - rc) - (pr - rr)
      sigmoid: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)    (eps = label_smoothing, cDPO)
      ipo:     (h - 1 / (2 beta))^2                                          (pass averaged log-probs)
      hinge:   max(0, 1 - beta h)
    Returns (losses, chosen_rewards, rejected_rewards); rewards carry no gradient.
    """
    h = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"dpo_loss: unknown loss_type {loss_type!r} (sigmoid, ipo, hinge)")
    return losses, (beta * (pc - rc)).detach(), (beta * (pr - rr)).detach()


def orpo_loss(pc: torch.Tensor, pr: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO per pair on averaged log-probs: NLL(chosen) + beta * -log sigmoid(log odds ratio).

    log odds(y) = log p - log(1 - p) with p = exp(avg log-prob); the ratio term compares chosen with
    rejected. Rewards are beta * avg log-prob (no reference).
    """
    log_odds = (pc - pr) - (torch.log1p(-torch.exp(pc)) - torch.log1p(-torch.exp(pr)))
    losses = -pc - beta * F.logsigmoid(log_odds)
    return losses, (beta * pc).detach(), (beta * pr).detach()


def simpo_loss(
    pc: torch.Tensor, pr: torch.Tensor, beta: float, gamma: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO per pair on averaged log-probs: -log sigmoid(beta (pc - pr) - gamma); rewards beta * avg log-prob."""
    losses = -F.logsigmoid(beta * (pc - pr) - gamma)
    return losses, (beta * pc).detach(), (beta * pr).detach()


def kto_kl_estimate(policy_kl_logps: torch.Tensor, reference_kl_logps: torch.Tensor) -> torch.Tensor:
    """The KTO reference point z0: mean log-ratio of mismatched (prompt, other answer) pairs, clamped at 0
    and detached (the paper passes no gradient through it)."""
    return (policy_kl_logps - reference_kl_logps).mean().clamp(min=0).detach()


def kto_loss(
    policy_logps: torch.Tensor, reference_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor,
    beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO per example: with r = policy - reference log-prob and z0 = kl,
      desirable:   w_d (1 - sigmoid(beta (r - z0)))
      undesirable: w_u (1 - sigmoid(beta (z0 - r)))
    Returns (losses, rewards beta * r); `desirable` is a bool tensor.
    """
    log_ratio = policy_logps - reference_logps
    losses = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (log_ratio - kl))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl - log_ratio))),
    )
    return losses, (beta * log_ratio).detach()
