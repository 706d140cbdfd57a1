"""The distillation loss of stage kd: the generalised Jensen-Shannon divergence between the student's and the
teacher's next-token distributions, at the positions that predict a label (GKD, Agarwal et al. 2024; TRL's
GKDTrainer names and meanings).

Per supervised position, with s = log_softmax(student_logits / T) and t = log_softmax(teacher_logits / T):

    beta 0        KL(teacher ‖ student) = Σ_v p_t (t - s)                         forward KL (mode covering)
    beta 1        KL(student ‖ teacher) = Σ_v p_s (s - t)                         reverse KL (mode seeking)
    0 < beta < 1  beta·KL(teacher ‖ m) + (1 - beta)·KL(student ‖ m),   m = beta·p_t + (1 - beta)·p_s

summed over the supervised positions and divided by their count over the optimizer step (`num_items_in_batch`,
as the token cross-entropy of train/losses.py is), so gradient accumulation does not change it. The temperature
divides both models' logits; no T² factor (as TRL's).

Memory: the logits come in as the models return them, ideally of the kept positions only (`logits_to_keep`). The
divergence then runs in chunks of rows: the float32 log-probs of both models exist for one chunk at a time, and
under autograd each chunk is recomputed in the backward pass (activation checkpointing) instead of kept, so a
Qwen-sized vocabulary (151,936) costs one (chunk, vocab) set of float32 temporaries, not one per supervised token.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from tunelab.data.encode import IGNORE_INDEX
from tunelab.train.losses import CHUNK_ELEMENTS, kept_pairs


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                     temperature: float = 1.0) -> torch.Tensor:
    """(rows,) float32: the generalised JSD of each row of (rows, vocab) student and teacher logits (module
    docstring). Differentiable in the student's logits; the teacher's are taken as constants."""
    s = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    t = torch.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    if beta == 0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1:
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logaddexp(s + math.log(1 - beta), t + math.log(beta))
    return beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)


def divergence_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float,
                   chunk: int | None = None) -> torch.Tensor:
    """The summed token_divergence of (rows, vocab) logits, one chunk of rows at a time (module docstring)."""
    rows, vocab = student_logits.shape
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"teacher logits {tuple(teacher_logits.shape)} beside student logits "
                         f"{tuple(student_logits.shape)}")
    if rows == 0:
        return student_logits.sum() * 0.0  # keeps the graph for backward
    chunk = chunk or max(1, CHUNK_ELEMENTS // vocab)
    recompute = torch.is_grad_enabled() and student_logits.requires_grad
    total = torch.zeros((), dtype=torch.float32, device=student_logits.device)
    for start in range(0, rows, chunk):
        part = (student_logits[start:start + chunk], teacher_logits[start:start + chunk], beta, temperature)
        if recompute:  # only the chunk's inputs (views) are kept for backward, its float32 log-probs recomputed
            total = total + checkpoint(token_divergence, *part, use_reentrant=False).sum()
        else:
            total = total + token_divergence(*part).sum()
    return total


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
    num_items_in_batch: torch.Tensor | int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """The generalised JSD per supervised token (module docstring).

    Both logits in one of train/losses.py kept_pairs' shapes: of every position (batch, seq, vocab), of the kept
    positions of a bool mask (N, vocab), or of an index (batch, W, vocab); the two need not share a shape (a teacher
    whose forward keeps every position beside a student that keeps some). labels: (batch, seq), -100 where nothing
    is supervised; position t's logits predict label t + 1. Without num_items_in_batch (evaluation): the mean over
    this batch's supervised tokens."""
    student, targets = kept_pairs(student_logits, labels)
    teacher, teacher_targets = kept_pairs(teacher_logits, labels)
    if teacher.shape[0] != student.shape[0]:  # index-kept rows carry filling rows: keep the supervised ones of both
        student, teacher = student[targets != IGNORE_INDEX], teacher[teacher_targets != IGNORE_INDEX]
        targets = targets[targets != IGNORE_INDEX]
    else:
        counted = targets != IGNORE_INDEX
        if not bool(counted.all()):
            student, teacher, targets = student[counted], teacher[counted], targets[counted]
    total = divergence_sum(student, teacher, beta, temperature, chunk)
    if num_items_in_batch is None:
        num_items_in_batch = targets.numel()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
