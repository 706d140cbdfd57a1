"""Standalone check that the tiny LLaVA learns the shapes task from SFT within the quickstart budget.

Owns nothing the package imports: a plain torch loop over what examples/quickstart_vision.yaml does
(ChatML prompt with `<image>` expanded by the asset's own processor, loss on the answer only, greedy
decoding, exact match on the held-out demo_shapes_test split), so the asset recipe and the task can be
settled before the tunelab path exists. Prints exact match before and after training (overall and per
question kind), the blind baseline (the most common train answer per question), and the wall time.

    python scripts/check_vision_learnability.py --steps 300 --lr 2e-3                     # vision tower frozen
    python scripts/check_vision_learnability.py --steps 300 --lr 2e-3 --train-vision-tower
"""

from __future__ import annotations

import argparse
import collections
import io
import math
import random
import time
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from tunelab.data import synthetic

ASSET = Path(__file__).resolve().parent.parent / "src" / "tunelab" / "assets" / "tiny-llava"
IGNORE = -100


def prompt_text(row: dict) -> str:
    return f"<|im_start|>user\n{row['instruction']}<|im_end|>\n<|im_start|>assistant\n"


def image_of(row: dict) -> Image.Image:
    return Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB")


def train_batch(rows: list[dict], processor) -> dict:
    """Right-padded batch; labels on the answer and its <|im_end|> only."""
    texts = [prompt_text(r) + r["output"] + "<|im_end|>" for r in rows]
    batch = processor(images=[image_of(r) for r in rows], text=texts, padding=True, return_tensors="pt")
    labels = batch["input_ids"].clone()
    for i, row in enumerate(rows):
        prompt_len = len(processor(images=[image_of(row)], text=prompt_text(row))["input_ids"][0])
        labels[i, :prompt_len] = IGNORE
    labels[batch["attention_mask"] == 0] = IGNORE
    batch["labels"] = labels
    return batch


def question_kind(row: dict) -> str:
    return "count" if row["instruction"].startswith("<image>How many") else "colour"


@torch.no_grad()
def exact_match(model, processor, rows: list[dict], batch_size: int = 50) -> dict[str, float]:
    model.eval()
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "left"
    hits: dict[str, list[bool]] = collections.defaultdict(list)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        batch = processor(images=[image_of(r) for r in chunk], text=[prompt_text(r) for r in chunk],
                          padding=True, return_tensors="pt")
        out = model.generate(**batch, max_new_tokens=4, do_sample=False,
                             eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                             pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        for row, text in zip(chunk, texts):
            hits[question_kind(row)].append(text.strip() == row["output"])
            hits["all"].append(text.strip() == row["output"])
    tokenizer.padding_side = "right"
    model.train()
    return {kind: 100.0 * sum(v) / len(v) for kind, v in hits.items()}


def blind_baseline(train: list[dict], test: list[dict]) -> float:
    """Exact match of answering each question with its most common train answer, image unseen."""
    answers: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for row in train:
        answers[row["instruction"]][row["output"]] += 1
    return 100.0 * sum(answers[r["instruction"]].most_common(1)[0][0] == r["output"] for r in test) / len(test)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--train-vision-tower", action="store_true")
    parser.add_argument("--test-samples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--eval-every", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    processor = AutoProcessor.from_pretrained(ASSET)
    model = AutoModelForImageTextToText.from_pretrained(ASSET, dtype=torch.float32)
    for p in model.model.vision_tower.parameters():
        p.requires_grad_(args.train_vision_tower)
    trainable = [p for p in model.parameters() if p.requires_grad]
    print(f"threads {torch.get_num_threads()}, trainable {sum(p.numel() for p in trainable):,} params")

    train = synthetic.generate("shapes", "train", args.steps * args.batch_size)
    test = synthetic.generate("shapes", "test", args.test_samples)
    random.Random(args.seed).shuffle(train)
    print(f"blind baseline (most common train answer per question): {blind_baseline(train, test):.1f}")
    print(f"before: {exact_match(model, processor, test)}")

    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    warmup = max(1, int(0.05 * args.steps))
    def lr_factor(step: int) -> float:  # linear warmup, then cosine to 0 (the quickstart's schedule)
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (args.steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    start, cpu_start = time.time(), time.process_time()
    for step in range(args.steps):
        batch = train_batch(train[step * args.batch_size : (step + 1) * args.batch_size], processor)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d} loss {loss.item():.3f} ({time.time() - start:.0f}s)", flush=True)
        if args.eval_every and step and step % args.eval_every == 0:
            print(f"  step {step}: {exact_match(model, processor, test)}", flush=True)
    train_s = time.time() - start
    print(f"after: {exact_match(model, processor, test)}")
    cpu_s = time.process_time() - cpu_start
    print(f"train time {train_s:.0f}s wall, {cpu_s:.0f}s CPU, for {args.steps} steps of {args.batch_size}")


if __name__ == "__main__":
    main()
