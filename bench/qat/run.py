"""QAT against post-training quantization on the embedded tiny Llama (docs/quantization.md).

    python bench/qat/run.py                          # every step below, into bench/.results/qat/
    python bench/qat/run.py --out /tmp/qat --eval-rows 500

1. full-precision SFT: examples/quickstart.yaml (sort 3-5 digits, 300 steps of full fine-tuning)
2. a short QAT fine-tune of that model: examples/qat.yaml from it (model_name_or_path=<1>), `qat: <scheme>`
   for each --qat scheme, --extra-steps steps at a tenth of the learning rate; and the same steps without
   qat (the control: what the extra training alone does)
3. `tunelab export ... export_quantization=<scheme>` of the models of 1 and 2, for each --schemes scheme:
   PTQ for the full-precision ones, the scheme it trained with for the QAT ones
4. `tunelab eval` of every model on the --eval-rows held-out sort questions of bench/qat/dataset_info.json
   (greedy, exact match: the answer is checkable)
5. the size of each folder's weights and its CPU generation speed: greedy generation of 16 new tokens for
   64 held-out prompts in one batch, the best of 3 (transformers' generate; the quantized layers run
   torchao's dequantize-then-matmul on CPU, so they are not expected to be faster here)

Every step is a tunelab command run as a subprocess (the commands are printed) with the worktree's tunelab;
a step whose output is complete from an earlier run is skipped (rerun after an interruption to finish).
Results: a markdown table on stdout and <out>/results.json (results-g<N>.json for another --group-size).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# The quickstart's template and max_new_tokens, bench/qat's larger held-out set (its dataset_info.json adds to the
# built-in one), batches of 64.
EVAL = ["examples/quickstart.yaml", "dataset_dir=" + str(HERE.relative_to(ROOT)), "per_device_eval_batch_size=64"]


def tunelab(*args: str, done: Path) -> None:
    """Run one tunelab command, unless `done` (the file it writes last) is there from an earlier run."""
    print("$ tunelab " + " ".join(args) + ("   (done before: skipped)" if done.exists() else ""), flush=True)
    if done.exists():
        return
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run([sys.executable, "-m", "tunelab.cli", *args], check=True, cwd=ROOT, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def exact_match(model: Path, out: Path, rows: int) -> float:
    results = out / f"eval-{model.name}" / "predict_results.json"
    tunelab("eval", *EVAL, f"model_name_or_path={model}", f"output_dir={results.parent}", f"eval_dataset=sort_test_{rows}",
            done=results)
    return json.loads(results.read_text())["predict_exact_match"]


def weights_bytes(model: Path) -> int:
    return sum(p.stat().st_size for p in model.glob("*.safetensors"))


def generation_speed(model: Path, prompts: Path) -> float:
    """New tokens per second: 64 held-out prompts in one batch, 16 greedy tokens each, best of 3."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    rows = [json.loads(line) for line in prompts.open(encoding="utf-8")][:64]
    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    lm = AutoModelForCausalLM.from_pretrained(model).eval()
    batch = tokenizer([row["prompt"] for row in rows], return_tensors="pt", padding=True, add_special_tokens=False)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(3):
            start = time.perf_counter()
            lm.generate(**batch, max_new_tokens=16, min_new_tokens=16, do_sample=False)
            best = min(best, time.perf_counter() - start)
    return 64 * 16 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qat", default="int8-int4", help="schemes to fine-tune with qat (comma-separated)")
    parser.add_argument("--schemes", default="int8-int4,int4-weight", help="schemes to export with")
    parser.add_argument("--extra-steps", type=int, default=50, help="steps of the QAT (and control) fine-tune")
    parser.add_argument("--group-size", type=int, default=32, help="qat_group_size of the QAT runs and exports")
    parser.add_argument("--eval-rows", type=int, choices=(500, 1000), default=1000)
    parser.add_argument("--out", default=str(ROOT / "bench" / ".results" / "qat"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    schemes = args.schemes.split(",")
    group = [f"qat_group_size={args.group_size}"]
    suffix = "" if args.group_size == 32 else f"-g{args.group_size}"

    fp = out / "fp"
    tunelab("train", "examples/quickstart.yaml", f"output_dir={fp}", done=fp / "all_results.json")
    again = [f"model_name_or_path={fp}", f"max_samples={32 * args.extra_steps}", "learning_rate=2.0e-4",
             "eval_generation=false"]
    control = out / "fp-more"
    tunelab("train", "examples/quickstart.yaml", *again, f"output_dir={control}", done=control / "all_results.json")
    models = {"full-precision SFT": fp, f"+ {args.extra_steps} steps": control}
    for name, source in (("full-precision SFT", fp), (f"+ {args.extra_steps} steps", control)):
        for scheme in schemes:
            export = out / f"{source.name}-export-{scheme}{suffix}"
            tunelab("export", f"model_name_or_path={source}", f"export_dir={export}", f"export_quantization={scheme}",
                    *group, done=export / "generation_config.json")
            models[f"{name}, PTQ {scheme}"] = export
    for scheme in args.qat.split(","):
        trained = out / f"qat-{scheme}{suffix}"
        tunelab("train", "examples/qat.yaml", *again, f"qat={scheme}", *group, f"output_dir={trained}",
                done=trained / "all_results.json")
        models[f"+ {args.extra_steps} steps QAT {scheme} (full-precision weights)"] = trained
        export = out / f"{trained.name}-export-{scheme}"
        tunelab("export", f"model_name_or_path={trained}", f"export_dir={export}", f"export_quantization={scheme}",
                done=export / "generation_config.json")
        models[f"+ {args.extra_steps} steps QAT {scheme}, exported {scheme}"] = export

    results = {}
    for name, model in models.items():
        results[name] = {"exact_match": exact_match(model, out, args.eval_rows), "weights_bytes": weights_bytes(model),
                         "folder": str(model)}
        print(f"  {name}: {results[name]['exact_match']:.1%}", flush=True)
    for name, model in models.items():
        results[name]["new_tokens_per_s"] = generation_speed(model, out / "eval-fp" / "predictions.jsonl")
    (out / f"results{suffix}.json").write_text(json.dumps(results, indent=2) + "\n")

    print(f"\ngroup size {args.group_size}")
    print(f"| model | held-out exact match ({args.eval_rows}) | weights | CPU generation |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['exact_match']:.1%} | {r['weights_bytes'] / 2**20:.2f} MiB | "
              f"{r['new_tokens_per_s']:.0f} tok/s |")


if __name__ == "__main__":
    main()
