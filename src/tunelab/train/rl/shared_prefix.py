"""A group's prompt computed once: the G completions of one prompt share its keys and values.

Sampling: the prompts (B rows, left-padded) are prefilled into a KV cache once, less their last token, and the
cache is repeated G times; `generate` then runs the last prompt token and the decode steps for the B·G rows.

Log-probs (policy with gradients, old policy, reference): each group becomes one row,

    [pad pad p0 p1 p2 | c0 c1 <eot> pad | c0' c1' c2' <eot> | ...]      B × (P + G·C)

with a 4D attention mask in which the prompt is causal over its real tokens and each completion block sees the
whole prompt and itself causally, never another block. Completion positions continue from the prompt's length,
so every completion token gets the position and the context it had when it was sampled. Logits are computed only
where a completion token is predicted: the last prompt column (the first token of all G completions) and each
block's columns but its last. The forward then covers P + G·C tokens a group instead of G·(P + C).

A custom 4D mask replaces the model's own: it applies only to text models with a single 1D position per token,
attention through sdpa or eager, and rows no longer than a sliding window (which the custom mask would ignore).
And only where it is cheaper: attention over the grouped row is dense (L² for L = P + G·C, the blocks' mutual
masking is not skipped), so long completions in large groups can cost more in attention than the shared prompt
saves in the linear layers; `cheaper` weighs the two from the model's shape.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from tunelab.data.collate import SDPA_VARLEN
from tunelab.model.text_config import text_config
from tunelab.train.rl.log_probs import position_ids_from_mask, tempered_log_probs

MASKABLE_ATTENTION = ("sdpa", "eager", SDPA_VARLEN)  # sdpa_varlen: sdpa itself for a row with a mask


def _config(model):
    return getattr(model, "module", model).config  # without a DDP wrapper


def _text_only(config) -> bool:
    """A plain text model: one 1D position per token, no image inputs to line up."""
    return getattr(config, "vision_config", None) is None


def _fits(config, length: int) -> bool:
    """A custom mask is exact for this model and a row of `length` tokens."""
    text = text_config(config)
    if not _text_only(config) or getattr(config, "_attn_implementation", None) not in MASKABLE_ATTENTION:
        return False
    windows = [getattr(text, name, None) for name in ("sliding_window", "attention_chunk_size")]
    return all(not window or length <= window for window in windows)


def cheaper(config, groups: int, group: int, prompt: int, completion: int) -> bool:
    """The grouped layout's forward costs fewer FLOPs than one row per completion: linear layers per token
    (2 × the layers' weights), attention per query-key pair (QKᵀ and the weighted values, both computed densely)."""
    text = text_config(config)
    hidden, layers = text.hidden_size, text.num_hidden_layers
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv = (getattr(text, "num_key_value_heads", None) or heads) * head_dim
    inner = getattr(text, "intermediate_size", None) or 4 * hidden
    per_token = 2 * layers * (2 * hidden * heads * head_dim + 2 * hidden * kv + 3 * hidden * inner)
    per_pair = 4 * layers * heads * head_dim
    grouped_row = prompt + group * completion
    grouped = groups * (grouped_row * per_token + grouped_row**2 * per_pair)
    plain = groups * group * ((prompt + completion) * per_token + (prompt + completion) ** 2 * per_pair)
    return grouped < plain


def applies(model, rollout) -> bool:
    group, width = rollout.group_size, rollout.prompt_width
    rows, completion = rollout.completion_mask.shape
    config = _config(model)
    return (group > 1 and completion > 0 and _fits(config, width + group * completion)
            and cheaper(config, rows // group, group, width, completion))


@torch.no_grad()
def prefilled_cache(model, prompts: torch.Tensor, prompt_mask: torch.Tensor, group_size: int) -> DynamicCache | None:
    """The KV cache of each prompt but its last token, computed once and repeated `group_size` times (rows
    group by group), for `generate` to continue from. None when it does not apply (a group of one, a one-token
    prompt, a model that is not a plain text model)."""
    config = _config(model)
    if group_size == 1 or prompts.shape[1] < 2 or not _text_only(config):
        return None
    cache = DynamicCache(config=text_config(config))
    head, head_mask = prompts[:, :-1], prompt_mask[:, :-1]
    model(input_ids=head, attention_mask=head_mask, position_ids=position_ids_from_mask(head_mask), cache=cache,
          use_cache=True, logits_to_keep=1)
    cache.batch_repeat_interleave(group_size)
    return cache


def grouped_inputs(rollout) -> dict[str, torch.Tensor]:
    """One row per group: input_ids, the 4D mask (True: may attend) and position ids; `keep`, the columns whose
    logits predict a completion token."""
    group, width = rollout.group_size, rollout.prompt_width
    rows, length = rollout.completion_mask.shape
    ids, mask = rollout.input_ids, rollout.attention_mask
    device = ids.device
    prompt_ids, prompt_mask = ids[::group, :width], mask[::group, :width].bool()
    groups = prompt_ids.shape[0]
    input_ids = torch.cat([prompt_ids, ids[:, width:].reshape(groups, group * length)], dim=1)
    total = width + group * length

    column = torch.arange(total, device=device)
    block = torch.where(column < width, -1, (column - width) // length)  # -1: the prompt
    causal = column[:, None] >= column[None, :]
    same_block = (block[:, None] == block[None, :]) & (block[:, None] >= 0)
    sees_prompt = (block[None, :] < 0) & (causal | (block[:, None] >= 0))  # completions see the whole prompt
    allowed = (sees_prompt & torch.cat([prompt_mask, torch.ones(groups, total - width, dtype=torch.bool, device=device)],
                                       dim=1)[:, None, :]) | (same_block & causal)[None]
    allowed = allowed | torch.eye(total, dtype=torch.bool, device=device)[None]  # no query sees nothing (NaN)

    prompt_positions = position_ids_from_mask(prompt_mask)
    prompt_length = prompt_mask.sum(dim=1, keepdim=True)
    completion_positions = (prompt_length + torch.arange(length, device=device)).repeat(1, group)
    keep = torch.cat([torch.tensor([width - 1], device=device),
                      (width + torch.arange(group, device=device)[:, None] * length
                       + torch.arange(length - 1, device=device)).flatten()])
    return {"input_ids": input_ids, "attention_mask": allowed[:, None], "position_ids":
            torch.cat([prompt_positions, completion_positions], dim=1), "keep": keep}


def completion_log_probs(model, rollout, temperature: float, output_entropy: bool = False):
    """rollout.completion_log_probs for a grouped rollout: N × C log-probs (and entropies), rows as in the rollout."""
    inputs = grouped_inputs(rollout)
    mask = inputs["attention_mask"]
    if _config(model)._attn_implementation == "eager":  # eager adds the mask to the scores
        mask = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, torch.finfo(torch.float32).min)
    logits = model(input_ids=inputs["input_ids"], attention_mask=mask, position_ids=inputs["position_ids"],
                   logits_to_keep=inputs["keep"], use_cache=False).logits
    group, width = rollout.group_size, rollout.prompt_width
    rows, length = rollout.completion_mask.shape
    groups = rows // group
    targets = rollout.input_ids[:, width:].reshape(groups, group, length)
    # The last prompt column predicts the first token of every completion of its group.
    first, first_entropy = tempered_log_probs(logits[:, :1].expand(groups, group, -1), targets[:, :, 0], temperature,
                                              output_entropy)
    rest, rest_entropy = tempered_log_probs(logits[:, 1:].reshape(groups, group, length - 1, -1), targets[:, :, 1:],
                                            temperature, output_entropy)
    log_probs = torch.cat([first[..., None], rest], dim=2).reshape(rows, length)
    if not output_entropy:
        return log_probs, None
    return log_probs, torch.cat([first_entropy[..., None], rest_entropy], dim=2).reshape(rows, length)
