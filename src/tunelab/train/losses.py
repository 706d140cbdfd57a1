"""Loss functions. Each takes model outputs and targets and returns a scalar tensor.

The causal-LM loss is a sum of token cross-entropies divided by the number of supervised tokens of
the whole optimizer step (`num_items_in_batch`, counted by the Trainer over every micro-batch and
every process). So `accumulation 4 x micro-batch 2` gives the same loss and gradients as
`batch 8`, whatever the lengths of the examples — unlike a mean per micro-batch.

Label smoothing (`label_smoothing_factor` ε) replaces each supervised token's one-hot target with
(1 - ε) on the label plus ε spread evenly over the vocabulary, as torch's `cross_entropy(...,
label_smoothing=ε)`: per token, (1 - ε)·(-log p[label]) + ε·mean over the vocabulary of -log p. It is
summed and normalised exactly as the plain loss, so the accumulation equality holds unchanged.

Logits only where there is a label. Position t's logits predict label t+1, so only positions whose
next label is not -100 need the output layer at all (`next_token_mask`); the Trainer passes that mask
to the model as `logits_to_keep` (a 2-D bool tensor: transformers' `slice_logits_to_keep` then
returns the (N, vocab) logits of the N kept positions, in row-major order, after the model's own
logit processing such as Gemma-2's soft-capping). With a real vocabulary (Qwen2.5: 151,936) and long
prompts this removes most of the output layer's compute and memory. Selecting with a bool mask on a GPU
makes the host wait for the device to count the kept positions. So a batch still on the host instead gets a
(batch, W) index of positions built there before it moves (`next_token_index`; TunelabTrainer for SFT and pt,
PreferenceTrainer for pair batches): each row's kept positions, then
positions whose targets are -100 up to the widest row's count W; the logits come back (batch, W, vocab) and their
targets are picked per row by a stable sort, without reading a count back (`next_token_targets` with W). Packed
rows and pt windows keep about the same count each; padding-free rows (best-fit, data/collate.py) and padded rows
hold unequal answers (SmolLM2's SFT rows: filling 0-1.0 of the kept count), and so do padding-free pair rows. Where
filling rows to W would add more than `max_index_waste` of head rows the mask is used. That limit depends on the
device: on a CPU each filling row is arithmetic the step pays for (MAX_INDEX_WASTE); on a GPU it costs microseconds
while a count read back stalls the launch queue, so more filling is taken there (MAX_INDEX_WASTE_ACCELERATOR; the
index never has more rows than every position).
All three shapes — (N, vocab), (batch, W, vocab) of the kept positions, or (batch, seq, vocab) of every position —
go through `token_log_probs`, which works in chunks of rows: the float32 copy of the logits and their softmax exist
for CHUNK_ELEMENTS at a time, never for the whole batch, and the gradient is written in the logits' own dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tunelab.data.encode import IGNORE_INDEX

CHUNK_ELEMENTS = 2**24  # float32 logits per chunk (64 MiB): ~110 rows of a 151,936-token vocabulary
MAX_INDEX_WASTE = 0.25  # next_token_index on a CPU: at most this share of extra head rows to avoid a device count
MAX_INDEX_WASTE_ACCELERATOR = 2.0  # on a GPU: pair batches' rows of 1-9 sequences fill 0.5-1.6 (SmolLM2's DPO bench)


def next_token_mask(labels: torch.Tensor) -> torch.Tensor:
    """(batch, seq) bool: positions whose next-token label is supervised (the last position never is)."""
    mask = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    mask[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return mask


def max_index_waste(device: torch.device) -> float:
    """The share of filling head rows next_token_index may add on `device` (module docstring)."""
    return MAX_INDEX_WASTE if device.type == "cpu" else MAX_INDEX_WASTE_ACCELERATOR


def next_token_order(labels: torch.Tensor, width: int) -> torch.Tensor:
    """(batch, width) positions of labels[:, 1:], each row's supervised ones first, in order, then the others: a
    stable sort, so no boolean indexing and no count read back from a GPU. Position t predicts label t + 1, so this is
    next_token_index's index and the order in which next_token_targets and sequence_log_probs pick per row."""
    return torch.argsort((labels[:, 1:] == IGNORE_INDEX).to(torch.uint8), dim=1, stable=True)[:, :width]


def next_token_index(labels: torch.Tensor, max_waste: float = MAX_INDEX_WASTE) -> torch.Tensor | None:
    """(batch, W) int64 `logits_to_keep` for labels on the host: per row its positions whose next-token label is
    supervised, in order, then unsupervised positions up to W, the largest count of a row. None when that filling
    would add more than `max_waste` of the kept rows (or nothing is kept): the caller keeps by mask instead."""
    mask = next_token_mask(labels)
    counts = mask.numpy().sum(axis=1)  # host memory, read as such (no tensor scalar read)
    width, kept = int(counts.max()), int(counts.sum())
    if kept == 0 or labels.shape[0] * width > (1 + max_waste) * kept:
        return None
    return next_token_order(labels, width)


