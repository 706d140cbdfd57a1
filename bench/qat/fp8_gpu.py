"""FP8 training through torchao's float8 path against bf16, on one GPU (issue 16; docs/quantization.md).

    python bench/qat/fp8_gpu.py                       # on a GPU with FP8 tensor cores (H100 / H200 class)
    python bench/qat/fp8_gpu.py --emulate --steps 4 --hidden 128 --layers 2 --seq 64 --batch 2 --no-compile
                                                      # CPU check of the script itself (float8 emulated: slow)

Two runs of the same randomly initialised Llama (--hidden, --layers; the embedded tiny model's tokenizer) on the
same token blocks of tunelab's built-in `corpus` (stage pt's data), same seed and steps, AdamW, fp32 master weights
under bf16 autocast: once plain, once with every linear layer but the output head swapped for torchao's
Float8Linear (`convert_to_float8_training`, --recipe tensorwise | rowwise). Prints and writes (--out):

    loss          mean training loss of the last fifth of the steps; the issue asks for FP8 within 1% of bf16
    tokens/s      training tokens per second over the steps after the first fifth (compilation excluded)

The script does not go through `tunelab train`: tunelab offers no FP8 training option (docs/quantization.md);
this measures whether one would be worth adding on the lent GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from torch import nn


def token_blocks(seq: int, count: int) -> tuple[torch.Tensor, int]:
    """`count` rows of `seq` + 1 token ids (the built-in pretraining corpus, tokenized and concatenated), and the
    tokenizer's vocabulary size."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    from tunelab.assets import TINY_MODEL_DIR  # noqa: PLC0415
    from tunelab.data.corpus import generate  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    documents, ids = 1000, []
    while len(ids) < count * (seq + 1):  # double the corpus until it is long enough
        documents *= 2
        texts = [row["text"] for row in generate("corpus", "train", documents)]
        rows = tokenizer(texts, add_special_tokens=False)["input_ids"]
        ids = [token for row in rows for token in [*row, tokenizer.eos_token_id]]
    return torch.tensor(ids[: count * (seq + 1)]).view(count, seq + 1), len(tokenizer)


def build_model(args: argparse.Namespace, vocab: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                         num_key_value_heads=max(1, args.hidden // 64), max_position_embeddings=args.seq,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def to_float8(model: nn.Module, recipe: str, emulate: bool) -> int:
    """Swap the linear layers but the head for Float8Linear; returns how many (dimensions must be multiples of 16)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: PLC0415

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    head = model.get_output_embeddings()
    chosen = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not head
              and m.in_features % 16 == 0 and m.out_features % 16 == 0]
    ids = {id(m) for m in chosen}
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, _fqn: id(m) in ids)
    return len(chosen)


def train(args: argparse.Namespace, blocks: torch.Tensor, vocab: int, fp8: bool) -> dict:
    device = torch.device("cpu" if args.emulate else "cuda")
    model = build_model(args, vocab).to(device)
    converted = to_float8(model, args.recipe, args.emulate) if fp8 else 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=device.type == "cuda")
    step_fn = model
    if args.compile:
        step_fn = torch.compile(model)
    losses, times, tokens = [], [], args.batch * args.seq
    for step in range(args.steps):
        rows = blocks[(step * args.batch) % len(blocks):][: args.batch].to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = step_fn(input_ids=rows[:, :-1], labels=rows[:, 1:].contiguous(), use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    tail = max(1, args.steps // 5)
    steady = times[tail:] or times
    return {"float8_layers": converted, "loss": sum(losses[-tail:]) / tail,
            "tokens_per_s": tokens * len(steady) / sum(steady), "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recipe", choices=("tensorwise", "rowwise"), default="tensorwise")
    parser.add_argument("--emulate", action="store_true", help="float8 emulated on the CPU: checks the script only")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--out", default="fp8_results.json")
    args = parser.parse_args()
    if not args.emulate and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU with FP8 tensor cores, or pass --emulate to check the script on CPU")

    blocks, vocab = token_blocks(args.seq, args.steps * args.batch)
    bf16 = train(args, blocks, vocab, fp8=False)
    fp8 = train(args, blocks, vocab, fp8=True)
    summary = {"device": torch.cuda.get_device_name() if not args.emulate else "cpu (emulated)",
               "torch": torch.__version__, "settings": vars(args), "bf16": bf16, "float8": fp8,
               "loss_difference": (fp8["loss"] - bf16["loss"]) / bf16["loss"],
               "throughput_ratio": fp8["tokens_per_s"] / bf16["tokens_per_s"]}
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{summary['device']}: {fp8['float8_layers']} linear layers in float8 ({args.recipe}), {args.steps} steps of "
          f"{args.batch}x{args.seq} tokens")
    print(f"loss (last fifth)  bf16 {bf16['loss']:.4f}  float8 {fp8['loss']:.4f}  "
          f"difference {summary['loss_difference']:+.2%} (asked: within 1%)")
    print(f"tokens/s           bf16 {bf16['tokens_per_s']:.0f}  float8 {fp8['tokens_per_s']:.0f}  "
          f"ratio {summary['throughput_ratio']:.2f}x")


if __name__ == "__main__":
    main()
