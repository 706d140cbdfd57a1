"""Mixed precision chosen by the hardware: what `bf16: auto` / `fp16: auto` (the default) become.

bf16 autocast where the device runs it natively and fast: a CUDA GPU of compute capability 8.0 or higher, or
a CPU whose flags say it has bf16 matrix instructions (avx512_bf16, amx_bf16) *and* whose measured bf16 matmul
is clearly faster than fp32 (a short probe, cached per machine: a flag alone does not say the path is fast, and
on CPUs without those instructions bf16 matmul is several times slower than fp32). fp16 with loss scaling on
older CUDA GPUs (compute capability 7.x, and 6.x where fp16 math is native). fp32 everywhere else. An explicit
`bf16` / `fp16` value always wins; config/loader.py applies the choice and the training log says it and why.

`choose_precision` is a pure function of the facts (device kind, compute capability, CPU flags, probe figures),
so each branch is tested with the facts as data; model/device.py reads them from this machine.

`TUNELAB_CPU_BF16=1` makes `auto` decide as on a CPU with fast native bf16, `TUNELAB_CPU_BF16=0` as on one without,
whatever this CPU has (GPUs are not affected). The test suite pins it to 0 and runs its bf16 variants with 1, so
both paths run on every machine; on a CPU without native bf16 the bf16 path is slower there, not wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Mode = Literal["bf16", "fp16", "fp32"]

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo names of native bf16 matrix instructions
MIN_CPU_BF16_SPEEDUP = 1.2  # bf16 must beat fp32 matmul by this much on the probe to be worth its rounding
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


@dataclass(frozen=True)
class Machine:
    """What reading a config needs to know of the hardware, read by tunelab/preflight.py (model/device.py): whether
    a GPU (or another accelerator) is there, and the facts of the device training would use, on demand (a CPU's
    bf16 probe costs half a second, and only auto needs it)."""

    has_cuda: bool
    has_accelerator: bool
    facts: Callable[[bool], DeviceFacts]  # use_cpu -> the facts of the device training would use
    # ACCELERATE_USE_CPU is set: transformers will not select a device. The launching process of a multi-process run
    # sets it while it checks the config (train/launch.py), and decides for the CPU; each worker decides again.
    accelerate_use_cpu: bool = False
