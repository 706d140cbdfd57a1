"""What the output layer and loss cost in one pt forward + backward: plain HF's `labels=` loss (float32 logits over
the whole vocabulary) against tunelab's `causal_lm_loss` (log-probs in chunks), with the body alone as the floor.

    python bench/loss_head.py                      # SmolLM2 (bench/inputs.py --models smollm2), bf16, 4 x 512

Same model, same random tokens, every variant run in turn; the median of 4 timed rounds (the mean of the middle
two) after one warm-up round. The weights are bf16 here (no float32 master copy, no autocast), so this isolates
the head and loss, not a whole training step.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from statistics import median

import torch
from transformers import AutoModelForCausalLM

from tunelab.train.losses import causal_lm_loss

MODEL = Path(__file__).resolve().parent / ".data" / "peers" / "model-smollm2"


def timed_step(model, ids: torch.Tensor, variant: str) -> tuple[float, float, float]:
    """(forward s, backward s, loss) of one step of `variant`."""
    start = time.perf_counter()
    if variant == "hf":
        loss = model(input_ids=ids, labels=ids).loss
    elif variant == "tunelab":
        loss = causal_lm_loss(model(input_ids=ids).logits, ids)
    else:  # "body": the decoder without the output layer; a cheap stand-in loss keeps the backward whole
        loss = model.model(input_ids=ids).last_hidden_state.float().square().mean()
    forward = time.perf_counter()
    loss.backward()
    done = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return forward - start, done - forward, loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--fp32", action="store_true", help="float32 weights instead of bf16")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32 if args.fp32 else torch.bfloat16)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (args.batch_size, args.length))
    variants = ("hf", "tunelab", "body")
    for variant in variants:
        timed_step(model, ids, variant)
    rounds = {variant: [] for variant in variants}
    for _ in range(4):
        for variant in variants:
            rounds[variant].append(timed_step(model, ids, variant))
    totals = {}
    for variant, steps in rounds.items():
        forward, backward = median(s[0] for s in steps), median(s[1] for s in steps)
        totals[variant] = forward + backward
        print(f"{variant:8s} forward {forward:.3f} s  backward {backward:.3f} s  total {totals[variant]:.3f} s  "
              f"loss {steps[0][2]:.4f}")
    head = {variant: totals[variant] - totals["body"] for variant in ("hf", "tunelab")}
    print(f"output layer + loss: hf {head['hf']:.3f} s, tunelab {head['tunelab']:.3f} s; "
          f"the step without optimizer: tunelab {totals['hf'] / totals['tunelab']:.2f}x faster")


if __name__ == "__main__":
    main()
