"""The two precision paths the suite runs (config/precision.py's TUNELAB_CPU_BF16), for tests and their helpers.

The suite pins bf16 / fp16 auto to fp32 (tests/conftest.py); a test that takes the `precision` fixture runs once per
path, and helpers that train in their own fixtures set the same variable with `precision_env`.

On a CPU without native bf16 (no avx512_bf16 / amx_bf16: most laptops, an AVX2-only EPYC) torch emulates bf16
matmuls, tens of times slower than fp32 (46 against 2,300 GFLOP/s in bench/matmul_peak.py on an AMX Xeon made to
run as such a CPU), so a bf16 run of the quickstart took 742 s there. The long bf16 end-to-end cases ask
`emulated_bf16(precision)` and then run a shorter version that still checks what bf16 can break.
"""

from __future__ import annotations

from tunelab.config.precision import CPU_BF16_ENV, CPU_BF16_FLAGS
from tunelab.model.device import cpu_flags

PRECISIONS = ("fp32", "bf16")
PRECISION_ENV = {"fp32": "0", "bf16": "1"}
BF16_EMULATED = not set(CPU_BF16_FLAGS) & cpu_flags()  # this CPU's facts (model/device.py), not TUNELAB_CPU_BF16


def emulated_bf16(precision: str) -> bool:
    """Whether this test's path is bf16 on a CPU that emulates it: then the test runs its shorter version."""
    return precision == "bf16" and BF16_EMULATED


def precision_env(precision: str) -> dict[str, str]:
    """The environment entry that makes bf16 auto choose `precision` (as on a CPU without / with native bf16)."""
    return {CPU_BF16_ENV: PRECISION_ENV[precision]}


def autocast(precision: str):
    """The context a bf16 run computes its evaluations in (the Trainer's bf16 autocast on CPU), for tests that
    recompute a run's reported figures from its saved output; nothing under fp32."""
    import contextlib  # noqa: PLC0415

    import torch  # noqa: PLC0415

    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
