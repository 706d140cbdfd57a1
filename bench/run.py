"""tunelab against LlamaFactory, TRL and plain HF Trainer: the same work, one machine, one command.

    bash bench/peers/setup.sh        # once: peers' venvs in bench/.venvs/
    python bench/run.py              # all workloads, all tools, 3 repeats of 30 steps
    python bench/run.py --workloads sft_lora,pt --tools tunelab,llamafactory --repeats 1 --steps 5

Every tool gets the inputs of bench/inputs.py (the embedded tiny Llama copied to bench/.data/peers,
the same mixed-length alpaca SFT set, preference pairs and corpus, ChatML) and the same settings:
optimizer steps, batch (one device, no accumulation), cutoff_len, learning rate and cosine schedule,
seed, fp32 (--bf16 for bf16), no gradient checkpointing, sdpa attention, no DataLoader workers, CPU
(`use_cpu`; CUDA_VISIBLE_DEVICES is emptied). `--device cuda` runs on the GPU instead (bench/gpu.sh),
with `--attn fa2` (flash-attention 2: varlen for padding-free and packed batches; TRL then runs with
padding_free) and `--liger` (Liger kernels: tunelab/TRL/HF use_liger_kernel, LlamaFactory enable_liger_kernel).
Each tool runs through bench/peers/probe.py, which times every optimizer step and counts the tokens
of the batches it is given (not the tool's own counters). Per run:

    sup tok/s      supervised tokens (label != -100) per second over the steady-state steps (after
                   the first fifth of the steps)
    tok/s          real (non-padding) tokens per second over the same steps
    MFU            6 · N · tok/s / the matmul peak measured at the start (matmul_peak.py), or the GPU's
                   nominal bf16 peak (--peak-tflops); N = non-embedding parameters + the output layer
                   (vocab × hidden), every position counted for every tool (so MFU ∝ tok/s)
    pre ex/s       rows of the input file / seconds in the tool's data preparation (first launch,
                   empty caches): tunelab cached_bundle, LlamaFactory get_dataset, TRL load_dataset +
                   _prepare_dataset, HF load_dataset + map
    ttfs 1st/2nd   seconds from launch to the end of the first step: empty caches, then a second
                   launch with the caches the first one left (tunelab's tokenized cache, datasets' cache)
    pack eff       real tokens / positions computed (padding included)
    peak RSS       of the tool's process tree, sampled every 0.1 s
    GPU MB         torch.cuda.max_memory_allocated at the last step (--device cuda)

Every figure is the median over --repeats, run interleaved (each tool once, then each again); the table
gives tunelab's ratio to each peer. Raw runs and medians go to bench/.results/<time>.json.

Workloads (a tool without the mode is listed as n/a):
    sft_lora         LoRA r=8 on every linear layer, no packing
    sft_lora_packed  LoRA, packing with samples isolated: tunelab packing; LlamaFactory neat_packing;
                     TRL bfd packing (padding-free rows, positions restart per sample)
    sft_full         every parameter, no packing
    pt               pretraining on cutoff_len windows of the concatenated corpus, the same work in every
                     tool (tunelab pt with packing: false and tail: drop; LlamaFactory pt, TRL wrapped
                     packing, HF's group_texts): a token attends across document boundaries
    pt_isolated      tunelab's pt with packing: true (documents packed with isolation: a token attends only
                     to its own document, positions restart) against the same peers' concatenation
    dpo_lora         DPO (sigmoid, beta 0.1), LoRA; the reference is the adapter-free base
    sft_long_lora    LoRA SFT on long documents with short answers (sft_long.json: prompts 94% of the
                     tokens), no packing; with --model real and --cutoff-len 2048 the case where the output
                     layer of a real vocabulary dominates
    sft_lora_defaults  sft_lora as a user would run it: precision, gradient checkpointing, packing,
                     attention and loader workers left to each tool's defaults (LlamaFactory:
                     checkpointing on; TRL: checkpointing on, bf16; plain HF: as matched)

    loss           the mean training loss of the last 10 steps
    Σ loss         the training loss summed over every supervised token of the run (each step's mean loss ×
                   its supervised tokens): with --sequential the same rows in every tool, so it compares
                   the training where the step means cannot (the peers also train the newline after each
                   end-of-turn token; tunelab does not, so its short steps average fewer, harder tokens)
    t→loss         seconds from launch (preprocessing and start-up included) to the first step where
                   the 10-step mean loss reaches the workload's target: the highest final mean loss
                   of the tools, so every tool reaches it
    acc            with --heldout-every N (SFT workloads): the held-out token accuracy at the last step:
                   the probe evaluates every tool's model itself every N steps on heldout_chat.json (64
                   rows of sft.json's kinds it does not hold, rendered by the model's chat template):
                   argmax == label over the answer tokens up to the end-of-turn token, teacher-forced
    t→acc          seconds from launch to the first evaluation at the workload's target accuracy (the
                   lowest final accuracy of the tools), the evaluations' own time not counted: a user's
                   time to a model that is as good as every tool's final one
    h-loss         with --heldout-every N: the held-out loss (mean cross-entropy over the same answer tokens)
                   at the last step: the same rows for every tool, so unlike the training loss it compares
                   the models rather than each tool's own batches
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import yaml

BENCH = Path(__file__).resolve().parent
PEERS = BENCH / "peers"
VENVS = BENCH / ".venvs"
DATA = BENCH / ".data" / "peers"
RESULTS = BENCH / ".results"
# tunelab (and plain HF) run from bench/.venvs/tunelab, tunelab without extras (setup.sh); else this interpreter.
TUNELAB_PYTHON = VENVS / "tunelab" / "bin" / "python" if (VENVS / "tunelab" / "bin" / "python").exists() else Path(sys.executable)
TOOLS = ("tunelab", "llamafactory", "trl", "hf")


@dataclass(frozen=True)
class Workload:
    stage: str  # sft | pt | dpo
    finetuning: str  # lora | full
    packing: bool
    learning_rate: float
    rows_file: str  # input file whose rows the preprocessing rate counts
    tools: tuple[str, ...] = TOOLS
    defaults: bool = False  # each tool's own defaults for what the matched settings pin (precision, checkpointing...)
    isolated: bool | None = None  # pt: tunelab packs documents with isolation (else concatenates, as the peers do)


WORKLOADS = {
    "sft_lora": Workload("sft", "lora", False, 2e-4, "sft.json"),
    "sft_lora_packed": Workload("sft", "lora", True, 2e-4, "sft.json", ("tunelab", "llamafactory", "trl")),
    "sft_full": Workload("sft", "full", False, 5e-5, "sft.json"),
    "pt": Workload("pt", "full", True, 1e-4, "corpus.json", isolated=False),
    "pt_isolated": Workload("pt", "full", True, 1e-4, "corpus.json", isolated=True),
    "dpo_lora": Workload("dpo", "lora", False, 1e-4, "pref.json", ("tunelab", "llamafactory", "trl")),
    "dpo_lora_mixed": Workload("dpo", "lora", False, 1e-4, "pref_mixed.json", ("tunelab", "llamafactory", "trl")),
    "sft_lora_defaults": Workload("sft", "lora", False, 2e-4, "sft.json", defaults=True),
    "sft_long_lora": Workload("sft", "lora", False, 2e-4, "sft_long.json"),
}
# Per input file: the registry name (tunelab, LlamaFactory) and the file TRL / plain HF read.
DATASETS = {"sft.json": "bench_sft", "corpus.json": "bench_corpus", "pref.json": "bench_pref",
            "pref_mixed.json": "bench_pref_mixed", "sft_long.json": "bench_sft_long"}
CHAT_FILES = {"sft.json": "sft_chat.json", "corpus.json": "corpus.json", "pref.json": "pref_chat.json",
              "pref_mixed.json": "pref_mixed_chat.json", "sft_long.json": "sft_long_chat.json"}


@dataclass
class Settings:
    steps: int
    batch_size: int
    cutoff_len: int
    seed: int
    bf16: bool
    threads: int
    model: str = "tiny"  # tiny | small | real | real8 | real24 | smollm2 (bench/inputs.py)
    device: str = "cpu"  # cpu | cuda
    attn: str = "sdpa"  # sdpa | fa2
    liger: bool = False
    second_launch: bool = True  # the second launch measures ttfs 2nd; --no-second-launch saves its time
    lora_rank: int = 8
    lora_alpha: int = 16
    tunelab_options: dict = field(default_factory=dict)  # --tunelab-set: extra keys of tunelab's config
    heldout_every: int = 0  # --heldout-every: the probe's held-out accuracy every N steps (SFT workloads)
    sequential: bool = False  # --sequential: every tool takes the rows in file order (the same batches)


# --- per-tool command lines ---------------------------------------------------------------------


def model_dir(s: Settings) -> Path:
    return DATA / ("model" if s.model == "tiny" else f"model-{s.model}")


# The chat template each tool renders with (TRL and plain HF: always the tokenizer's own chat_template). The
# proxies carry the tiny model's ChatML; SmolLM2 its own template (ChatML with a default system prompt), which is
# tunelab's `model` and LlamaFactory's `smollm2`.
_CHATML = {"tunelab": "chatml", "llamafactory": "chatml"}
TEMPLATES = {"tiny": _CHATML, "small": _CHATML, "real": _CHATML, "real8": _CHATML, "real24": _CHATML,
             "smollm2": {"tunelab": "model", "llamafactory": "smollm2"},
             "smollm2-thin": {"tunelab": "model", "llamafactory": "smollm2"}}


# With Workload.defaults these keys are left to the tool (trl_train.py / hf_train.py do the same from the spec).
DEFAULTS_UNPINNED = ("flash_attn", "bf16", "gradient_checkpointing", "packing", "dataloader_num_workers")


def tunelab_command(w: Workload, s: Settings, steps: int, out: Path) -> tuple[list[str], str]:
    config = {
        "model_name_or_path": str(model_dir(s)), "template": TEMPLATES[s.model]["tunelab"],
        "dataset": DATASETS[w.rows_file], "dataset_dir": str(DATA), "stage": w.stage, "finetuning_type": w.finetuning, "cutoff_len": s.cutoff_len,
        "packing": w.packing if w.isolated is None else w.isolated,
        "flash_attn": s.attn, "per_device_train_batch_size": s.batch_size, "gradient_accumulation_steps": 1,
        "learning_rate": w.learning_rate, "lr_scheduler_type": "cosine", "warmup_steps": 0, "weight_decay": 0.0,
        "max_steps": steps, "seed": s.seed, "bf16": s.bf16, "use_cpu": s.device == "cpu", "gradient_checkpointing": False,
        "dataloader_num_workers": 0, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
        "output_dir": str(out / "output"), "overwrite_output_dir": True, "plot_loss": False, "disable_tqdm": True,
    }
    if w.finetuning == "lora":  # tunelab rejects lora_* keys on other finetuning types
        config.update(lora_rank=s.lora_rank, lora_alpha=s.lora_alpha, lora_target="all")
    if w.stage == "dpo":
        config.update(pref_beta=0.1, pref_loss="sigmoid")
    if w.stage == "pt" and not w.isolated:  # the peers' full windows: they drop the stream's tail, as group_texts does
        config["tail"] = "drop"
    if s.liger:
        config["use_liger_kernel"] = True
    if s.sequential:
        config["train_sampling_strategy"] = "sequential"
    if w.defaults:
        for key in DEFAULTS_UNPINNED:
            config.pop(key, None)
    config.update(s.tunelab_options)
    (out / "tunelab.yaml").write_text(yaml.safe_dump(config))
    return [str(TUNELAB_PYTHON), str(PEERS / "probe.py"), "tunelab", "train", str(out / "tunelab.yaml")], \
        "tunelab.data.cache:cached_bundle"


def llamafactory_command(w: Workload, s: Settings, steps: int, out: Path) -> tuple[list[str], str]:
    config = {
        "model_name_or_path": str(model_dir(s)), "template": TEMPLATES[s.model]["llamafactory"],
        "dataset": DATASETS[w.rows_file], "dataset_dir": str(DATA / "lf"), "stage": w.stage, "do_train": True, "finetuning_type": w.finetuning,
        "cutoff_len": s.cutoff_len, "packing": w.packing, "neat_packing": w.packing and w.stage == "sft",
        "flash_attn": s.attn, "disable_gradient_checkpointing": True,
        "per_device_train_batch_size": s.batch_size, "gradient_accumulation_steps": 1,
        "learning_rate": w.learning_rate, "lr_scheduler_type": "cosine", "warmup_steps": 0, "weight_decay": 0.0,
        "max_steps": steps, "seed": s.seed, "bf16": s.bf16, "use_cpu": s.device == "cpu", "dataloader_num_workers": 0,
        "logging_steps": 1, "enable_liger_kernel": s.liger,
        "save_strategy": "no", "report_to": "none", "output_dir": str(out / "output"),
        "overwrite_output_dir": True, "plot_loss": False, "disable_tqdm": True,
    }
    if w.finetuning == "lora":
        config.update(lora_rank=s.lora_rank, lora_alpha=s.lora_alpha, lora_dropout=0.0, lora_target="all")
    if w.stage == "dpo":
        config.update(pref_beta=0.1, pref_loss="sigmoid")
    if s.sequential:
        config["disable_shuffling"] = True
    if w.defaults:
        for key in (*DEFAULTS_UNPINNED, "disable_gradient_checkpointing", "neat_packing"):
            config.pop(key, None)
    (out / "llamafactory.yaml").write_text(yaml.safe_dump(config))
    python = VENVS / "llamafactory" / "bin" / "python"
    return [str(python), str(PEERS / "probe.py"), "llamafactory-cli", "train", str(out / "llamafactory.yaml")], \
        "llamafactory.data.loader:get_dataset"


def _spec_file(w: Workload, s: Settings, steps: int, out: Path) -> Path:
    spec = {
        "stage": w.stage, "finetuning": w.finetuning, "packing": w.packing, "model": str(model_dir(s)),
        "data_dir": str(DATA), "data_file": CHAT_FILES[w.rows_file], "output_dir": str(out / "output"),
        "cutoff_len": s.cutoff_len,
        "batch_size": s.batch_size, "max_steps": steps, "learning_rate": w.learning_rate, "seed": s.seed,
        "lora_rank": s.lora_rank, "lora_alpha": s.lora_alpha, "bf16": s.bf16, "beta": 0.1, "defaults": w.defaults,
        "device": s.device, "attn": s.attn, "liger": s.liger, "sequential": s.sequential,
    }
    path = out / "spec.json"
    path.write_text(json.dumps(spec, indent=2))
    return path


def trl_command(w: Workload, s: Settings, steps: int, out: Path) -> tuple[list[str], str]:
    python = VENVS / "trl" / "bin" / "python"
    trainer = "trl.trainer.dpo_trainer:DPOTrainer" if w.stage == "dpo" else "trl.trainer.sft_trainer:SFTTrainer"
    return [str(python), str(PEERS / "probe.py"), str(PEERS / "trl_train.py"), str(_spec_file(w, s, steps, out))], \
        f"{trainer}._prepare_dataset"


def hf_command(w: Workload, s: Settings, steps: int, out: Path) -> tuple[list[str], str]:
    return [str(TUNELAB_PYTHON), str(PEERS / "probe.py"), str(PEERS / "hf_train.py"), str(_spec_file(w, s, steps, out))], ""


COMMANDS = {"tunelab": tunelab_command, "llamafactory": llamafactory_command, "trl": trl_command, "hf": hf_command}


# --- one launch ---------------------------------------------------------------------------------


@dataclass
class Launch:
    returncode: int
    seconds: float
    peak_rss_mb: float
    events: list[dict] = field(default_factory=list)
    log_tail: str = ""


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def launch(argv: list[str], env: dict, workdir: Path, timeout: float) -> Launch:
    probe_out = workdir / f"probe-{time.time_ns()}.jsonl"
    env = {**env, "BENCH_PROBE_OUT": str(probe_out)}
    log_path = workdir / "log.txt"
    start = time.time()
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
                                 start_new_session=True)  # its own process group: a timeout ends the whole tree
    proc, peak = psutil.Process(popen.pid), [0]

    def sample():
        while popen.poll() is None:
            try:
                peak[0] = max(peak[0], tree_rss(proc))
            except psutil.Error:
                pass
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        returncode = popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGKILL)
        returncode = popen.wait()
    sampler.join()
    events = [json.loads(line) for line in probe_out.read_text().splitlines()] if probe_out.exists() else []
    evaluations = [(e["time"], e["seconds"]) for e in events if e["event"] == "heldout"]
    for event in events:
        if "time" in event:  # training time: the probe's held-out evaluations that ended by then are taken off
            event["time"] -= sum(seconds for end, seconds in evaluations if end <= event["time"])
            event["since_launch"] = event["time"] - start
    tail = log_path.read_text(errors="replace")[-3000:]
    return Launch(returncode, time.time() - start, peak[0] / 2**20, events, tail)


LOSS_WINDOW = 10  # training loss figures are means over this many steps: one step's loss is one batch's


def summed_loss(events: list[dict]) -> float | None:
    """Σ over the steps of the step's mean loss × its supervised tokens: the loss summed over every trained token.
    On the same rows (--sequential) it compares tools that count the targets differently (the peers also train
    the newline after each end-of-turn token, tunelab does not: a step of 30 answer tokens then has 34, and the
    mean of such a step is 13% lower with the same summed loss). None unless every step logged its loss."""
    supervised = {e["step"]: e["supervised"] for e in events if e["event"] == "step"}
    losses = {e["step"]: e["logs"]["loss"] for e in events if e["event"] == "log" and "loss" in e["logs"]}
    if not supervised or losses.keys() != supervised.keys():
        return None
    return sum(losses[step] * supervised[step] for step in supervised)


def time_to_loss(curve: list[tuple[float, float]], target: float) -> float | None:
    """Seconds from launch to the first step where the mean loss of the last LOSS_WINDOW steps is <= target."""
    for i in range(LOSS_WINDOW, len(curve) + 1):
        if statistics.fmean(loss for _, loss in curve[i - LOSS_WINDOW : i]) <= target:
            return curve[i - 1][0]
    return None


def add_time_to_target(runs: list[dict]) -> float | None:
    """Every tool's time to the loss that all of them reach (the highest of their final mean losses)."""
    finals = [r["final_loss"] for r in runs if r.get("final_loss") is not None]
    if not finals:
        return None
    target = max(finals)
    for r in runs:
        if r.get("loss_curve"):
            r["target_loss"], r["time_to_target_s"] = target, time_to_loss(r["loss_curve"], target)
    return target


