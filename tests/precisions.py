"""The two precision paths the suite runs (config/precision.py's TUNELAB_CPU_BF16), for tests and their helpers.

The suite pins bf16 / fp16 auto to fp32 (tests/conftest.py); a test that takes the `precision` fixture runs once per
path, and helpers that train in their own fixtures set the same variable with `precision_env`.
"""

from __future__ import annotations

from tunelab.config.precision import CPU_BF16_ENV

PRECISIONS = ("fp32", "bf16")
PRECISION_ENV = {"fp32": "0", "bf16": "1"}


def precision_env(precision: str) -> dict[str, str]:
    """The environment entry that makes bf16 auto choose `precision` (as on a CPU without / with native bf16)."""
    return {CPU_BF16_ENV: PRECISION_ENV[precision]}


def autocast(precision: str):
    """The context a bf16 run computes its evaluations in (the Trainer's bf16 autocast on CPU), for tests that
    recompute a run's reported figures from its saved output; nothing under fp32."""
    import contextlib  # noqa: PLC0415

    import torch  # noqa: PLC0415

    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
