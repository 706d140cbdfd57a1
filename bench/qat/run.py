"""QAT against post-training quantization on the embedded tiny Llama (docs/quantization.md).

    python bench/qat/run.py                          # every step below, into bench/.results/qat/
    python bench/qat/run.py --out /tmp/qat --eval-rows 500
    python bench/qat/run.py --out /tmp/qat --task reverse --seeds 1,2,3 --qat int4-weight --schemes int4-weight \\
        --group-size 128 --no-speed

For each --seeds seed (every training run of it uses that seed):

1. full-precision SFT: examples/quickstart.yaml (full fine-tuning) on --task for --train-steps steps of 32 rows:
   sort 3-5 digits (the quickstart's own data), reverse 3-5 letters or add two numbers below 100
   (bench/qat/dataset_info.json's training sets)
2. a short QAT fine-tune of that model: examples/qat.yaml from it (model_name_or_path=<1>), `qat: <scheme>`
   for each --qat scheme, --extra-steps steps at a tenth of the learning rate; and the same steps without
   qat (the control: what the extra training alone does)
3. `tunelab export ... export_quantization=<scheme>` of the models of 1 and 2, for each --schemes scheme:
   PTQ for the full-precision ones, the scheme it trained with for the QAT ones
4. `tunelab eval` of every model on the --eval-rows held-out questions of the task in bench/qat/dataset_info.json
   (greedy, exact match: the answer is checkable; the test split, which no training row can be)
5. unless --no-speed: the size of each folder's weights and its CPU generation speed: greedy generation of 16
   new tokens for 64 held-out prompts in one batch, the best of 3 (transformers' generate; the quantized layers
   run torchao's dequantize-then-matmul on CPU, so they are not expected to be faster here)

Every step is a tunelab command run as a subprocess (the commands are printed) with the worktree's tunelab;
a step whose output is complete from an earlier run is skipped (rerun after an interruption to finish).
The quickstart's setting (sort, 300 steps, seed 42) writes straight into --out; any other into
<out>/<task>-<steps>-seed<seed>/. Results: a markdown table per seed on stdout, <folder>/results[-g<N>].json,
and with several seeds the mean of each row with its spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BENCH_DATA = "dataset_dir=" + str(HERE.relative_to(ROOT))  # bench/qat/dataset_info.json adds to the built-in sets
# The quickstart's template and max_new_tokens, bench/qat's larger held-out sets, batches of 64.
EVAL = ["examples/quickstart.yaml", BENCH_DATA, "per_device_eval_batch_size=64"]
TRAIN_SETS = {"sort": "demo_sort", "reverse": "reverse_train", "add": "add_train"}
EVAL_ROWS = {"sort": (500, 1000), "reverse": (500, 1000), "add": (500, 900)}  # add has 999 test questions in all


def tunelab(*args: str, done: Path) -> None:
    """Run one tunelab command, unless `done` (the file it writes last) is there from an earlier run."""
    print("$ tunelab " + " ".join(args) + ("   (done before: skipped)" if done.exists() else ""), flush=True)
    if done.exists():
        return
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run([sys.executable, "-m", "tunelab.cli", *args], check=True, cwd=ROOT, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def exact_match(model: Path, out: Path, eval_set: str) -> float:
    results = out / f"eval-{model.name}" / "predict_results.json"
    tunelab("eval", *EVAL, f"model_name_or_path={model}", f"output_dir={results.parent}", f"eval_dataset={eval_set}",
            done=results)
    return json.loads(results.read_text())["predict_exact_match"]


def right_answers(model: Path, out: Path) -> list[bool]:
    """Per held-out question (in order), whether the model's evaluated answer was exactly right."""
    rows = (out / f"eval-{model.name}" / "predictions.jsonl").open(encoding="utf-8")
    return [row["prediction"].strip() == row["reference"].strip() for row in map(json.loads, rows)]


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


