"""Mixed precision chosen by the hardware: what `bf16: auto` / `fp16: auto` (the default) become.

bf16 autocast where the device runs it natively and fast: a CUDA GPU of compute capability 8.0 or higher, or
a CPU whose flags say it has bf16 matrix instructions (avx512_bf16, amx_bf16) *and* whose measured bf16 matmul
is clearly faster than fp32 (a short probe, cached per machine: a flag alone does not say the path is fast, and
on CPUs without those instructions bf16 matmul is several times slower than fp32). fp16 with loss scaling on
older CUDA GPUs (compute capability 7.x, and 6.x where fp16 math is native). fp32 everywhere else. An explicit
`bf16` / `fp16` value always wins; config/loader.py applies the choice and the training log says it and why.

`choose_precision` is a pure function of the facts (device kind, compute capability, CPU flags, probe figures),
so each branch is tested with the facts as data; `device_facts` reads them from this machine.

`TUNELAB_CPU_BF16=1` makes `auto` decide as on a CPU with fast native bf16, `TUNELAB_CPU_BF16=0` as on one without,
whatever this CPU has (GPUs are not affected). The test suite pins it to 0 and runs its bf16 variants with 1, so
both paths run on every machine; on a CPU without native bf16 the bf16 path is slower there, not wrong.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tunelab.errors import ConfigError

Mode = Literal["bf16", "fp16", "fp32"]

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo names of native bf16 matrix instructions
MIN_CPU_BF16_SPEEDUP = 1.2  # bf16 must beat fp32 matmul by this much on the probe to be worth its rounding
PROBE_FILE = "precision_probe.json"
CPU_BF16_ENV = "TUNELAB_CPU_BF16"  # "1" / "0": decide as on a CPU with / without fast native bf16


@dataclass(frozen=True)
class CpuProbe:
    """Square-matmul throughput of this CPU in fp32 and bf16 (GFLOP/s), with torch's thread count."""

    fp32_gflops: float
    bf16_gflops: float
    threads: int

    @property
    def speedup(self) -> float:
        return self.bf16_gflops / self.fp32_gflops if self.fp32_gflops > 0 else 0.0


@dataclass(frozen=True)
class DeviceFacts:
    """What the precision choice depends on. `probe` is None when it was not run (no bf16 flags)."""

    kind: Literal["cuda", "cpu", "other"]
    name: str = ""
    compute_capability: tuple[int, int] | None = None  # cuda only
    cpu_flags: frozenset[str] = frozenset()
    probe: CpuProbe | None = None
    assumed_bf16: bool | None = None  # cpu only: TUNELAB_CPU_BF16 said to decide as if it has (or lacks) bf16


@dataclass(frozen=True)
class PrecisionChoice:
    mode: Mode
    reason: str


def choose_precision(facts: DeviceFacts) -> PrecisionChoice:
    """The mixed precision `auto` means on this device, and why."""
    if facts.kind == "cuda":
        major, minor = facts.compute_capability or (0, 0)
        where = f"{facts.name or 'CUDA GPU'} (compute capability {major}.{minor})"
        if major >= 8:
            return PrecisionChoice("bf16", f"{where} runs bf16 natively")
        if (major, minor) >= (6, 0):
            return PrecisionChoice("fp16", f"{where} has no fast bf16; fp16 with loss scaling")
        return PrecisionChoice("fp32", f"{where} has neither fast bf16 nor fast fp16")
    if facts.kind == "cpu":
        flags = sorted(set(CPU_BF16_FLAGS) & facts.cpu_flags)
        where = facts.name or "this CPU"
        if facts.assumed_bf16 is not None:
            has = "has" if flags else "lacks"
            return PrecisionChoice(
                "bf16" if facts.assumed_bf16 else "fp32",
                f"{CPU_BF16_ENV}={int(facts.assumed_bf16)} decides as on a CPU {'with' if facts.assumed_bf16 else 'without'}"
                f" fast native bf16 ({where} {has} {' / '.join(flags or CPU_BF16_FLAGS)})",
            )
        if not flags:
            return PrecisionChoice("fp32", f"{where} lacks {' / '.join(CPU_BF16_FLAGS)}: no native bf16 matmul, "
                                   "it runs slower than fp32")
        if facts.probe is None:
            return PrecisionChoice("fp32", f"{where} has {', '.join(flags)} but its bf16 matmul was not measured")
        figures = (f"bf16 matmul {facts.probe.bf16_gflops:.0f} vs fp32 {facts.probe.fp32_gflops:.0f} GFLOP/s "
                   f"on {facts.probe.threads} threads")
        if facts.probe.speedup >= MIN_CPU_BF16_SPEEDUP:
            return PrecisionChoice("bf16", f"{where} has {', '.join(flags)}; {figures}")
        return PrecisionChoice("fp32", f"{where} has {', '.join(flags)} but {figures} (bf16 needs "
                               f"{MIN_CPU_BF16_SPEEDUP}× fp32 to be chosen)")
    return PrecisionChoice("fp32", f"{facts.name or 'this device'}: auto chooses half precision only on CUDA GPUs and "
                           "CPUs with native bf16; set bf16: true to use it")


def resolve_flags(bf16: bool | None, fp16: bool | None, choice: PrecisionChoice) -> tuple[bool, bool]:
    """bf16 and fp16 as TrainingArguments takes them: an explicit value (True / False) wins, None (auto) follows
    `choice` unless the other flag is explicitly on. bf16: false on a bf16 device trains in fp32, not fp16."""
    if bf16 is True or fp16 is True:
        return bool(bf16), bool(fp16)
    return (bf16 is None and choice.mode == "bf16"), (fp16 is None and choice.mode == "fp16")


# ---- the facts of this machine ----------------------------------------------------------------------------------


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
    import torch  # noqa: PLC0415

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
    import torch  # noqa: PLC0415

    return CpuProbe(fp32_gflops=matmul_gflops(torch.float32, size, budget_s),
                    bf16_gflops=matmul_gflops(torch.bfloat16, size, budget_s), threads=torch.get_num_threads())


def probe_cache_path() -> Path:
    """Beside the tokenized-dataset cache ($TUNELAB_CACHE, default ~/.cache/tunelab)."""
    return Path(os.environ.get("TUNELAB_CACHE") or Path.home() / ".cache" / "tunelab") / PROBE_FILE


def cached_cpu_probe(name: str, flags: frozenset[str], path: Path | None = None) -> CpuProbe:
    """The matmul probe of this machine, measured once and read from the cache afterwards. The key is what would
    change the answer: the CPU, its bf16 flags, torch's version and thread count."""
    import torch  # noqa: PLC0415

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
    import torch  # noqa: PLC0415

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