def next_token_targets(labels: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """The labels the kept positions predict.

    Without `width`: (N,), in the order `hidden[next_token_mask(labels)]` lists them. With `width` (W, known on the
    host from the kept logits' shape): (batch, W), in next_token_index's order — each row's supervised labels moved
    to its front by a stable sort, -100 after them — with no boolean indexing, so a GPU does not stop to count."""
    shifted = labels[:, 1:]
    if width is None:
        return shifted[shifted != IGNORE_INDEX]
    return shifted.gather(1, next_token_order(labels, width))


def kept_pairs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """((M, vocab) logits, (M,) targets) of the positions that predict a label, from the logits of
    - every position, (batch, seq, vocab): the kept rows are picked here;
    - the kept positions of a bool mask, (N, vocab): the model picked them (transformers' slice);
    - the kept positions of an index, (batch, W, vocab) (W < seq: the last position is never kept); targets of
      the filling positions are -100, which token_log_probs counts as nothing."""
    labels = labels.to(logits.device)
    if logits.dim() == 3 and logits.shape[:2] != labels.shape:
        return logits.reshape(-1, logits.shape[-1]), next_token_targets(labels, logits.shape[1]).reshape(-1)
    if logits.dim() == 2:  # token_log_probs checks the rows against the targets (no device read here)
        return logits, next_token_targets(labels)
    return logits[next_token_mask(labels)], next_token_targets(labels)


class _TokenLogProbs(torch.autograd.Function):
    """log p(target), and with `with_mean` the mean log p over the vocabulary, per row of (N, V) logits, chunked.

    Forward keeps one float32 logsumexp per row; backward recomputes each chunk's softmax and writes
    d/dlogits = g_target·(onehot − p) + g_mean·(1/V − p) in the logits' dtype, straight into the gradient when the
    logits are float32. Without label smoothing the mean is neither computed nor differentiated: every pass over
    (chunk, V) elements counts where the head runs at every position (pt).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int, with_mean: bool):
        rows, vocab = logits.shape
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        mean = torch.empty(rows, dtype=torch.float32, device=logits.device) if with_mean else None
        buffer = _chunk_buffer(logits, chunk)
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            part = buffer[: end - start]
            part.copy_(logits[start:end])
            if with_mean:
                mean[start:end] = part.mean(dim=-1)
            top = part.amax(dim=-1, keepdim=True)
            lse[start:end] = part.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(1))
        picked = logits.gather(1, targets[:, None]).squeeze(1).float()
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk, ctx.with_mean = chunk, with_mean
        return picked - lse, (mean - lse) if with_mean else torch.zeros_like(lse)

    @staticmethod
    def backward(ctx, grad_picked: torch.Tensor, grad_mean: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        rows, vocab = logits.shape
        grad = torch.empty_like(logits)
        in_place = logits.dtype == torch.float32
        buffer = None if in_place else _chunk_buffer(logits, ctx.chunk)
        for start in range(0, rows, ctx.chunk):
            end = min(start + ctx.chunk, rows)
            g_pick = grad_picked[start:end, None]
            part = grad[start:end] if in_place else buffer[: end - start]
            part.copy_(logits[start:end]).sub_(lse[start:end, None]).exp_()  # the softmax
            if ctx.with_mean:
                g_mean = grad_mean[start:end, None]
                part.mul_(-(g_pick + g_mean)).add_(g_mean / vocab)
            else:
                part.mul_(-g_pick)
            part.scatter_add_(1, targets[start:end, None], g_pick)
            if not in_place:
                grad[start:end] = part
        return grad, None, None, None


def _chunk_buffer(logits: torch.Tensor, chunk: int) -> torch.Tensor:
    """One float32 (chunk, vocab) buffer that every chunk reuses with in-place ops. A fresh tensor per chunk and
    per intermediate (`.float()`, then logsumexp's own temporaries) costs more than the arithmetic on a CPU: each
    large allocation is new pages, faulted in on first write. On a pt batch of SmolLM2 the reuse cuts the loss's
    forward and backward to about a third (docs/benchmarks.md, "pt after the loss's buffer reuse")."""
    return torch.empty((min(chunk, logits.shape[0]), logits.shape[1]), dtype=torch.float32, device=logits.device)


def token_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, chunk: int | None = None, with_mean: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p[target], mean over the vocabulary of log p), float32, one per row of (N, vocab) logits; 0 for both
    where the target is -100 (the filling rows of next_token_index), which then take no part in the gradient.
    The mean (label smoothing's term) only with `with_mean`; zeros otherwise."""
    if logits.shape[0] != targets.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits for {targets.shape[0]} supervised positions")
    if logits.shape[0] == 0:
        empty = logits.new_zeros(0, dtype=torch.float32) + logits.sum() * 0  # keeps the graph for backward
        return empty, empty
    chunk = chunk or max(1, CHUNK_ELEMENTS // logits.shape[-1])
    targets = targets.to(logits.device)
    counted = targets != IGNORE_INDEX
    log_p, mean = _TokenLogProbs.apply(logits, targets.clamp(min=0), chunk, with_mean)
    return log_p * counted, mean * counted


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Next-token cross-entropy over supervised positions.

    logits: of every position or of the kept positions only (kept_pairs, module docstring); labels: (batch,
    seq) with -100 where nothing is supervised. Token t's logits predict
    label t+1. Without num_items_in_batch (evaluation), the mean over this batch's supervised tokens.
    """
    kept, targets = kept_pairs(logits, labels)
    log_p, mean_log_p = token_log_probs(kept, targets, with_mean=bool(label_smoothing))
    nll = -log_p.sum()
    total = (1 - label_smoothing) * nll - label_smoothing * mean_log_p.sum() if label_smoothing else nll
    if num_items_in_batch is None:
        num_items_in_batch = (targets != IGNORE_INDEX).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


@dataclass(frozen=True)
class CausalLMLoss:
    """The `compute_loss_func` transformers.Trainer calls: causal_lm_loss with the run's label smoothing."""

    label_smoothing: float = 0.0

    def __call__(self, outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        return causal_lm_loss(logits, labels, num_items_in_batch, self.label_smoothing)


causal_lm_loss_func = CausalLMLoss()  # no smoothing: the Trainer's default in TunelabTrainer
