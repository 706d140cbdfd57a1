"""The machine's matmul peak in GFLOP/s, fp32 and bf16, with torch's current thread count.

bench/run.py runs this once per comparison, in the same environment (OMP_NUM_THREADS) as the tools,
and divides each run's 6·N·tokens/s by it (MFU). Square matmuls of a size large enough to be
compute-bound; the best of several timed repeats after a warm-up.

    python bench/matmul_peak.py            # prints JSON {"threads", "fp32_gflops", "bf16_gflops"}
"""

from __future__ import annotations

import json
import time

import torch


def peak_gflops(dtype: torch.dtype, size: int = 2048, repeats: int = 5, budget_s: float = 3.0) -> float:
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up: thread pool, kernel selection
    best, deadline = float("inf"), time.perf_counter() + budget_s
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return 2 * size**3 / best / 1e9


def main() -> None:
    result = {"threads": torch.get_num_threads(), "fp32_gflops": peak_gflops(torch.float32),
              "bf16_gflops": peak_gflops(torch.bfloat16)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
