"""sdpa over each packed sample alone: the attention of a training model whose batches are packed or padding-free.

With plain sdpa, transformers isolates the samples of a packed row by a (1, 1, L, L) block-causal mask, and
torch's kernels compute every query-key pair of the L² square before the mask throws most of them away: at
cutoff_len 2,048, thirty samples a row, that is about 15 s of a 61 s Qwen2.5-0.5B step on two AVX2 cores
(docs/benchmarks.md, "Packed attention"). The collator already describes such rows by their boundaries
(`cu_seq_lens_q/k`, the varlen form flash-attention takes, data/collate.py), so this function runs sdpa once per
sample with is_causal: the same scores the mask leaves, none of the pairs it removes.

It is registered with transformers' public AttentionInterface / AttentionMaskInterface under SDPA_VARLEN, and
anything that is not such a row (generation, padded batches, a custom 4-D mask, sliding-window layers) goes to
transformers' own sdpa unchanged, with sdpa's mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from tunelab.data.collate import SDPA_VARLEN


def varlen_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (batch, heads, seq, dim) in, (batch, seq, heads, dim) out."""
    bounds = kwargs.get("cu_seq_lens_q")
    per_sample = (
        bounds is not None and query.shape[0] == 1 and query.shape[2] == key.shape[2]
        and kwargs.get("sliding_window") is None and kwargs.get("s_aux") is None
        and getattr(module, "is_causal", True) and kwargs.get("is_causal", True) is not False
    )
    if bounds is not None and not per_sample:  # the batch's all-ones mask would let its samples attend to each other
        raise ValueError(f"{SDPA_VARLEN}: cannot isolate the samples of this packed row in {type(module).__name__} "
                         "(a sliding window, attention sinks or non-causal attention); set flash_attn: sdpa")
    if not per_sample:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, **kwargs)
    gqa = query.shape[1] != key.shape[1]
    sizes = bounds.diff().tolist()
    # split, not slicing: its backward joins the pieces' gradients in one copy, where each slice's would fill a
    # zeroed tensor of the whole row.
    pieces = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
        for q, k, v in zip(query.split(sizes, dim=2), key.split(sizes, dim=2), value.split(sizes, dim=2))
    ]
    joined = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)  # one sample: no copy to keep
    return joined.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make SDPA_VARLEN a name transformers' models accept (idempotent); its masks are sdpa's."""
    AttentionInterface.register(SDPA_VARLEN, varlen_sdpa_forward)
    AttentionMaskInterface.register(SDPA_VARLEN, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def use_for_training(model: torch.nn.Module) -> bool:
    """Switch a model that runs transformers' own sdpa on text to SDPA_VARLEN; True when it did. Every model of a
    training run switches, frozen ones included: a reference or a teacher takes the trained model's batches, whose
    all-ones mask plain sdpa would read as one sequence. Vision-language models keep sdpa (their towers share the
    implementation and take other inputs), as does code from the Hub."""
    config = getattr(model, "config", None)
    if (config is None or getattr(config, "_attn_implementation", None) != "sdpa"
            or not type(model).__module__.startswith("transformers.")
            or config.get_text_config() is not config or not _full_attention_only(config)):
        return False
    register()
    model.set_attn_implementation(SDPA_VARLEN)
    return True


def _full_attention_only(config) -> bool:
    """No layer attends through a sliding window or in chunks (those layers would need sdpa's mask)."""
    if getattr(config, "attention_chunk_size", None):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return all(kind == "full_attention" for kind in layer_types)
    return not getattr(config, "sliding_window", None) or getattr(config, "use_sliding_window", True) is False
