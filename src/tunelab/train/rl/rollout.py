"""Rollouts: sampled completions of a batch of prompts, and the per-token log-probabilities of them
under the policy and under the reference.

Layout of one rollout batch (N sequences; prompts left-padded so every completion starts at column P):

    input_ids       [pad pad p0 p1 p2 | c0 c1 <eot> pad]      N × (P + C)
    attention_mask  [ 0   0  1  1  1  |  1  1   1    0 ]
    completion_mask                   [  1  1   1    0 ]      N × C   (through the end-of-turn token)
    log_probs                         [ lp lp  lp    . ]      N × C   log p(c_t | prompt, c_<t) / temperature

Position ids restart at the first real token (cumsum of the mask), as `generate` numbers them, so
a forward over the padded batch gives the same log-probs the sampler drew from (tested). The
log-probs are of the temperature-scaled distribution: the one the completions were sampled from.

A GRPO rollout samples G completions of each prompt (rows group by group). Its prompt is then computed once
per group, not G times, in sampling and in every log-prob forward (shared_prefix.py): the same numbers,
up to float rounding, for a fraction of the work when prompts are long beside their completions.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from tunelab.train.rl import shared_prefix
from tunelab.train.rl.log_probs import position_ids_from_mask, tempered_log_probs


@dataclass
class Rollout:
    input_ids: torch.Tensor  # N × (P + C)
    attention_mask: torch.Tensor  # N × (P + C)
    completion_mask: torch.Tensor  # N × C, float: 1 on completion tokens through the end-of-turn token
    prompt_width: int  # P
    completions: list[str]  # decoded, without the end-of-turn token
    finished: list[bool]  # ended at an end-of-turn token (not cut by max_new_tokens)
    group_size: int = 1  # G: rows i·G ... i·G + G - 1 share one prompt


def left_pad(sequences: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.tensor([[pad_id] * (width - len(s)) + list(s) for s in sequences], device=device)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], device=device)
    return ids, mask


@torch.no_grad()
def generate_rollout(
    model, tokenizer, prompt_ids: list[list[int]], stop_ids: list[int], max_new_tokens: int,
    temperature: float, pad_id: int, group_size: int = 1,
) -> Rollout:
    """Sample `group_size` completions of each prompt (rows group by group) with plain temperature sampling:
    no top-k / top-p, so the sampled distribution is softmax(logits / T)."""
    device = next(model.parameters()).device
    prompts, prompt_mask = left_pad(prompt_ids, pad_id, device)
    width = prompts.shape[1]
    input_ids, attention_mask = prompts.repeat_interleave(group_size, 0), prompt_mask.repeat_interleave(group_size, 0)
    # The prompt's KV cache, computed once per group and repeated for its G rows: generate then runs the last
    # prompt token and the decode steps only.
    cache = shared_prefix.prefilled_cache(model, prompts, prompt_mask, group_size)
    output = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
        do_sample=True, temperature=temperature, top_k=0, top_p=1.0, min_p=None,
        eos_token_id=stop_ids, pad_token_id=pad_id, use_cache=True, cache=cache,
    )
    completion = output[:, width:]
    is_stop = torch.isin(completion, torch.tensor(stop_ids, device=device))
    # Tokens through the first stop token count; generate pads the rest (with pad_id, maybe also a stop id).
    before_stop = (is_stop.long().cumsum(-1) - is_stop.long()) == 0
    completion_mask = before_stop.float()
    finished = is_stop.any(-1).tolist()
    texts = []
    for row, done in zip(completion.tolist(), finished):
        cut = next((i for i, t in enumerate(row) if t in stop_ids), len(row))
        texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    full_mask = torch.cat([attention_mask, completion_mask.long()], dim=1)
    return Rollout(output, full_mask, completion_mask, width, texts, finished, group_size)


def select_rows(rollout: Rollout, keep: torch.Tensor) -> Rollout:
    """The rollout's rows where `keep` (bool, N) is true; the prompt columns stay (a column that is padding
    in every kept row is harmless: the position ids start at each row's first real token)."""
    rows = keep.nonzero().squeeze(1).tolist()
    return Rollout(
        rollout.input_ids[keep], rollout.attention_mask[keep], rollout.completion_mask[keep], rollout.prompt_width,
        [rollout.completions[i] for i in rows], [rollout.finished[i] for i in rows],
        rollout.group_size if _whole_groups(keep, rollout.group_size) else 1,
    )


def _whole_groups(keep: torch.Tensor, group_size: int) -> bool:
    return bool((keep.view(-1, group_size) == keep.view(-1, group_size)[:, :1]).all())


def completion_log_probs(
    model, rollout: Rollout, temperature: float, output_hidden: bool = False, output_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of the completion tokens (N × C) and, when asked, the last hidden state at
    the positions that predict them (N × C × H, for a value head) or (output_entropy) the entropy of the
    distribution each token was drawn from (N × C, detached). Gradients flow when enabled."""
    ids, mask, width = rollout.input_ids, rollout.attention_mask, rollout.prompt_width
    if not output_hidden and shared_prefix.applies(model, rollout):
        return shared_prefix.completion_log_probs(model, rollout, temperature, output_entropy)
    length = ids.shape[1] - width
    output = model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
        logits_to_keep=length + 1, output_hidden_states=output_hidden, use_cache=False,
    )
    # position t predicts token t + 1
    log_probs, entropy = tempered_log_probs(output.logits[:, :-1], ids[:, width:], temperature, output_entropy)
    if output_entropy:
        return log_probs, entropy
    hidden = output.hidden_states[-1][:, width - 1 : -1] if output_hidden else None
    return log_probs, hidden


@contextlib.contextmanager
def reference_mode(policy, reference):
    """The model that gives reference log-probs: the frozen copy, or (LoRA, reference None) the
    policy itself with its adapter disabled, i.e. the model training started from."""
    if reference is not None:
        yield reference
        return
    with policy.disable_adapter():
        yield policy


@torch.no_grad()
def reference_log_probs(policy, reference, rollout: Rollout, temperature: float) -> torch.Tensor:
    with reference_mode(policy, reference) as model:
        return completion_log_probs(model, rollout, temperature)[0]
