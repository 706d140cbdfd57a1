"""The machine's matmul peak in GFLOP/s, fp32 and bf16, with torch's current thread count.

bench/run.py runs this once per comparison, in the same environment (OMP_NUM_THREADS) as the tools,
and divides each run's 6·N·tokens/s by it (MFU). Square matmuls of a size large enough to be
compute-bound; the best of several timed repeats after a warm-up.

    python bench/matmul_peak.py            # prints JSON {"threads", "fp32_gflops", "bf16_gflops"}
"""

from __future__ import annotations

import json

import torch

from tunelab.config.precision import matmul_gflops


def peak_gflops(dtype: torch.dtype) -> float:
    """Large enough to be compute-bound; the best of 5 timed repeats (fewer past 3 s)."""
    return matmul_gflops(dtype, size=2048, budget_s=3.0, max_repeats=5)


def main() -> None:
    result = {"threads": torch.get_num_threads(), "fp32_gflops": peak_gflops(torch.float32),
              "bf16_gflops": peak_gflops(torch.bfloat16)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
