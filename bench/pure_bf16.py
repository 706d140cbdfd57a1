"""Full fine-tuning in bf16: float32 master weights (the default) against pure bf16 weights (`pure_bf16: true`),
with an fp32 run as the reference, on a real pretrained model.

    python scripts/fetch_real.py smollm2
    python bench/pure_bf16.py --steps 120 --learning-rate 1e-5

SmolLM2-135M-Instruct (the GGUF of scripts/fetch_real.py, dequantized once into an HF folder under bench/.data)
is fully fine-tuned on demo_sort, whose exact answers the chat model does not give before training. Each variant
is the same `tunelab train` run (same seed, data order and schedule) with only the precision changed:
TUNELAB_CPU_BF16=1 makes bf16 auto choose bf16 on any CPU (on one without native bf16 it is slower, not
different). Printed: the training loss averaged over the last logged steps, eval loss, and held-out exact match
before -> after; each run's folder keeps its trainer_log.jsonl. docs/training.md#mixed-precision has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scripts"))

from fetch_real import path_of  # noqa: E402

VARIANTS = {  # name -> (TUNELAB_CPU_BF16, extra options)
    "fp32": ("0", []),
    "bf16 + fp32 master weights": ("1", ["pure_bf16=false"]),
    "pure bf16": ("1", ["pure_bf16=true"]),
}


def hf_folder(out: Path, name: str = "smollm2") -> Path:
    """A registry GGUF (scripts/fetch_real.py's `name`, SmolLM2 by default) dequantized into a plain HF folder
    (float32 weights, its tokenizer and chat template), for the tools that read no GGUF."""
    if (out / "config.json").is_file():
        return out
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    gguf = path_of(name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the GGUF's: the weights below are plain float32 already
        del config.quantization_config
    plain = type(loaded)(config)  # a GGUF-loaded model refuses save_pretrained (marked quantized)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def run(model: Path, out: Path, switch: str, extra: list[str], args) -> dict:
    options = [
        f"model_name_or_path={model}", "template=model", "stage=sft", "finetuning_type=full",
        f"dataset={args.dataset}", f"eval_dataset={args.dataset}_test", f"max_samples={args.steps * args.batch_size}",
        "cutoff_len=96", f"per_device_train_batch_size={args.batch_size}", f"max_steps={args.steps}",
        f"learning_rate={args.learning_rate}", "lr_scheduler_type=cosine", "warmup_steps=0.05", "logging_steps=5",
        "eval_strategy=no", "eval_generation=true", f"eval_generation_samples={args.eval_samples}",
        "max_new_tokens=24", "seed=0", "disable_tqdm=true", "plot_loss=false", "overwrite_output_dir=true",
        f"output_dir={out}", *extra,
    ]
    env = {**os.environ, "TUNELAB_CPU_BF16": switch}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tunelab.cli", "train", *options], env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    metrics = json.loads((out / "all_results.json").read_text())
    tail = losses[-args.tail:]
    return {"loss_last": sum(tail) / len(tail), "losses": losses, "seconds": time.perf_counter() - start,
            "before": metrics.get("exact_match_before"), "after": metrics.get("exact_match_after"),
            "precision": next((line.split("precision: ", 1)[1] for line in done.stderr.splitlines()
                               if "precision: " in line), "")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--dataset", default="demo_sort")
    parser.add_argument("--eval-samples", type=int, default=100)
    parser.add_argument("--tail", type=int, default=4, help="logged steps averaged for the final loss")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", type=Path, default=HERE / ".results" / "pure_bf16")
    args = parser.parse_args()
    model = hf_folder(HERE / ".data" / "real" / "smollm2-hf")
    results = {}
    for name in args.variants.split(","):
        switch, extra = VARIANTS[name]
        results[name] = run(model, args.out / name.replace(" ", "_").replace("+", "and"), switch, extra, args)
        r = results[name]
        print(f"{name:28s} loss(last {args.tail} logs) {r['loss_last']:.4f}  exact match {100 * r['before']:.1f}% -> "
              f"{100 * r['after']:.1f}%  {r['seconds']:.0f} s  [{r['precision']}]", flush=True)
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "results": results}, indent=2))


if __name__ == "__main__":
    main()
