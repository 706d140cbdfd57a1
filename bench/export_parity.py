"""`tunelab export` on real models: a LoRA run on SmolLM2-135M-Instruct (or Qwen2.5-Coder-0.5B) exported to GGUF
(and to a folder), each export read back and checked as the command always does, and Gemma 3 270M re-exported.

    python scripts/fetch_real.py smollm2 gemma3-270m
    python bench/export_parity.py --steps 20 --types f16,q8_0,q4_0 --folder
    python bench/export_parity.py --gemma3
    python bench/export_parity.py --steps 20 --types f16,q8_0,q6_k,q5_k_m,q4_k_m,q4_0 --held-out 50 --in-process \
        --llama-cpp-only
    python bench/export_parity.py --model qwen2.5-coder-0.5b --steps 6 --types f16,q8_0,q6_k,q5_k_m,q4_k_m,q4_0 \
        --held-out 30 --in-process --llama-cpp-only
    python bench/export_parity.py --gemma3 --types f16,q8_0,q4_k_m

SmolLM2 (the GGUF of scripts/fetch_real.py, dequantized once into an HF folder under bench/.data, as
bench/pure_bf16.py does) trains a LoRA adapter for --steps steps with examples/real/sft_lora.yaml (demo_reverse,
its own chat template); then `tunelab export model_name_or_path=<base> adapter_name_or_path=<run>
export_format=gguf export_gguf_type=<type>` runs as a user runs it, in its own process. Printed per export: the command's check lines,
file size, the command's wall time, and a table row for docs/deploy.md (merge gap, max logit gap and tolerance,
greedy answers identical of the probes, tokens/s through transformers' GGUF loader). --gemma3: Gemma 3 270M (262k
SentencePiece vocabulary, 1 + w norms, sliding layers) read from its Q4_K_M GGUF, written f16 and checked with
tunelab's gemma3 template on the probes Gemma accepts (the suite's real-tokenizer round trip covers its vocabulary;
this covers its real weights). With the `llamacpp` extra every GGUF is also read by llama.cpp, and --held-out N
scores the first N rows of demo_reverse_test (exact match) with the trained model and every reader; --in-process
writes and checks every type from one load and merge of the model instead of one `tunelab export` per type.

--model qwen2.5-coder-0.5b: the same with examples/real/qwen2.5-coder-0.5b_sft_lora.yaml (LoRA on the real
Qwen2.5-Coder-0.5B-Instruct, loaded from its Q4_K_M GGUF, demo_reverse) cut to --steps steps, scored on
demo_reverse_test; its check reads each file with llama.cpp alone (check_parity's transformers=False: three float32
copies of its 630M parameters would not fit beside the other jobs' 6 GB). Every in-process row records the
1-minute load average beside llama.cpp's tokens/s, and each file's bytes by tensor role and type.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scripts"))
sys.path.insert(0, str(HERE))

from fetch_real import path_of  # noqa: E402
from pure_bf16 import hf_folder  # noqa: E402


def tunelab(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tunelab.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "TQDM_DISABLE": "1"})
    return done, time.perf_counter() - start


@dataclass(frozen=True)
class Recipe:
    """One model's LoRA run and held-out set: `train` are `tunelab train` arguments (before the step count)."""

    name: str
    train: tuple[str, ...]
    rows_per_step: int
    held_out: str  # the eval set the check scores
    held_out_tokens: int
    transformers: bool  # read each file with transformers too (three float32 copies of the model in memory)


RECIPES = {
    # examples/real/sft_lora.yaml (LoRA r16, learning rate 1e-3 on a cosine schedule, batches of 8: 0% -> 100% in
    # docs/real_models.md) on the dequantized folder; its own before -> after exact match on the first
    # eval_generation_samples rows of demo_reverse_test, the rows the check scores with the same answer tokens.
    # (The recipe this replaced, r8 at 2e-4 on a linear schedule with batches of 4, was at loss 0.60 at step 15
    # and 20% after 20 steps.)
    "smollm2": Recipe("smollm2", (str(HERE.parent / "examples" / "real" / "sft_lora.yaml"), "logging_steps=5"),
                      8, "demo_reverse_test", 12, True),
    "qwen2.5-coder-0.5b": Recipe("qwen2.5-coder-0.5b",
                                 (str(HERE.parent / "examples" / "real" / "qwen2.5-coder-0.5b_sft_lora.yaml"),
                                  "eval_generation=false", "logging_steps=1"), 8, "demo_reverse_test", 12, False),
}


