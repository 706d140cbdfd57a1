"""QAT against post-training quantization (PTQ) on a real pretrained model, scored on real held-out text.

SmolLM2-135M-Instruct (bench/.data/real/smollm2-hf) in six forms, each scored by perplexity on README texts of
installed packages that no fine-tune saw (bench/real_text.py: split by package):
  fp            the model as it came (float)
  fp-int4       fp quantized after training (PTQ) with tunelab export export_quantization=<scheme>
  control       fp + a short full fine-tune (stage pt) on the other READMEs, without qat
  control-int4  control, PTQ at the same scheme
  qat           fp + the same fine-tune (same data, order, schedule) with qat=<scheme>: fake quantisation on
  qat-int4      qat exported at the scheme it trained through
The question: does qat-int4 lose less against its float form than the control loses to PTQ? The control is there so
that the extra training is not mistaken for QAT's effect. Scores are paired (the same documents for every form):
the mean and spread over documents of per-document differences in mean token NLL. Also the exported folders' size
and greedy generation speed on this CPU. Every tunelab step is a plain command (printed); finished steps are kept.
    python bench/real_text.py
    python bench/qat_vs_ptq.py --steps 100            # figures: docs/real_models.md
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pure_bf16 import hf_folder  # (bench/ is on the path: this runs as a script)

HERE = Path(__file__).resolve().parent
MODEL = HERE / ".data" / "real" / "smollm2-hf"
TEXT = HERE / ".data" / "real" / "text"


def tunelab(*options: str) -> float:
    """Run one tunelab command; returns its wall time in seconds."""
    command = [sys.executable, "-m", "tunelab.cli", *options]
    print("$ tunelab " + " ".join(options), flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-4000:])
    return time.perf_counter() - start


def fine_tune(out: Path, args, extra: list[str]) -> float:
    return tunelab(
        "train", f"model_name_or_path={MODEL}", "stage=pt", "finetuning_type=full", f"dataset_dir={TEXT}",
        "dataset=train", f"cutoff_len={args.cutoff_len}", f"per_device_train_batch_size={args.batch_size}",
        f"max_steps={args.steps}", f"learning_rate={args.learning_rate}", "lr_scheduler_type=cosine",
        "warmup_steps=0.1", "logging_steps=10", "eval_strategy=no", "seed=0", "disable_tqdm=true",
        "overwrite_output_dir=true", f"output_dir={out}", *extra,
    )


def export_quantized(source: Path, out: Path, args) -> float:
    return tunelab("export", f"model_name_or_path={source}", f"export_quantization={args.scheme}",
                   f"qat_group_size={args.group_size}", f"export_dir={out}", "template=model",
                   # the read-back check runs a float32 copy beside the export: minutes on 2 shared cores, and the
                   # scores below read every export back anyway
                   "export_parity=false")


def held_out_documents(tokenizer, max_tokens: int) -> list[list[int]]:
    """The first max_tokens tokens of each held-out README (BOS first when the tokenizer has one)."""
    docs = []
    for line in (TEXT / "heldout.jsonl").read_text().splitlines():
        ids = tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        docs.append((bos + ids)[:max_tokens])
    return docs


def score(folder: Path, max_tokens: int) -> dict:
    """Mean NLL per document (nats per token) on the held-out texts, plus greedy generation speed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    nll = []
    with torch.inference_mode():
        for ids in held_out_documents(tokenizer, max_tokens):
            x = torch.tensor([ids])
            nll.append(model(input_ids=x, labels=x).loss.item())
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a short story about a lighthouse."}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)
        model.generate(**prompt, max_new_tokens=8, do_sample=False)  # warm-up
        start = time.perf_counter()
        out = model.generate(**prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False)
        seconds = time.perf_counter() - start
    sample = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    return {"nll": nll, "tokens_per_s": 64 / seconds, "sample": sample, "dtype": str(next(model.parameters()).dtype)}


def cached_score(name: str, folder: Path, args) -> dict:
    """score(), kept in <out>/scores/<name>.json: a rerun scores only the forms it has not scored yet."""
    path = args.out / "scores" / f"{name}.json"
    if path.is_file() and json.loads(path.read_text())["max_tokens"] == args.max_tokens:
        return json.loads(path.read_text())
    result = {"max_tokens": args.max_tokens, **score(folder, args.max_tokens)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


def folder_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and f.suffix == ".safetensors") / 2**20


def paired(a: list[float], b: list[float]) -> str:
    """mean ± standard deviation of per-document differences b - a, and how many documents got worse."""
    d = [y - x for x, y in zip(a, b)]
    return f"{statistics.mean(d):+.4f} ± {statistics.stdev(d):.4f} (worse on {sum(v > 0 for v in d)}/{len(d)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", default="int4-weight")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--cutoff-len", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens scored per held-out document")
    parser.add_argument("--forms", default="fp,fp-int4,control,control-int4,qat,qat-int4")
    parser.add_argument("--out", type=Path, default=HERE / ".results" / "qat_vs_ptq")
    parser.add_argument("--score-only", action="store_true", help="score what is there; train and export nothing")
    args = parser.parse_args()
    if not (TEXT / "heldout.jsonl").is_file():
        raise SystemExit("no held-out text: run python bench/real_text.py first")
    hf_folder(MODEL)  # the GGUF of scripts/fetch_real.py smollm2 as a plain HF folder (the form scored), made once
    folders = {"fp": MODEL, **{name: args.out / name for name in args.forms.split(",") if name != "fp"}}
    seconds: dict[str, float] = {}
    for name, folder in folders.items():
        if args.score_only or name == "fp" or (folder / "config.json").is_file():
            continue
        if name in ("control", "qat"):
            extra = [f"qat={args.scheme}", f"qat_group_size={args.group_size}"] if name == "qat" else []
            seconds[name] = fine_tune(folder, args, extra)
        else:
            seconds[name] = export_quantized(folders[name.removesuffix("-int4")], folder, args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    scores = {name: cached_score(name, folder, args) for name, folder in folders.items()
              if (folder / "config.json").is_file()}
    ppl = {name: math.exp(statistics.mean(s["nll"])) for name, s in scores.items()}
    print(f"\n{args.scheme}, group {args.group_size}; {len(next(iter(scores.values()))['nll'])} held-out documents, "
          f"first {args.max_tokens} tokens each; perplexity = exp(mean over documents of mean token NLL)\n")
    print("| form | perplexity | NLL vs fp (paired, nats/token) | folder MiB | tokens/s (greedy, 64) | wall s |")
    print("|---|---|---|---|---|---|")
    for name, s in scores.items():
        against = "—" if name == "fp" else paired(scores["fp"]["nll"], s["nll"])
        took = f"{seconds[name]:.0f}" if name in seconds else ""
        print(f"| {name} | {ppl[name]:.3f} | {against} | {folder_mib(folders[name]):.0f} | {s['tokens_per_s']:.1f} | {took} |")
    print("\nWhat quantization costs each model (paired, its int4 form minus its float form):")
    for base in ("fp", "control", "qat"):
        if base in scores and f"{base}-int4" in scores:
            print(f"  {base:8s} {paired(scores[base]['nll'], scores[base + '-int4']['nll'])}")
    if "control-int4" in scores and "qat-int4" in scores:
        print(f"  qat-int4 against control-int4: {paired(scores['control-int4']['nll'], scores['qat-int4']['nll'])}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "seconds": seconds, "perplexity": ppl, "scores": scores},
                                                       indent=2))
    for name, s in scores.items():
        print(f"\n[{name}] {s['sample'][:200]!r}")


if __name__ == "__main__":
    main()
