"""GRPO against TRL's GRPOTrainer: the same model, prompts, reward, group size, prompt batch, completion length
and loss, on the CPU, with time per step split into the rollout and the update.

    bash bench/peers/setup.sh trl                       # once: TRL's venv
    python bench/grpo_vs_trl.py                         # SmolLM2-135M-Instruct, 3 seeds x 8 steps, bf16 if the CPU has it
    python bench/grpo_vs_trl.py --seeds 0 --steps 4 --fp32
    python bench/grpo_vs_trl.py --model qwen0.5b --fp32     # Qwen2.5-Coder-0.5B-Instruct (fetch_real.py first)

The task is examples/real/grpo.yaml's: add two numbers of up to two digits (the demo_add rows), with its
partial-credit reward (1 for the bare sum, 0.5 for the sum inside a sentence), LoRA r=16 on every linear
layer, kl_coef (TRL: beta) 0.04 against the adapter-free base, loss_type grpo, scale_rewards group, one
optimizer step per batch of rollouts. Each tool renders the prompts with the model's own chat template.

Each run goes through bench/peers/probe.py, which times (not the tools' own counters):
    step s       median wall time of an optimizer step after the first (rollout + update)
    rollout s    per step: generation, rewards, reference log-probs (tunelab GRPO.start_rollout + finish_rollout,
                 TRL _generate_and_score_completions)
    generate s   per step: the sampling alone (tunelab generate_rollout, TRL _generate_single_turn)
    gen tok/s    completion tokens sampled / generate seconds
    update s     step s - rollout s: the policy forward, backward and optimizer step
    reward       the mean rollout reward of every step, then its mean over the steps (and over seeds)
Prints one table per precision and writes bench/.results/grpo-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import run as peers  # noqa: E402 (bench/run.py: launch(), the venvs, the inputs)
from inputs import user_text  # noqa: E402 (bench/inputs.py: the user message every tool is given)

from tunelab.data import synthetic  # noqa: E402

ROOT = BENCH.parent
SETTINGS = {"prompts": 4, "num_generations": 4, "max_new_tokens": 24, "kl_coef": 0.04, "loss_type": "grpo",
            "scale_rewards": "group", "learning_rate": 5e-4, "lora_rank": 16, "cutoff_len": 96}
TIMED = {
    # tunelab's rollout is two calls: start_rollout generates and hands the scoring to a thread, finish_rollout
    # computes the log-probs while it scores and then collects the scores; "rollout s" is their sum.
    "tunelab": ("generate=tunelab.train.rl.rollout:generate_rollout,rollout=tunelab.train.rl.grpo:GRPO.start_rollout,"
                "rollout_end=tunelab.train.rl.grpo:GRPO.finish_rollout",
                "tunelab.train.rl.loop:RLLoop._optimizer_step"),
    "trl": ("generate=trl.trainer.grpo_trainer:GRPOTrainer._generate_single_turn,"
            "rollout=trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions", ""),
}


def write_prompts(folder: Path, rows: int) -> Path:
    """demo_add's first `rows` training rows as TRL's conversational prompts with the answer beside them."""
    path = folder / "grpo_add_chat.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for row in synthetic.generate("add", "train", rows, seed=0):
            f.write(json.dumps({"prompt": [{"role": "user", "content": user_text(row)}], "answer": row["output"]}) + "\n")
    return path


# The real models bench/inputs.py builds as plain HF folders (TRL reads no GGUF).
MODELS = {"smollm2": "SmolLM2-135M-Instruct", "qwen0.5b": "Qwen2.5-Coder-0.5B-Instruct"}


# tunelab as configured by default, and with its rollouts sampled through the unmerged adapter (what merging saves)
TUNELAB_VARIANTS = {"tunelab": {}, "tunelab-unmerged": {"rollout_merge_adapter": False}}


def tunelab_argv(model: Path, out: Path, seed: int, steps: int, bf16: bool, rows: int, extra: dict) -> list[str]:
    s = SETTINGS
    config = {
        "model_name_or_path": str(model), "template": "model", "stage": "grpo", "finetuning_type": "lora",
        "lora_rank": s["lora_rank"], "lora_target": "all", "dataset": "demo_add", "max_samples": rows,
        "cutoff_len": s["cutoff_len"], "reward_funcs": str(ROOT / "examples/real/rewards.py") + ":sum_reward",
        "num_generations": s["num_generations"], "num_iterations": 1, "kl_coef": s["kl_coef"],
        "loss_type": s["loss_type"], "scale_rewards": s["scale_rewards"], "per_device_train_batch_size": s["prompts"],
        "learning_rate": s["learning_rate"], "lr_scheduler_type": "constant", "max_steps": steps, "logging_steps": 1,
        "max_new_tokens": s["max_new_tokens"], "temperature": 1.0, "seed": seed, "bf16": bf16, "flash_attn": "sdpa",
        "output_dir": str(out / "output"), "overwrite_output_dir": True, "plot_loss": False, "report_to": "none",
        **extra,
    }
    (out / "tunelab.yaml").write_text(yaml.safe_dump(config))
    return [str(peers.TUNELAB_PYTHON), str(peers.PEERS / "probe.py"), "tunelab", "train", str(out / "tunelab.yaml")]


def trl_argv(model: Path, out: Path, seed: int, steps: int, bf16: bool, data_file: Path, device: str) -> list[str]:
    spec = {**SETTINGS, "model": str(model), "data_file": str(data_file), "output_dir": str(out / "output"),
            "seed": seed, "max_steps": steps, "bf16": bf16, "device": device}
    (out / "spec.json").write_text(json.dumps(spec, indent=2))
    python = peers.VENVS / "trl" / "bin" / "python"
    return [str(python), str(peers.PEERS / "probe.py"), str(peers.PEERS / "trl_grpo.py"), str(out / "spec.json")]


def rewards_of(tool: str, launched: peers.Launch, out: Path) -> list[float]:
    if tool not in TUNELAB_VARIANTS:
        return [e["logs"]["reward"] for e in launched.events if e["event"] == "log" and "reward" in e["logs"]]
    lines = (out / "output" / "trainer_log.jsonl").read_text().splitlines()
    return [record["reward"] for record in map(json.loads, lines) if "reward" in record]


def figures(tool: str, launched: peers.Launch, out: Path) -> dict:
    steps = [e for e in launched.events if e["event"] == "step"]
    timed = [e for e in launched.events if e["event"] == "timed"]
    durations = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])]

    def per_step(name: str, key: str = "seconds") -> float:
        values = [e[key] for e in timed if e["name"] == name]
        return sum(values[1:]) / max(1, len(values) - 1)  # the first step's rollout warms up

    step_s = statistics.median(durations) if durations else None
    rollout_s, generate_s = per_step("rollout") + per_step("rollout_end"), per_step("generate")
    tokens = per_step("rollout", "completion_tokens")
    rewards = rewards_of(tool, launched, out)
    return {"step_s": step_s, "rollout_s": rollout_s, "generate_s": generate_s,
            "update_s": step_s - rollout_s if step_s else None, "gen_tok_s": tokens / generate_s if generate_s else None,
            "completion_tokens_per_step": tokens, "rewards": rewards, "mean_reward": statistics.fmean(rewards) if rewards else None,
            "ttfs_s": steps[0]["since_launch"] if steps else None, "peak_rss_mb": launched.peak_rss_mb, "wall_s": launched.seconds}


COLUMNS = [("step_s", "step s", "{:.2f}"), ("rollout_s", "rollout s", "{:.2f}"), ("generate_s", "generate s", "{:.2f}"),
           ("update_s", "update s", "{:.2f}"), ("gen_tok_s", "gen tok/s", "{:.1f}"), ("mean_reward", "reward", "{:.3f}"),
           ("ttfs_s", "ttfs", "{:.1f}"), ("peak_rss_mb", "RSS MB", "{:,.0f}")]


def summary(runs: list[dict]) -> dict:
    out = {key: statistics.median([r[key] for r in runs if r.get(key) is not None]) for key, _, _ in COLUMNS
           if any(r.get(key) is not None for r in runs)}
    means = [r["mean_reward"] for r in runs if r.get("mean_reward") is not None]
    out["mean_reward"] = statistics.fmean(means) if means else None
    out["reward_spread"] = (min(means), max(means)) if means else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tools", default="tunelab,trl",
                        help="of tunelab, tunelab-unmerged (rollout_merge_adapter: false), trl")
    parser.add_argument("--fp32", action="store_true", help="fp32 for both (default: bf16 autocast)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: bench/gpu.sh")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--model", choices=tuple(MODELS), default="smollm2")
    args = parser.parse_args()
    model = peers.DATA / f"model-{args.model}"
    if not model.exists():
        peers.subprocess.run([str(peers.TUNELAB_PYTHON), str(BENCH / "inputs.py"), "--models", f"tiny,small,{args.model}"],
                             check=True, stdout=peers.subprocess.DEVNULL)
    root = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    rows = args.steps * SETTINGS["prompts"] * 4  # enough prompts that no run repeats one
    data_file = write_prompts(root, rows)
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count()), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONHASHSEED": "0", "BENCH_PAD_ID": str(peers.pad_id(model)),
           "USE_HUB_KERNELS": "NO"}  # (bench/run.py says why)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    bf16 = not args.fp32
    results: dict[str, list[dict]] = {}
    for seed in map(int, args.seeds.split(",")):
        for tool in args.tools.split(","):  # interleaved: each seed runs every tool before the next seed
            out = root / tool / f"seed{seed}"
            out.mkdir(parents=True)
            argv = tunelab_argv(model, out, seed, args.steps, bf16, rows, TUNELAB_VARIANTS[tool]) \
                if tool in TUNELAB_VARIANTS else trl_argv(model, out, seed, args.steps, bf16, data_file, args.device)
            timed, step = TIMED["tunelab" if tool in TUNELAB_VARIANTS else tool]
            launched = peers.launch(argv, {**env, "BENCH_TIMED": timed, "BENCH_STEP": step,
                                           "TUNELAB_CACHE": str(out / "cache")}, out, args.timeout)
            if launched.returncode != 0:
                print(f"{tool} seed {seed}: FAILED\n{launched.log_tail[-2000:]}", flush=True)
                continue
            record = {"tool": tool, "seed": seed, **figures(tool, launched, out)}
            results.setdefault(tool, []).append(record)
            print(f"{tool:<8} seed {seed}: step {record['step_s']:.2f} s, rollout {record['rollout_s']:.2f} s, "
                  f"reward {record['mean_reward']:.3f}", flush=True)
    medians = {tool: summary(runs) for tool, runs in results.items()}
    print(f"\nGRPO, {args.device}, {'bf16' if bf16 else 'fp32'}, {MODELS[args.model]}, {SETTINGS['prompts']} prompts x "
          f"{SETTINGS['num_generations']} completions of <= {SETTINGS['max_new_tokens']} tokens per step, "
          f"{args.steps} steps, seeds {args.seeds} (medians; reward: mean over steps and seeds, [min, max] of seeds)")
    print(f"{'tool':<10}" + "".join(f"{title:>12}" for _, title, _ in COLUMNS) + "   reward seeds")
    for tool, m in medians.items():
        cells = [fmt.format(m[key]) if m.get(key) is not None else "-" for key, _, fmt in COLUMNS]
        spread = "[{:.3f}, {:.3f}]".format(*m["reward_spread"]) if m.get("reward_spread") else "-"
        print(f"{tool:<10}" + "".join(f"{c:>12}" for c in cells) + f"   {spread}")
    for theirs_name in ("trl", "tunelab-unmerged"):
        if "tunelab" in medians and theirs_name in medians and medians["tunelab"].get("step_s"):
            ours, theirs = medians["tunelab"], medians[theirs_name]
            print(f"tunelab step time / {theirs_name}'s: {ours['step_s'] / theirs['step_s']:.2f} (rollout "
                  f"{ours['rollout_s'] / theirs['rollout_s']:.2f}, generate {ours['generate_s'] / theirs['generate_s']:.2f}, "
                  f"update {ours['update_s'] / theirs['update_s']:.2f})")
    peers.RESULTS.mkdir(exist_ok=True)
    path = peers.RESULTS / f"grpo-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"command": " ".join(sys.argv), "model": MODELS[args.model], "settings": SETTINGS, "steps": args.steps,
                                "bf16": bf16, "device": args.device, "load_avg_at_end": os.getloadavg(), "medians": medians,
                                "runs": results}, indent=2))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