def add_time_to_accuracy(runs: list[dict]) -> float | None:
    """Every tool's training time to the held-out accuracy that all of them reach (the lowest final accuracy)."""
    finals = [r["final_accuracy"] for r in runs if r.get("final_accuracy") is not None]
    if not finals:
        return None
    target = min(finals)
    for r in runs:
        if r.get("heldout_curve"):
            r["target_accuracy"] = target
            r["time_to_accuracy_s"] = next(t for t, accuracy in r["heldout_curve"] if accuracy >= target)
    return target


def figures(cold: Launch, warm: Launch | None, rows: int, params: int, peak_gflops: float) -> dict:
    """One repeat's figures from its cold (measured) and warm (second-launch) runs."""
    steps = [e for e in cold.events if e["event"] == "step"]
    if not steps:
        raise RuntimeError("no optimizer step was recorded")
    skip = max(1, len(steps) // 5) if len(steps) > 2 else 0
    if skip:
        window, t0 = steps[skip:], steps[skip - 1]["time"]
    else:
        window, t0 = steps, next(e["time"] for e in cold.events if e["event"] == "train_begin")
    seconds = window[-1]["time"] - t0
    tokens = sum(e["tokens"] for e in window)
    supervised = sum(e["supervised"] for e in window)
    preprocess = sum(e["seconds"] for e in cold.events if e["event"] == "preprocess")
    at = {e["step"]: e["since_launch"] for e in steps}
    curve = [(at[e["step"]], e["logs"]["loss"]) for e in cold.events
             if e["event"] == "log" and "loss" in e["logs"] and e["step"] in at]
    losses = [loss for _, loss in curve]
    evaluations = [e for e in cold.events if e["event"] == "heldout"]
    heldout = [(e["since_launch"], e["accuracy"]) for e in evaluations]
    tok_s = tokens / seconds
    warm_steps = [e for e in (warm.events if warm else []) if e["event"] == "step"]
    ops = next((e for e in cold.events if e["event"] == "ops"), {})
    return {
        "sup_tok_s": supervised / seconds,
        "tok_s": tok_s,
        "mfu": 6 * params * tok_s / (peak_gflops * 1e9),
        "pre_ex_s": rows / preprocess if preprocess else None,
        "preprocess_s": preprocess,
        "ttfs_first_s": steps[0]["since_launch"],
        "ttfs_second_s": warm_steps[0]["since_launch"] if warm_steps else None,
        # where a second launch spends its time: up to the Trainer's train_begin (imports, cached data, model)
        "second_train_begin_s": next((e["since_launch"] for e in warm.events if e["event"] == "train_begin"), None)
        if warm else None,
        "pack_eff": sum(e["tokens"] for e in steps) / sum(e["positions"] for e in steps),
        "peak_rss_mb": cold.peak_rss_mb,
        "peak_gpu_mb": max((e["gpu_mb"] for e in steps if "gpu_mb" in e), default=None),
        "final_loss": statistics.fmean(losses[-LOSS_WINDOW:]) if losses else None,
        "loss_curve": curve,
        "loss_sum": summed_loss(cold.events),
        "final_accuracy": heldout[-1][1] if heldout else None,
        "final_heldout_loss": evaluations[-1]["loss"] if evaluations else None,
        "heldout_curve": heldout,
        "heldout_evaluations_s": sum(e["seconds"] for e in evaluations),
        "steps": len(steps),
        "steady_steps": len(window),
        "tokens_per_step": sum(e["tokens"] for e in steps) / len(steps),
        "wall_s": cold.seconds,
        "operators": ops.get("operators"),  # --count-ops: aten operators and host syncs of one step (the probe's)
        "syncs": ops.get("syncs"),
        "kernels": ops.get("kernels"),  # on a GPU: kernels launched, and their summed time against the step's
        "device_busy_share": ops["device_busy_ms"] / ops["step_ms"] if ops.get("device_busy_ms") else None,
        "sync_ops": ops.get("sync_ops"),
        "sync_sites": ops.get("sync_sites"),  # with BENCH_OPS_STACKS=1 in the environment
        "top_operators": ops.get("top"),
    }


def rotated(tools: list[str], repeat: int) -> list[str]:
    """The tools' order for this repeat: the list turned left by `repeat` places."""
    if not tools:
        return tools
    shift = repeat % len(tools)
    return tools[shift:] + tools[:shift]


def run_one(tool: str, name: str, s: Settings, repeat: int, root: Path, env: dict, rows: int, params: int,
            peak: float, timeout: float) -> dict:
    w = WORKLOADS[name]
    workdir = root / name / tool / f"r{repeat}"
    workdir.mkdir(parents=True, exist_ok=True)
    caches = workdir / "caches"  # empty for the first launch, reused by the second
    env = {**env, "TUNELAB_CACHE": str(caches / "tunelab"), "HF_DATASETS_CACHE": str(caches / "datasets")}
    argv, preprocess = COMMANDS[tool](w, s, s.steps, workdir)
    env["BENCH_PREPROCESS"] = preprocess
    heldout = {"BENCH_HELDOUT": str(DATA / "heldout_chat.json"), "BENCH_HELDOUT_MODEL": str(model_dir(s)),
               "BENCH_HELDOUT_EVERY": str(s.heldout_every)} if s.heldout_every and w.stage == "sft" else {}
    cold = launch(argv, {**env, **heldout}, workdir, timeout)
    record = {"tool": tool, "workload": name, "repeat": repeat, "returncode": cold.returncode}
    if cold.returncode != 0:
        record["error"] = cold.log_tail
        return record
    warm = None
    if s.second_launch:
        argv, _ = COMMANDS[tool](w, s, 1, workdir)  # second launch: only the time to the first step
        warm = launch(argv, env, workdir, timeout)
    record.update(figures(cold, warm if warm and warm.returncode == 0 else None, rows, params, peak))
    return record


# --- the comparison -----------------------------------------------------------------------------


def venv_versions(python: Path) -> dict:
    code = ("import importlib.metadata as m, json; names=['torch','transformers','peft','trl','datasets','accelerate',"
            "'llamafactory','tunelab','tokenizers']; v={}\nfor n in names:\n try: v[n]=m.version(n)\n except Exception: pass\n"
            "print(json.dumps(v))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr[-500:]}


def tool_python(tool: str) -> Path:
    return {"llamafactory": VENVS / "llamafactory" / "bin" / "python", "trl": VENVS / "trl" / "bin" / "python"}.get(
        tool, TUNELAB_PYTHON)


def flop_params(model_dir: Path) -> int:
    """N of the MFU: the non-embedding parameters plus the output layer (vocab × hidden), tied or not."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return non_embedding_params(model_dir) + cfg["vocab_size"] * cfg["hidden_size"]


def non_embedding_params(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg.get("head_dim") or h // cfg["num_attention_heads"]
    attention = h * heads * hd * 2 + h * kv * hd * 2
    return layers * (attention + 3 * h * i + 2 * h) + h


def pad_id(model_dir: Path) -> int:
    """The padding id the probe skips when a batch has no 2-D attention mask (the tokenizer's, else 0)."""
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    pad = config.get("pad_token")
    if not pad:
        return 0
    vocab = json.loads((model_dir / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in vocab.get("added_tokens", [])}
    return added.get(pad, vocab["model"]["vocab"].get(pad, 0))


def median_of(records: list[dict], key: str):
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


COLUMNS = [("sup_tok_s", "sup tok/s", "{:,.0f}"), ("tok_s", "tok/s", "{:,.0f}"), ("mfu", "MFU", "{:.1%}"),
           ("pre_ex_s", "pre ex/s", "{:,.0f}"), ("ttfs_first_s", "ttfs 1st", "{:.1f}s"),
           ("ttfs_second_s", "ttfs 2nd", "{:.1f}s"), ("pack_eff", "pack eff", "{:.1%}"),
           ("peak_rss_mb", "RSS MB", "{:,.0f}"), ("peak_gpu_mb", "GPU MB", "{:,.0f}"), ("final_loss", "loss", "{:.4f}"),
           ("loss_sum", "Σ loss", "{:,.1f}"),
           ("time_to_target_s", "t→loss", "{:.1f}s"), ("final_accuracy", "acc", "{:.1%}"),
           ("time_to_accuracy_s", "t→acc", "{:.1f}s"), ("final_heldout_loss", "h-loss", "{:.4f}"),
           ("operators", "ops/step", "{:,.0f}"), ("syncs", "syncs", "{:,.0f}"), ("kernels", "kernels", "{:,.0f}"),
           ("device_busy_share", "GPU busy", "{:.0%}")]
HIGHER_IS_BETTER = {"sup_tok_s", "tok_s", "mfu", "pre_ex_s", "pack_eff", "device_busy_share"}


def table(medians: dict, targets: dict, accuracy_targets: dict | None = None) -> str:
    lines = []
    for name, by_tool in medians.items():
        target = f" (t→loss: seconds from launch to a {LOSS_WINDOW}-step mean loss <= {targets[name]:.4f})" \
            if targets.get(name) is not None else ""
        if (accuracy_targets or {}).get(name) is not None:
            target += (f" (t→acc: training seconds from launch to a held-out token accuracy >= "
                       f"{accuracy_targets[name]:.1%}, the probe's evaluations not counted)")
        lines.append(f"\n{name}{target}")
        lines.append(f"{'tool':<13}" + "".join(f"{title:>11}" for _, title, _ in COLUMNS))
        for tool, m in by_tool.items():
            if "error" in m:
                lines.append(f"{tool:<13}  {m['error']}")
                continue
            cells = [fmt.format(m[key]) if m.get(key) is not None else "-" for key, _, fmt in COLUMNS]
            lines.append(f"{tool:<13}" + "".join(f"{c:>11}" for c in cells))
        ours = by_tool.get("tunelab", {})
        for tool, m in by_tool.items():
            if tool == "tunelab" or "error" in m or "error" in ours or not ours:
                continue
            cells = []
            for key, _, _ in COLUMNS:
                a, b = ours.get(key), m.get(key)
                if key in ("final_loss", "loss_sum", "final_heldout_loss") and a is not None and b:
                    cells.append(f"{(a - b) / b:+.1%}")
                    continue
                if key == "final_accuracy" and a is not None and b is not None:
                    cells.append(f"{100 * (a - b):+.1f}pt")
                    continue
                if a is None or b is None or not b or not a:
                    cells.append("-")
                    continue
                cells.append(f"{a / b if key in HIGHER_IS_BETTER else b / a:.2f}x")
            lines.append(f"{'  vs ' + tool:<13}" + "".join(f"{c:>11}" for c in cells))
    return "\n".join(lines) + "\n(ratios: tunelab's advantage, >1 is better for tunelab; loss: tunelab's relative difference)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--cutoff-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=tuple(TEMPLATES), default="tiny",
                        help="tiny: the embedded model (853k non-embedding parameters); small: random init, 27M; "
                             "real: the Qwen2.5-0.5B layout (vocab 151,936) cut to 2 layers; real8: to 8; real24: at full depth; "
                             "smollm2: SmolLM2-135M-Instruct, real weights, its own tokenizer and chat template")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision for every tool (default fp32)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: bench/gpu.sh")
    parser.add_argument("--attn", choices=("sdpa", "fa2"), default="sdpa", help="fa2: flash-attention 2 (varlen)")
    parser.add_argument("--liger", action="store_true", help="Liger kernels in every tool (fused linear cross-entropy)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the MFU's peak (e.g. the GPU's nominal dense bf16 TFLOP/s) instead of the measured matmul peak")
    parser.add_argument("--no-second-launch", action="store_true",
                        help="skip the second launch of every run (no ttfs 2nd; saves a launch per run)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP/MKL threads of every tool")
    parser.add_argument("--tokenizers-parallelism", choices=("default", "off"), default="default",
                        help="default: as a user runs (the Rust tokenizer may use every core when a tool encodes "
                        "batches); off: TOKENIZERS_PARALLELISM=false for every tool (one thread)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    parser.add_argument("--tunelab-set", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra key of tunelab's config (YAML value), e.g. padding_free=false or torch_compile=true")
    parser.add_argument("--label", default="", help="free text stored with the results (e.g. 'smoke')")
    parser.add_argument("--heldout-every", type=int, default=0, metavar="N",
                        help="SFT workloads: the probe's held-out token accuracy every N steps and at the last (t→acc)")
    parser.add_argument("--keep", action="store_true", help="keep the run folders (configs, logs, outputs)")
    parser.add_argument("--sequential", action="store_true",
                        help="every tool takes the rows in file order, unshuffled: the same batches, so the losses compare")
    parser.add_argument("--count-ops", type=int, default=0, metavar="STEP",
                        help="count the aten operators and host-device syncs of optimizer step STEP (bench/peers/probe.py)")
    args = parser.parse_args()
    options = {}
    for item in args.tunelab_set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--tunelab-set {item}: expected KEY=VALUE")
        options[key] = yaml.safe_load(value)
    settings = Settings(args.steps, args.batch_size, args.cutoff_len, args.seed, args.bf16, args.threads, args.model,
                        device=args.device, attn=args.attn, liger=args.liger,
                        second_launch=not args.no_second_launch, tunelab_options=options,
                        heldout_every=args.heldout_every, sequential=args.sequential)
    workloads = args.workloads.split(",")
    tools = args.tools.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS] + [t for t in tools if t not in TOOLS]
    if unknown:
        parser.error(f"unknown workload/tool {unknown}; workloads {list(WORKLOADS)}, tools {list(TOOLS)}")
    for tool in tools:
        if not tool_python(tool).exists():
            parser.error(f"{tool}: {tool_python(tool)} is missing; run `bash bench/peers/setup.sh` first")

    inputs = [DATA / "manifest.json", model_dir(settings), *(DATA / w.rows_file for w in WORKLOADS.values())]
    if not all(path.exists() for path in inputs):  # first run, or inputs written before a workload was added
        models = ",".join(dict.fromkeys(("tiny", "small", settings.model)))
        subprocess.run([str(TUNELAB_PYTHON), str(BENCH / "inputs.py"), "--models", models], check=True,
                       stdout=subprocess.DEVNULL)
    manifest = json.loads((DATA / "manifest.json").read_text())
    rows = {"sft.json": manifest["rows"]["sft"], "pref.json": manifest["rows"]["pref"],
            "pref_mixed.json": manifest["rows"]["pref_mixed"], "corpus.json": manifest["rows"]["corpus_docs"],
            "sft_long.json": manifest["rows"]["sft_long"]}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "WANDB_DISABLED": "true",
           "DISABLE_VERSION_CHECK": "1", "PYTHONHASHSEED": "0", "BENCH_PAD_ID": str(pad_id(model_dir(settings))),
           # transformers >= 5.25 would fetch Hub kernels on a GPU (offline: it fails); tunelab sets use_kernels off
           "USE_HUB_KERNELS": "NO"}
    if args.count_ops:
        env["BENCH_COUNT_OPS"] = str(args.count_ops)
    env.pop("TOKENIZERS_PARALLELISM", None)
    if args.tokenizers_parallelism == "off":
        env["TOKENIZERS_PARALLELISM"] = "false"
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    dtype = "bf16" if args.bf16 else "fp32"
    peak = json.loads(subprocess.run([str(TUNELAB_PYTHON), str(BENCH / "matmul_peak.py"), "--dtypes", dtype], env=env, check=True,
                                     capture_output=True, text=True).stdout)
    peak_key = "bf16_gflops" if args.bf16 else "fp32_gflops"
    if args.peak_tflops:
        peak_key, peak["nominal_gflops"] = "nominal_gflops", args.peak_tflops * 1000
    params = flop_params(model_dir(settings))
    print(f"matmul peak ({peak['threads']} threads): {dtype} {peak[f'{dtype}_gflops']:.1f} GFLOP/s; "
          f"MFU against {peak[peak_key]:,.0f} GFLOP/s; model: "
          f"{non_embedding_params(model_dir(settings)):,} non-embedding parameters, N = {params:,} with the "
          "output layer", flush=True)

    root = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    records, medians, targets, accuracy_targets = [], {}, {}, {}
    for name in workloads:
        medians[name] = {}
        failed: set[str] = set()
        # Repeats interleave (every tool once, then every tool again): a slow spell of the machine
        # touches each tool's runs alike instead of all the runs of one tool. Each repeat starts one tool
        # later, so a drift inside a repeat does not always fall on the same tool.
        for repeat in range(args.repeats):
            for tool in rotated([t for t in tools if t in WORKLOADS[name].tools and t not in failed], repeat):
                t = time.time()
                record = run_one(tool, name, settings, repeat, root, env, rows[WORKLOADS[name].rows_file], params,
                                 peak[peak_key], args.timeout)
                records.append(record)
                status = "ok" if record["returncode"] == 0 else f"FAILED (exit {record['returncode']})"
                print(f"{name:<16} {tool:<13} repeat {repeat}: {status} in {time.time() - t:.0f} s", flush=True)
                if record["returncode"] != 0:
                    print(record["error"][-1500:], flush=True)
                    failed.add(tool)
        done = [r for r in records if r["workload"] == name and r["returncode"] == 0]
        target = add_time_to_target(done)
        accuracy_targets[name] = add_time_to_accuracy(done)
        for tool in [t for t in tools if t in WORKLOADS[name].tools]:
            good = [r for r in done if r["tool"] == tool]
            if good:
                medians[name][tool] = {key: median_of(good, key) for key in good[0] if key not in
                                       ("tool", "workload", "repeat", "returncode", "loss_curve",
                                        "heldout_curve", "sync_ops", "sync_sites", "top_operators")}
            else:
                medians[name][tool] = {"error": "failed, see the JSON"}
        targets[name] = target

    print(table(medians, targets, accuracy_targets))
    for record in (r for r in records if r.get("sync_ops") is not None and r["repeat"] == 0):
        print(f"{record['workload']} {record['tool']} step {args.count_ops}: syncs {record['sync_ops']}; most called: "
              + ", ".join(f"{name.removeprefix('aten::')} {n}" for name, n in record["top_operators"]))
        for site, calls in (record.get("sync_sites") or {}).items():
            print(f"    {calls:>5} × {site}")
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    result = {
        "label": args.label, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "settings": settings.__dict__, "tokenizers_parallelism": args.tokenizers_parallelism,
        "matmul_peak": peak, "flop_params": params,
        "non_embedding_params": non_embedding_params(model_dir(settings)),
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gb": psutil.virtual_memory().total / 2**30,
                    "platform": platform.platform(), "load_avg_at_end": os.getloadavg()},
        "versions": {tool: venv_versions(tool_python(tool)) for tool in tools},
        "inputs": manifest, "medians": medians, "target_losses": targets,
        "target_accuracies": accuracy_targets, "runs": records,
    }
    path = RESULTS / f"peers-{stamp}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"results: {path}")
    if args.keep:
        print(f"run folders: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