def base_model(recipe: Recipe) -> Path:
    """SmolLM2: its GGUF dequantized once into an HF folder; Qwen: its GGUF file itself, as the recipe trains."""
    if recipe.name == "smollm2":
        return hf_folder(HERE / ".data" / "real" / "smollm2-hf")
    return path_of(recipe.name)


def train_lora(model: Path, out: Path, steps: int, recipe: Recipe = RECIPES["smollm2"]) -> Path:
    if (out / "adapter_config.json").is_file():
        return out
    done, seconds = tunelab(
        "train", *recipe.train, f"model_name_or_path={model}", f"max_samples={steps * recipe.rows_per_step}",
        f"max_steps={steps}", "disable_tqdm=true", "plot_loss=false", "overwrite_output_dir=true", f"output_dir={out}",
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    print(f"trained the LoRA adapter in {seconds:.0f} s: {out}", flush=True)
    for line in (done.stdout + done.stderr).splitlines():  # its losses and held-out exact match before -> after
        if "loss" in line or "exact match" in line:
            print("  " + line.strip(), flush=True)
    return out


def export(base: Path, run: Path, out: Path, *options: str) -> dict:
    done, seconds = tunelab("export", f"model_name_or_path={base}", f"adapter_name_or_path={run}", f"export_dir={out}",
                            "overwrite_output_dir=true", *options)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    print("\n".join(lines), flush=True)
    if done.returncode != 0:
        print(done.stderr.splitlines()[-1] if done.stderr else "", flush=True)
        if not (out / "export_report.json").is_file():
            raise SystemExit(done.stderr[-3000:])
    return _row(json.loads((out / "export_report.json").read_text()), seconds, " ".join(options))


def _row(report: dict, seconds: float, options: str) -> dict:
    by_name = {r["reader"]: r for r in report["readers"]}
    llama = by_name.get("llama.cpp (xllamacpp server)")  # llama.cpp's reading, where xllamacpp is installed
    reader = next(iter(by_name.values()))  # transformers', unless the check read with llama.cpp alone
    held_out = report.get("held_out") or {}
    return {
        "options": options, "seconds": seconds, "ok": report["ok"], "bytes": report["file_bytes"],
        "merge": report["merge"]["max_logit_gap"] if report["merge"] else None, "gap": reader["max_logit_gap"],
        "abs_gap": reader["max_abs_logit_gap"], "tolerance": reader["tolerance"], "stored": reader["stored_gap"],
        "greedy": sum(p["answers_identical"] for p in reader["probes"]), "probes": len(reader["probes"]),
        "tokens_per_second": reader["tokens_per_second"], "reader": reader["reader"],
        "trained_accuracy": held_out.get("reference_accuracy"),
        "accuracy": reader.get("accuracy") if reader is not llama else None,  # transformers' reading
        "held_out_rows": held_out.get("rows"),
        "llama": None if llama is None else {
            "template": llama["template_identical"], "ids": llama["ids_identical"], "gap": llama["max_logit_gap"],
            "greedy": sum(p["answers_identical"] for p in llama["probes"]), "accuracy": llama.get("accuracy"),
            "tokens_per_second": llama["tokens_per_second"]},
        "problems": [problem for r in report["readers"] for problem in r["problems"]],
    }


def in_process(base: Path, run: Path, types: list[str], held_out: int, out: Path,
               recipe: Recipe = RECIPES["smollm2"], probes: int = 4, answer_tokens: int = 16) -> dict:
    """Every type from one load and merge of base + adapter, written and checked with the check `tunelab export`
    runs (check_parity on the four probes, the first `held_out` rows of the recipe's held-out set), without a
    process, a model load and a merge per type. Returns the rows export() returns, with the load average and the
    file's bytes by tensor role."""
    import torch  # noqa: PLC0415
    from peft import PeftModel  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    from tunelab.config.args import DataArguments  # noqa: PLC0415
    from tunelab.data.formats import prompt_and_reference  # noqa: PLC0415
    from tunelab.data.pipeline import load_canonical_splits  # noqa: PLC0415
    from tunelab.data.templates import Template  # noqa: PLC0415
    from tunelab.export.gguf_writer import source_provenance, write_gguf  # noqa: PLC0415
    from tunelab.export.parity import PROBES, check_parity  # noqa: PLC0415
    from tunelab.model import gguf as model_gguf  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(run)
    loaded = model_gguf.from_pretrained(AutoModelForCausalLM, base, dtype=torch.float32)
    model = PeftModel.from_pretrained(loaded, run).merge_and_unload().eval()
    template = Template.from_jinja("model", tokenizer.chat_template)
    rows, _ = load_canonical_splits(DataArguments(dataset=[recipe.held_out]), 0, report={})
    scored = (recipe.held_out, [prompt_and_reference(row, template) for row in rows.select(range(held_out))])
    results, trained_accuracy = {}, None
    for tensor_type in types:
        start = time.perf_counter()
        path = write_gguf(model, tokenizer, tokenizer.chat_template, None, out / f"model-{tensor_type}.gguf",
                          tensor_type, name=run.name, source=source_provenance(base))
        report = check_parity(model, tokenizer, tokenizer.chat_template, None, path, "gguf", probes=PROBES[:probes],
                              max_new_tokens=answer_tokens, raise_on_mismatch=False,
                              report_path=out / f"export_report-{tensor_type}.json",
                              held_out=scored, held_out_tokens=recipe.held_out_tokens,
                              transformers=recipe.transformers, reference_accuracy=trained_accuracy)
        if report.held_out is not None:  # the trained model answers the held-out rows once, not once per type
            trained_accuracy = report.held_out.reference_accuracy
        load = os.getloadavg()[0]  # other jobs on this machine: llama.cpp's tokens/s is read beside it
        print("\n".join(report.lines()), f"\n({time.perf_counter() - start:.0f} s, load average {load:.1f})",
              flush=True)
        results[tensor_type] = _row(json.loads((out / f"export_report-{tensor_type}.json").read_text()),
                                    time.perf_counter() - start, tensor_type)
        results[tensor_type].update(load=load, tensors=tensor_bytes(path))
    return results


def tensor_bytes(path: Path) -> dict[str, dict[str, int]]:
    """A GGUF's tensor bytes by role (the name without its blk.N. prefix) and stored type."""
    import math  # noqa: PLC0415

    import gguf  # noqa: PLC0415

    from tunelab.model.gguf import read_header  # noqa: PLC0415

    out: dict[str, dict[str, int]] = {}
    for tensor in read_header(path).tensors:
        role = tensor.name.split(".", 2)[-1] if tensor.name.startswith("blk.") else tensor.name
        ttype = gguf.GGMLQuantizationType(tensor.ggml_type)
        block, size = gguf.GGML_QUANT_SIZES[ttype]
        types = out.setdefault(role, {})
        types[ttype.name] = types.get(ttype.name, 0) + math.prod(tensor.shape) // block * size
    return out


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def gemma3(types: list[str], transformers: bool) -> None:
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    from tunelab.data.templates import builtin_source  # noqa: PLC0415
    from tunelab.export.gguf_writer import write_gguf  # noqa: PLC0415
    from tunelab.export.parity import PROBES, check_parity  # noqa: PLC0415

    path = path_of("gemma3-270m")
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, tokenizer_type="gemma3_text")
    print(f"Gemma 3 270M read from {path.name} in {time.perf_counter() - start:.0f} s", flush=True)
    template = builtin_source("gemma3")
    for tensor_type in types:
        out = HERE / ".results" / "export_parity" / f"gemma3-{tensor_type}.gguf"
        start = time.perf_counter()
        written = write_gguf(model, tokenizer, template, None, out, tensor_type)
        print(f"written in {time.perf_counter() - start:.1f} s", flush=True)
        start = time.perf_counter()
        report = check_parity(model, tokenizer, template, None, written, "gguf", probes=PROBES,
                              raise_on_mismatch=False, report_path=out.with_suffix(".json"), transformers=transformers)
        print("\n".join(report.lines()), flush=True)
        print(f"checked in {time.perf_counter() - start:.0f} s, load average {os.getloadavg()[0]:.1f} "
              f"({len(report.skipped_probes)} probe(s) the template refuses)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="LoRA training steps")
    parser.add_argument("--types", default="f16,q8_0,q4_0", help="export_gguf_type values, comma separated")
    parser.add_argument("--folder", action="store_true", help="also export a bfloat16 folder (export_format hf)")
    parser.add_argument("--model", choices=sorted(RECIPES), default="smollm2", help="the LoRA run's model")
    parser.add_argument("--gemma3", action="store_true", help="only the Gemma 3 270M re-export (--types)")
    parser.add_argument("--llama-cpp-only", action="store_true",
                        help="read each file with llama.cpp alone (no transformers reading; --in-process, --gemma3)")
    parser.add_argument("--probes", type=int, default=4, help="--in-process: probe conversations (of 4)")
    parser.add_argument("--answer-tokens", type=int, default=16, help="--in-process: greedy tokens per probe")
    parser.add_argument("--out", type=Path, default=HERE / ".results" / "export_parity")
    parser.add_argument("--held-out", type=int, default=10, help="held-out rows the check scores (0: none)")
    parser.add_argument("--in-process", action="store_true",
                        help="write and check every type from one load of the model (no `tunelab export` per type)")
    args = parser.parse_args()
    if args.gemma3:
        gemma3(args.types.split(","), not args.llama_cpp_only)
        return
    recipe = RECIPES[args.model]
    if args.llama_cpp_only:
        recipe = replace(recipe, transformers=False)
    if recipe.name != "smollm2":
        args.out = args.out / recipe.name
    base = base_model(recipe)
    run = train_lora(base, args.out / "lora-run", args.steps, recipe)
    rows = {}
    if args.in_process:
        rows = in_process(base, run, args.types.split(","), args.held_out, args.out / "in-process", recipe,
                          args.probes, args.answer_tokens)
    scored = [f"export_check_dataset={recipe.held_out}", f"export_check_samples={args.held_out}",
              f"max_new_tokens={recipe.held_out_tokens}"] if args.held_out else []
    for tensor_type in [] if args.in_process else args.types.split(","):
        rows[tensor_type] = export(base, run, args.out / f"gguf-{tensor_type}", "export_format=gguf",
                                   f"export_gguf_type={tensor_type}", *scored)
    if args.folder:
        rows["folder bf16"] = export(base, run, args.out / "hf-bf16", "export_dtype=bfloat16")
    print("\n| export | size (bytes) | `tunelab export` | merge gap | max logit gap (tolerance) | from the weights as "
          "stored | greedy answers identical | tokens/s | reader |\n|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        stored = "-" if r["stored"] is None else f"{r['stored']:.2g} sd"
        print(f"| {name} | {r['bytes']:,} | {r['seconds']:.0f} s | {r['merge'] or 0:.2g} sd | {r['gap']:.3g} sd "
              f"({r['abs_gap']:.3g}; {r['tolerance']:g}) | {stored} | {r['greedy']} of {r['probes']} | "
              f"{r['tokens_per_second'] or 0:.1f} | {r['reader']} |")
    f16 = rows.get("f16", {}).get("bytes")
    print("\n| type | size (bytes) | × f16 | held-out exact match: trained / transformers / llama.cpp | "
          "llama.cpp tokens/s (load average) |\n|---|---|---|---|---|")
    for name, r in rows.items():
        llama = r.get("llama")
        scores = " / ".join(_percent(v) for v in (r["trained_accuracy"], r["accuracy"], llama and llama["accuracy"]))
        speed = f"{llama['tokens_per_second']:.1f}" if llama and llama["tokens_per_second"] else "-"
        ratio = f"{r['bytes'] / f16:.3f}" if f16 else "-"
        print(f"| {name} | {r['bytes']:,} | {ratio} | {scores} | {speed} ({r.get('load', float('nan')):.1f}) |")
    for name, r in rows.items():
        if "tensors" in r and name in ("f16", "q4_k_m"):
            print(f"\n{name}: bytes by tensor role and type")
            for role, types in r["tensors"].items():
                print(f"  {role:24} " + ", ".join(f"{t} {n:,}" for t, n in types.items()))
    print("\n| type | llama.cpp: template, ids, first-token gap, greedy answers identical |\n|---|---|")
    for name, r in rows.items():
        llama = r.get("llama")
        where = (f"{'same' if llama['template'] else 'DIFFERENT'}, {'same' if llama['ids'] else 'DIFFERENT'}, "
                 f"{llama['gap']:.3g} sd, {llama['greedy']} of {r['probes']}") if llama else "-"
        print(f"| {name} | {where} |")
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "results": rows}, indent=2))


if __name__ == "__main__":
    main()
