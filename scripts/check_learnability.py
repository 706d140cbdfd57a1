"""Standalone check that the tiny base model learns a synthetic task from SFT within the demo budget.

Owns nothing the package imports: it mirrors what `make demo` will do (ChatML prompt, loss on the
answer only, greedy decoding, exact match on the held-out test split) with a plain torch loop, so
the asset recipe (scripts/build_assets.py) and the task difficulty can be tuned before the real
pipeline exists. Prints exact match before and after training, and the training wall time.

    python scripts/check_learnability.py --mode full --train-samples 9600 --lr 2e-3    # 300 steps
    python scripts/check_learnability.py --mode lora --train-samples 19200 --lr 2e-3   # 600 steps
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerBase

from tunelab.data import synthetic

ASSETS = Path(__file__).resolve().parent.parent / "src" / "tunelab" / "assets" / "tiny-llama"
IGNORE = -100


def user_text(row: dict) -> str:
    return row["instruction"] + ("\n" + row["input"] if row["input"] else "")


def prompt_text(row: dict) -> str:
    return f"<|im_start|>user\n{user_text(row)}<|im_end|>\n<|im_start|>assistant\n"


def encode(row: dict, tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """Input ids and labels: loss on the answer and its <|im_end|>, not on the prompt or final newline."""
    prompt = tokenizer(prompt_text(row))["input_ids"]
    answer = tokenizer(row["output"] + "<|im_end|>")["input_ids"]
    newline = tokenizer("\n")["input_ids"]
    return prompt + answer + newline, [IGNORE] * len(prompt) + answer + [IGNORE] * len(newline)


def collate(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in pairs)
    ids = torch.full((len(pairs), width), pad_id)
    labels = torch.full((len(pairs), width), IGNORE)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(pairs):
        ids[i, : len(row_ids)] = torch.tensor(row_ids)
        labels[i, : len(row_labels)] = torch.tensor(row_labels)
        mask[i, : len(row_ids)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@torch.no_grad()
def exact_match(model, tokenizer, rows: list[dict], batch_size: int = 100, show: int = 0) -> float:
    model.eval()
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokenizer.padding_side = "left"
    hits = 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        batch = tokenizer([prompt_text(r) for r in chunk], return_tensors="pt", padding=True)
        out = model.generate(
            **batch, max_new_tokens=24, do_sample=False, eos_token_id=stop, pad_token_id=tokenizer.pad_token_id
        )
        for row, gen in zip(chunk, out[:, batch["input_ids"].shape[1] :].tolist()):
            gen = gen[: gen.index(stop)] if stop in gen else gen
            answer = tokenizer.decode(gen, skip_special_tokens=True)
            hits += answer.strip() == row["output"]
            if show > 0:
                show -= 1
                print(f"  {row['input']!r} -> {answer!r} (want {row['output']!r})")
    model.train()
    return 100.0 * hits / len(rows)


def lora_wrap(model, rank: int):
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415 - only needed in this mode

    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    return get_peft_model(model, config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ASSETS)
    parser.add_argument("--task", default="sort")
    parser.add_argument("--mode", choices=["full", "lora"], default="full")
    parser.add_argument("--train-samples", type=int, default=9600)
    parser.add_argument("--test-samples", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--warmup-ratio", type=float, default=0.05)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--max-seconds", type=float, default=150.0, help="stop training after this long")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = LlamaForCausalLM.from_pretrained(args.model)
    if args.mode == "lora":
        model = lora_wrap(model, args.lora_rank)
    train_rows = synthetic.generate(args.task, "train", args.train_samples, args.seed)
    test_rows = synthetic.generate(args.task, "test", args.test_samples, args.seed)
    encoded = [encode(r, tokenizer) for r in train_rows]
    max_len = max(len(ids) for ids, _ in encoded)

    before = exact_match(model, tokenizer, test_rows)
    print(f"before: exact match {before:.1f}% on {len(test_rows)} test rows")

    steps = math.ceil(len(encoded) * args.epochs / args.batch_size)
    warmup = max(1, int(steps * args.warmup_ratio))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    # Linear warmup then cosine decay to zero, as the Trainer's "cosine" scheduler does.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup))),
    )
    order_rng = random.Random(args.seed)
    order: list[int] = []
    model.train()
    start, step, loss_sum = time.time(), 0, 0.0
    while step < steps and time.time() - start < args.max_seconds:
        if len(order) < args.batch_size:
            fresh = list(range(len(encoded)))
            order_rng.shuffle(fresh)
            order += fresh
        batch = collate([encoded[i] for i in order[: args.batch_size]], tokenizer.pad_token_id)
        del order[: args.batch_size]
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.item()
        step += 1
        if step % 50 == 0:
            print(f"step {step}/{steps} loss {loss_sum / 50:.4f} lr {schedule.get_last_lr()[0]:.2e} {time.time() - start:.0f}s")
            loss_sum = 0.0
    train_seconds = time.time() - start

    after = exact_match(model, tokenizer, test_rows, show=5)
    print(
        f"after: exact match {after:.1f}% (before {before:.1f}%, +{after - before:.1f} points) | "
        f"{args.mode} task={args.task} samples={len(encoded)} batch={args.batch_size} lr={args.lr} "
        f"steps={step}/{steps} max_len={max_len} train {train_seconds:.0f}s"
    )


if __name__ == "__main__":
    main()
