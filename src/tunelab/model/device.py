"""This machine's facts for the precision choice (config/precision.py decides from them): the GPU and its compute
capability, or the CPU's name, its bf16 flags and a matmul probe measured once and cached; TUNELAB_CPU_BF16 stands
in for a CPU's own facts."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from tunelab.config.precision import CPU_BF16_ENV, CPU_BF16_FLAGS, CpuProbe, DeviceFacts, Machine
from tunelab.errors import ConfigError

PROBE_FILE = "precision_probe.json"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere, which auto reads as 'no native bf16')."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "this CPU"


def matmul_gflops(dtype, size: int = 512, budget_s: float = 0.3, max_repeats: int | None = None) -> float:
    """Best-of-repeats square matmul throughput (GFLOP/s) after a warm-up: repeats until budget_s has passed
    (at least once), or max_repeats. Also bench/matmul_peak.py's MFU denominator."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up: thread pool, kernel selection
    best, deadline, repeats = float("inf"), time.perf_counter() + budget_s, 0
    while True:
        start = time.perf_counter()
        torch.mm(a, b)
        best, repeats = min(best, time.perf_counter() - start), repeats + 1
        if time.perf_counter() > deadline or repeats == max_repeats:
            break
    return 2 * size**3 / best / 1e9


def measure_cpu_matmul(size: int = 512, budget_s: float = 0.3) -> CpuProbe:
    """fp32 and bf16 matmul throughput of this CPU (about half a second in all)."""
    return CpuProbe(fp32_gflops=matmul_gflops(torch.float32, size, budget_s),
                    bf16_gflops=matmul_gflops(torch.bfloat16, size, budget_s), threads=torch.get_num_threads())


def probe_cache_path() -> Path:
    """Beside the tokenized-dataset cache ($TUNELAB_CACHE, default ~/.cache/tunelab)."""
    return Path(os.environ.get("TUNELAB_CACHE") or Path.home() / ".cache" / "tunelab") / PROBE_FILE


def cached_cpu_probe(name: str, flags: frozenset[str], path: Path | None = None) -> CpuProbe:
    """The matmul probe of this machine, measured once and read from the cache afterwards. The key is what would
    change the answer: the CPU, its bf16 flags, torch's version and thread count."""
    path = path or probe_cache_path()
    key = json.dumps([name, sorted(set(CPU_BF16_FLAGS) & flags), torch.__version__, torch.get_num_threads()])
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
        if cached.get("key") == key:
            return CpuProbe(**cached["probe"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass  # no cache yet, or an unreadable one: measure again
    probe = measure_cpu_matmul()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "probe": dataclasses.asdict(probe)}), encoding="utf-8")
    except OSError:
        pass  # a read-only home: measure again next time
    return probe


def assumed_cpu_bf16(environ: Mapping[str, str] | None = None) -> bool | None:
    """What TUNELAB_CPU_BF16 says to assume of the CPU: True (fast native bf16), False (none), None (unset).
    os.environ is read at the call: datasets' parallel map replaces the os.environ object."""
    value = (os.environ if environ is None else environ).get(CPU_BF16_ENV, "").strip()
    if value == "":
        return None
    if value not in ("0", "1"):
        raise ConfigError(f"{CPU_BF16_ENV}={value!r}: expected 1 (decide bf16 / fp16 auto as on a CPU with fast native "
                          "bf16) or 0 (as on one without); or unset it to read this CPU's own facts")
    return value == "1"


def device_facts(use_cpu: bool) -> DeviceFacts:
    """This machine's facts for the device training will use: the first CUDA GPU unless `use_cpu` (or no GPU).
    Under TUNELAB_CPU_BF16 a CPU is not probed: the variable decides."""
    if not use_cpu and torch.cuda.is_available():
        return DeviceFacts("cuda", torch.cuda.get_device_name(0), tuple(torch.cuda.get_device_capability(0)))
    if not use_cpu and (
        (hasattr(torch, "xpu") and torch.xpu.is_available()) or torch.backends.mps.is_available()
    ):
        return DeviceFacts("other", "xpu" if hasattr(torch, "xpu") and torch.xpu.is_available() else "mps")
    name, flags, assumed = cpu_name(), cpu_flags(), assumed_cpu_bf16()
    if assumed is not None:
        return DeviceFacts("cpu", name, cpu_flags=flags, assumed_bf16=assumed)
    probe = cached_cpu_probe(name, flags) if set(CPU_BF16_FLAGS) & flags else None
    return DeviceFacts("cpu", name, cpu_flags=flags, probe=probe)


def machine() -> Machine:
    """This machine for config loading: accelerators present, its device facts on demand, and whether this process
    was told to keep off them (ACCELERATE_USE_CPU)."""
    has_cuda = torch.cuda.is_available()
    has_accelerator = has_cuda or (hasattr(torch, "xpu") and torch.xpu.is_available()) or torch.backends.mps.is_available()
    accelerate_use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
    return Machine(has_cuda, has_accelerator, device_facts, accelerate_use_cpu)
