"""Which GRPO variant learns the demo task fastest: the same SFT'd tiny model, prompts, rewards, seed and steps,
one run per loss_type (and DAPO's full recipe), held-out greedy exact match before and after.

    python bench/grpo_variants.py                          # builds saves/sft_base first when it is missing
    python bench/grpo_variants.py --steps 200 --out bench/.results/grpo_variants

Prints one Markdown table row per variant (docs/stages.md keeps the measured table): rollout reward on the first
and last log line, held-out greedy exact match before → after, share of zero-spread groups, seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import yaml

from tunelab.cli import main

VARIANTS = {
    "grpo": {"loss_type": "grpo"},
    "bnpo": {"loss_type": "bnpo"},
    "dr_grpo": {"loss_type": "dr_grpo", "scale_rewards": "none"},
    "dapo": {"loss_type": "dapo"},
    "dapo + clip-higher + overlong filter + dynamic sampling": {
        "loss_type": "dapo", "epsilon_high": 0.28, "mask_truncated_completions": True, "dynamic_sampling": True,
    },
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
}


def run(config: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(folder / "config.yaml")]) == 0


def main_cli() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="saves/sft_base")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--eval-samples", type=int, default=100)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default="bench/.results/grpo_variants")
    args = parser.parse_args()
    out = Path(args.out)
    if not (Path(args.base) / "config.json").exists():
        sft = yaml.safe_load(Path("examples/sft_base.yaml").read_text())
        run({**sft, "output_dir": args.base, "plot_loss": False, "disable_tqdm": True}, out / "sft_base")
    common = {
        "model_name_or_path": args.base, "stage": "grpo", "finetuning_type": "full", "template": "chatml",
        "dataset": "demo_sort,demo_reverse,demo_add", "max_samples": 3000, "eval_dataset": "demo_preference_test",
        "eval_generation": True, "eval_generation_samples": args.eval_samples, "cutoff_len": 64,
        "reward_funcs": "exact_match,item_match", "num_generations": 8, "num_iterations": 2, "kl_coef": 0.04,
        "per_device_train_batch_size": args.prompts, "learning_rate": 1e-4, "lr_scheduler_type": "constant",
        "max_steps": args.steps, "logging_steps": max(args.steps // 5, 1), "max_new_tokens": 16, "seed": 0,
        "disable_tqdm": True, "plot_loss": False,
    }
    print("| variant | rollout reward (first → last log) | held-out greedy exact match | zero-spread groups (first → last) | seconds |")
    print("|---|---|---|---|---|")
    for name in args.variants.split(","):
        folder = out / "".join(c if c.isalnum() else "_" for c in name)
        start = time.perf_counter()
        run({**common, **VARIANTS[name], "output_dir": str(folder / "run")}, folder)
        seconds = time.perf_counter() - start
        metrics = json.loads((folder / "run" / "all_results.json").read_text())
        log = [json.loads(line) for line in (folder / "run" / "trainer_log.jsonl").read_text().splitlines()]
        spread = [r["zero_spread_groups"] for r in log if "zero_spread_groups" in r]
        print(f"| {name} | {metrics['reward_first']:.3f} → {metrics['reward_last']:.3f} | "
              f"{100 * metrics['exact_match_before']:.1f}% → {100 * metrics['exact_match_after']:.1f}% | "
              f"{spread[0]:.2f} → {spread[-1]:.2f} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main_cli()
