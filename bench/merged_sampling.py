"""What merged LoRA sampling costs and saves in one process: the time to build the merged copies, and `generate`
through them against through the unmerged adapter (train/rl/merged_sampling.py).

    python bench/merged_sampling.py                 # SmolLM2-135M-Instruct, LoRA r=16 on every linear layer, bf16
    python bench/merged_sampling.py --fp32 --rows 16 --new-tokens 24

The adapter's B matrices are drawn away from zero (a fresh adapter's ΔW is 0). Each repeat times merging, sampling
merged, restoring, then sampling unmerged with the same seed. Needs bench/inputs.py's model-smollm2.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from tunelab.train.rl.merged_sampling import merged_lora

MODEL = Path(__file__).resolve().parent / ".data" / "peers" / "model-smollm2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fp32", action="store_true", help="fp32 weights (default: bf16 weights and autocast)")
    parser.add_argument("--rows", type=int, default=16, help="sequences sampled at once (GRPO: prompts x group)")
    parser.add_argument("--prompt-tokens", type=int, default=60)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dtype = torch.float32 if args.fp32 else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=dtype)
    policy = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear"))
    torch.manual_seed(0)
    for name, parameter in policy.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_(0, 0.01)
    policy.eval()
    ids = torch.randint(100, 40_000, (args.rows, args.prompt_tokens))

    def sample() -> float:
        torch.manual_seed(0)
        start = time.perf_counter()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.fp32):
            policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                            min_new_tokens=args.new_tokens, do_sample=True, top_k=0, pad_token_id=0)
        return time.perf_counter() - start

    print(f"{'precision':<10}{'merge s':>10}{'merged gen s':>14}{'restore s':>11}{'unmerged gen s':>16}{'saved':>8}")
    for _ in range(args.repeats):
        start = time.perf_counter()
        with merged_lora(policy):
            merged_at = time.perf_counter()
            merged = sample()
            restore_at = time.perf_counter()
        restored = time.perf_counter() - restore_at
        unmerged = sample()
        merge = merged_at - start
        print(f"{'fp32' if args.fp32 else 'bf16':<10}{merge:>10.3f}{merged:>14.3f}{restored:>11.3f}{unmerged:>16.3f}"
              f"{1 - (merge + merged + restored) / unmerged:>8.0%}")


if __name__ == "__main__":
    main()
