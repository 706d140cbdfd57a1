"""One forward + backward of a recipe's model on one packed row, sdpa against sdpa_varlen (model/varlen_sdpa.py):
the time of each and the attention kernels' share of it (torch.profiler, self CPU time).

    python bench/packed_attention.py [recipe.yaml] [--length 2048]
    # default recipe: examples/real/qwen2.5-coder-0.5b_sft_lora.yaml (LoRA r16 on every linear layer)

The row: random ids in samples of 30-90 tokens (seed 0) up to --length, the last 8 positions of each supervised,
as short chat examples pack. docs/benchmarks.md ("Packed attention") has what it printed.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from tunelab.data.collate import PackedCollator
from tunelab.model.load import load_model
from tunelab.model.tokenizer import load_tokenizer
from tunelab.preflight import load_config


def packed_row(length: int, vocab: int) -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(0)
    row: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    while True:
        n = int(torch.randint(30, 90, (1,), generator=generator))
        if len(row["input_ids"]) + n > length:
            return row
        ids = torch.randint(3, min(vocab, 20000), (n,), generator=generator).tolist()
        row["input_ids"] += ids
        row["labels"] += [-100] * (n - 8) + ids[-8:]
        row["position_ids"] += range(n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="examples/real/qwen2.5-coder-0.5b_sft_lora.yaml")
    parser.add_argument("--length", type=int, default=2048)
    options = parser.parse_args()
    config = load_config(options.recipe, {"output_dir": tempfile.mkdtemp(), "cutoff_len": options.length},
                         purpose="train")
    model = load_model(config.model, config.finetuning, config.training, load_tokenizer(config.model))
    row = packed_row(options.length, model.get_input_embeddings().num_embeddings)
    print(f"one row: {len(row['input_ids'])} tokens, {row['position_ids'].count(0)} samples")
    for attention in ("sdpa_varlen", "sdpa"):
        model.set_attn_implementation(attention)
        batch = PackedCollator.for_model(model, 0)([row])
        started = time.perf_counter()
        model(**batch).loss.backward()  # unprofiled
        seconds = time.perf_counter() - started
        model.zero_grad()
        with torch.profiler.profile() as profile:
            loss = model(**batch).loss
            loss.backward()
        model.zero_grad()
        events = profile.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        attention_time = sum(e.self_cpu_time_total for e in events
                             if "flash_attention" in e.key or "scaled_dot_product" in e.key)
        matmuls = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
        print(f"{attention}: forward + backward {seconds:.1f} s; attention kernels {attention_time / total:.1%}, "
              f"matmuls {matmuls / total:.1%} of self CPU time; loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
