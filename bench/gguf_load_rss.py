"""Peak RSS of loading a GGUF file into a dense model, against the size of the weights it loads.

Each load runs in a fresh subprocess: it imports torch, transformers and tunelab, reads the file's config and builds
the model on the meta device (the imports a load makes), notes its RSS (the baseline), loads the file through
tunelab's loader (model/gguf.py `from_pretrained`) in the asked dtype and prints one JSON line: ru_maxrss (the true
peak), the baseline, the bytes of the loaded weights (tied ones once) and the two ratios peak / weights and (peak -
baseline) / weights. The lean-loading goal is peak / weights <= 1.5.

    python bench/gguf_load_rss.py ~/.cache/tunelab/real/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
    python bench/gguf_load_rss.py FILE --dtypes bfloat16            # one dtype (default: float32 and bfloat16)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

MB = 1 << 20


def rss_bytes() -> int:
    """This process's current resident set, from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers, each storage once (tied embeddings count once)."""
    seen: dict[int, int] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure(path: str, dtype_name: str) -> dict:
    """Load `path` in this process and report its memory (call it in a fresh process: ru_maxrss only grows)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tunelab.model import gguf

    # What the load imports on its way (the model's modeling code, gguf-py) is imported first, by reading the config and
    # building the model on the meta device, so that `baseline` holds what any process loading this model has anyway.
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(gguf.load_config(path))
    baseline = rss_bytes()
    model = gguf.from_pretrained(AutoModelForCausalLM, path, dtype=getattr(torch, dtype_name))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    weights = weight_bytes(model)
    return {
        "file": Path(path).name, "dtype": dtype_name,
        "peak_mib": round(peak / MB), "baseline_mib": round(baseline / MB),
        "weights_mib": round(weights / MB), "peak_over_weights": round(peak / weights, 3),
        "added_over_weights": round((peak - baseline) / weights, 3),
    }


def run_in_subprocess(path: str, dtype_name: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", path, "--dtypes", dtype_name],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"loading {path} in {dtype_name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for path in args.files:
        for dtype_name in args.dtypes.split(","):
            if args.child:
                print(json.dumps(measure(str(Path(path).expanduser()), dtype_name)))
            else:
                print(json.dumps(run_in_subprocess(path, dtype_name)), flush=True)


if __name__ == "__main__":
    main()
