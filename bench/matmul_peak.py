"""The machine's matmul peak in GFLOP/s, fp32 and bf16, with torch's current thread count.

bench/run.py runs this once per comparison, in the same environment (OMP_NUM_THREADS) as the tools,
and divides each run's 6·N·tokens/s by it (MFU). Square matmuls of a size large enough to be
compute-bound; the best of several timed repeats after a warm-up.

    python bench/matmul_peak.py            # prints JSON {"threads", "fp32_gflops", "bf16_gflops"}
    python bench/matmul_peak.py --dtypes fp32

Where bf16 is emulated (CPUs without avx512_bf16 / AMX) one 2048² bf16 matmul takes minutes: bench/run.py
measures only the dtype it trains in.
"""

from __future__ import annotations

import argparse
import json

import torch

from tunelab.model.device import matmul_gflops


def peak_gflops(dtype: torch.dtype) -> float:
    """Large enough to be compute-bound; the best of 5 timed repeats (fewer past 3 s)."""
    return matmul_gflops(dtype, size=2048, budget_s=3.0, max_repeats=5)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma separated: fp32, bf16")
    args = parser.parse_args()
    result = {"threads": torch.get_num_threads()}
    for name in args.dtypes.split(","):
        result[f"{name}_gflops"] = peak_gflops(DTYPES[name])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
