"""Where a training step's peak RSS comes from: a `tunelab train` run's resident memory by phase, with what autograd
saves and what the C allocator holds (CPU, Linux, glibc).

Runs the real CLI (`tunelab.cli.main(["train", cfg, *overrides])`) in this process, with its JSON-lines log callback
wrapped (as bench/train_memory.py does) to follow each optimizer step through its phases:

    load       until training begins (model loaded, data ready)
    forward    step begin -> the model's forward returned (logits computed)
    backward   -> before the optimizer step (the loss's backward; with accumulation, every micro-batch's)
    optimizer  -> step end

A thread samples VmRSS every 20 ms and keeps the largest per phase of each step. At the end of each forward it reads
what autograd saved for backward (every saved storage once, parameters excluded), grouped by shape, and glibc's
mallinfo2: bytes in use by the C heap, bytes free but kept in it (`heap_free`), bytes in direct mappings (large
blocks). RSS far above live tensors with a large `heap_free` is the allocator's retention, not tensors.

    python bench/step_memory.py examples/real/qwen2.5-coder-0.5b_sft_lora.yaml packing=true cutoff_len=2048 \
        per_device_train_batch_size=1 max_steps=2 max_samples=200 eval_generation=false eval_dataset= \
        logging_steps=1 warmup_steps=0
"""

from __future__ import annotations

import collections
import ctypes
import json
import resource
import sys
import threading
import time

import torch

from tunelab.cli import main
from tunelab.train import callbacks
from tunelab.train.memory import rss_bytes

MIB = 1024**2


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_info() -> dict[str, float]:
    """glibc's heap: in use, free but kept, and directly mapped blocks, in MiB ({} off glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return {}
    info = libc.mallinfo2()
    return {"heap_in_use": info.uordblks / MIB, "heap_free": info.fordblks / MIB, "mmapped": info.hblkhd / MIB}


class Sampler:
    """VmRSS every `interval` seconds; the largest per (step, phase)."""

    def __init__(self, interval: float = 0.02):
        self.phase = ("load", 0)
        self.peaks: dict[tuple[str, int], int] = collections.defaultdict(int)
        self.interval, self.running = interval, True
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while self.running:
            key = self.phase
            self.peaks[key] = max(self.peaks[key], rss_bytes()["VmRSS"])
            time.sleep(self.interval)

    def enter(self, phase: str, step: int) -> None:
        self.peaks[self.phase] = max(self.peaks[self.phase], rss_bytes()["VmRSS"])
        self.phase = (phase, step)


class SavedTensors:
    """What autograd saves during one forward: every storage once (parameters excluded), by shape and dtype."""

    def __init__(self, parameters: set[int]):
        self.parameters = parameters
        self.storages: dict[int, tuple[int, str]] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.parameters and storage.nbytes() > self.storages.get(ptr, (0, ""))[0]:
            self.storages[ptr] = (storage.nbytes(), f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}")
        return tensor

    def summary(self, top: int = 12) -> dict:
        by_shape: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        for size, shape in self.storages.values():
            by_shape[shape][0] += 1
            by_shape[shape][1] += size
        largest = sorted(by_shape.items(), key=lambda item: -item[1][1])[:top]
        return {
            "saved_mib": round(sum(size for size, _ in self.storages.values()) / MIB, 1),
            "largest": [f"{count} x {shape}: {size / MIB:.1f} MiB" for shape, (count, size) in largest],
        }


def measuring_log(sampler: Sampler, report: dict):
    class MeasuringLog(callbacks.JsonlLogCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            super().on_train_begin(args, state, control, model=model, **kwargs)
            self.saved = None
            report["train_begin"] = {"rss_mib": rss_bytes()["VmRSS"] / MIB, **malloc_info()}
            self.parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
            model.register_forward_hook(self.forward_done)

        def forward_done(self, module, inputs, output):
            if self.saved is not None and module.training:
                self.saved.hooks.__exit__(None, None, None)
                logits = output["logits"] if isinstance(output, dict) else output[0]
                report.setdefault("forward", []).append({
                    "step": self.step, "rss_mib": rss_bytes()["VmRSS"] / MIB, "logits": list(logits.shape),
                    **self.saved.summary(), **malloc_info(),
                })
                self.saved = None
                sampler.enter("backward", self.step)

        def on_step_begin(self, args, state, control, **kwargs):
            self.step = state.global_step + 1
            self.usage = resource.getrusage(resource.RUSAGE_SELF)
            sampler.enter("forward", self.step)
            self.saved = SavedTensors(self.parameters)
            self.saved.hooks.__enter__()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            report.setdefault("after_backward", []).append(
                {"step": self.step, "rss_mib": rss_bytes()["VmRSS"] / MIB, **malloc_info()})
            sampler.enter("optimizer", self.step)

        def on_step_end(self, args, state, control, **kwargs):
            sampler.enter("between", self.step)
            usage = resource.getrusage(resource.RUSAGE_SELF)
            report.setdefault("step_cpu", []).append({
                "step": self.step, "user_s": round(usage.ru_utime - self.usage.ru_utime, 1),
                "system_s": round(usage.ru_stime - self.usage.ru_stime, 1),
                "minor_faults": usage.ru_minflt - self.usage.ru_minflt,
            })
            super().on_step_end(args, state, control, **kwargs)

    return MeasuringLog


def run(argv: list[str]) -> dict:
    sampler, report = Sampler(), {}
    callbacks.JsonlLogCallback = measuring_log(sampler, report)  # run_callbacks builds the log callback from here
    code = main(["train", *argv])
    sampler.running = False
    sampler.thread.join()
    report["peak_rss_mib"] = rss_bytes()["VmHWM"] / MIB
    report["phase_peaks_mib"] = {f"{phase} {step}": round(peak / MIB) for (phase, step), peak in sampler.peaks.items()}
    report["exit_code"] = code
    return report


if __name__ == "__main__":
    print("STEP_MEMORY " + json.dumps(run(sys.argv[1:]), indent=1))