def run_seed(args: argparse.Namespace, seed: int) -> dict[str, dict]:
    """Steps 1-5 for one seed; returns model name -> its figures."""
    quickstart = (args.task, args.train_steps, seed) == ("sort", 300, 42)
    out = Path(args.out) if quickstart else Path(args.out) / f"{args.task}-{args.train_steps}-seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    schemes = args.schemes.split(",")
    group = [f"qat_group_size={args.group_size}"]
    suffix = "" if args.group_size == 32 else f"-g{args.group_size}"
    data = [] if quickstart else [BENCH_DATA, f"dataset={TRAIN_SETS[args.task]}", f"eval_dataset=demo_{args.task}_test",
                                  f"seed={seed}"]

    fp = out / "fp"
    tunelab("train", "examples/quickstart.yaml", *data, f"max_samples={32 * args.train_steps}",
            *([] if quickstart else ["eval_generation=false"]), f"output_dir={fp}", done=fp / "all_results.json")
    again = [*data, f"model_name_or_path={fp}", f"max_samples={32 * args.extra_steps}", "learning_rate=2.0e-4",
             "eval_generation=false"]
    control = out / "fp-more"
    tunelab("train", "examples/quickstart.yaml", *again, f"output_dir={control}", done=control / "all_results.json")
    models = {"full-precision SFT": fp, f"+ {args.extra_steps} steps": control}
    sources = {}  # quantized export -> the full-precision model it was converted from
    for name, source in (("full-precision SFT", fp), (f"+ {args.extra_steps} steps", control)):
        for scheme in schemes:
            export = out / f"{source.name}-export-{scheme}{suffix}"
            tunelab("export", f"model_name_or_path={source}", f"export_dir={export}", f"export_quantization={scheme}",
                    *group, done=export / "generation_config.json")
            models[f"{name}, PTQ {scheme}"] = export
            sources[export] = source
    for scheme in args.qat.split(","):
        trained = out / f"qat-{scheme}{suffix}"
        tunelab("train", "examples/qat.yaml", *again, f"qat={scheme}", *group, f"output_dir={trained}",
                done=trained / "all_results.json")
        models[f"+ {args.extra_steps} steps QAT {scheme} (full-precision weights)"] = trained
        export = out / f"{trained.name}-export-{scheme}"
        tunelab("export", f"model_name_or_path={trained}", f"export_dir={export}", f"export_quantization={scheme}",
                done=export / "generation_config.json")
        models[f"+ {args.extra_steps} steps QAT {scheme}, exported {scheme}"] = export
        sources[export] = trained

    eval_set = f"{args.task}_test_{args.eval_rows}"
    results = {}
    for name, model in models.items():
        results[name] = {"exact_match": exact_match(model, out, eval_set), "weights_bytes": weights_bytes(model),
                         "folder": str(model)}
        print(f"  {name}: {results[name]['exact_match']:.1%}", flush=True)
    for name, model in models.items():
        if model in sources:  # paired: the same questions before and after quantization
            before, after = right_answers(sources[model], out), right_answers(model, out)
            results[name]["quantization_lost"] = sum(b and not a for b, a in zip(before, after))
            results[name]["quantization_gained"] = sum(a and not b for b, a in zip(before, after))
    for scheme in args.qat.split(","):  # the comparison QAT exists for: its export against the control's PTQ
        qat_name = f"+ {args.extra_steps} steps QAT {scheme}, exported {scheme}"
        ptq_name = f"+ {args.extra_steps} steps, PTQ {scheme}"
        if ptq_name in models:
            before, after = right_answers(models[ptq_name], out), right_answers(models[qat_name], out)
            results[qat_name]["against_control_ptq"] = [sum(b and not a for b, a in zip(before, after)),
                                                        sum(a and not b for b, a in zip(before, after))]
    if args.speed:
        for name, model in models.items():
            results[name]["new_tokens_per_s"] = generation_speed(model, out / "eval-fp" / "predictions.jsonl")
    (out / f"results{suffix}.json").write_text(json.dumps(results, indent=2) + "\n")

    print(f"\n{args.task}, {args.train_steps} steps, seed {seed}, group size {args.group_size}")
    print(f"| model | held-out exact match ({args.eval_rows}) | answers quantization made wrong / right | weights | "
          "CPU generation |\n|---|---|---|---|---|")
    for name, r in results.items():
        speed = f"{r['new_tokens_per_s']:.0f} tok/s" if "new_tokens_per_s" in r else "—"
        flips = f"{r['quantization_lost']} / {r['quantization_gained']}" if "quantization_lost" in r else "—"
        print(f"| {name} | {r['exact_match']:.1%} | {flips} | {r['weights_bytes'] / 2**20:.2f} MiB | {speed} |")
    for name, r in results.items():
        if "against_control_ptq" in r:
            print("{}, against the control's PTQ: {} answers right → wrong, {} wrong → right".format(
                name.lstrip("+ "), *r["against_control_ptq"]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=tuple(TRAIN_SETS), default="sort", help="the checkable task trained on")
    parser.add_argument("--train-steps", type=int, default=300, help="steps of the full-precision SFT run (1)")
    parser.add_argument("--seeds", default="42", help="seeds of the training runs (comma-separated)")
    parser.add_argument("--qat", default="int8-int4", help="schemes to fine-tune with qat (comma-separated)")
    parser.add_argument("--schemes", default="int8-int4,int4-weight", help="schemes to export with")
    parser.add_argument("--extra-steps", type=int, default=50, help="steps of the QAT (and control) fine-tune")
    parser.add_argument("--group-size", type=int, default=32, help="qat_group_size of the QAT runs and exports")
    parser.add_argument("--eval-rows", type=int, choices=(500, 900, 1000), default=1000)
    parser.add_argument("--no-speed", dest="speed", action="store_false", help="skip the CPU generation timing")
    parser.add_argument("--out", default=str(ROOT / "bench" / ".results" / "qat"))
    args = parser.parse_args()
    if args.eval_rows not in EVAL_ROWS[args.task]:
        parser.error(f"--eval-rows for {args.task}: one of {', '.join(map(str, EVAL_ROWS[args.task]))}")

    by_seed = [run_seed(args, int(seed)) for seed in args.seeds.split(",")]
    if len(by_seed) > 1:
        print(f"\n{args.task}, {args.train_steps} steps, seeds {args.seeds}, group size {args.group_size}: mean "
              "(each seed)")
        print("| model | held-out exact match | answers quantization made wrong / right, all seeds |\n|---|---|---|")
        for name in by_seed[0]:
            scores = [results[name]["exact_match"] for results in by_seed]
            flips = "—"
            if "quantization_lost" in by_seed[0][name]:
                flips = " / ".join(str(sum(results[name][key] for results in by_seed))
                                   for key in ("quantization_lost", "quantization_gained"))
            print(f"| {name} | {statistics.mean(scores):.1%} ({', '.join(f'{s:.1%}' for s in scores)}) | {flips} |")
        for name, r in by_seed[0].items():
            if "against_control_ptq" in r:
                lost, gained = (sum(results[name]["against_control_ptq"][i] for results in by_seed) for i in (0, 1))
                print(f"{name.lstrip('+ ')}, against the control's PTQ, all seeds: {lost} answers right → wrong, "
                      f"{gained} wrong → right")


if __name__ == "__main__":
    main()
