"""Peak memory of a real `tunelab train` run against `tunelab estimate`'s prediction (CPU, Linux).

The run is the real CLI (`tunelab.cli.main(["train", cfg])`) in a fresh subprocess. Its JSON-lines log
callback is wrapped to take the baseline when training begins (model loaded, data ready): there the
peak-RSS mark is reset (/proc/self/clear_refs) and VmRSS read; when training ends VmHWM is read. The
increase covers gradients, optimizer states, activations and the loss workspace — everything but the
weights, which the baseline already holds — and is compared with the estimate's `training_increase`.

glibc keeps freed tensors in its heap once its dynamic mmap threshold has risen, so RSS would show the
high-water mark of allocator reuse, not live tensors; the subprocess therefore runs with
MALLOC_MMAP_THRESHOLD_=65536 (tensors above 64 KiB map and unmap directly; it also makes steps slower,
so `tunelab estimate`'s probe, which times steps and measures the whole process, does not). What remains beyond tensors is roughly constant (library code paged in by the first
backward, thread pools: ~10-15 MiB here), so repeat at two batch sizes to see the per-token slope.

    python bench/train_memory.py                    # pt, full, tiny model, cutoff_len 128, batch 16 and 32
    python bench/train_memory.py --repeats 3 --batch-sizes 32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

BASE_CONFIG = {
    "model_name_or_path": "tiny", "stage": "pt", "finetuning_type": "full", "dataset": "demo_corpus",
    "cutoff_len": 128, "tail": "drop", "per_device_train_batch_size": 32, "max_steps": 3,
    "logging_steps": 1, "disable_tqdm": True, "plot_loss": False, "seed": 0,
}

_CHILD = r"""
import json, sys
from tunelab.cli import main
from tunelab.train import callbacks
from tunelab.train.memory import reset_peak_rss, rss_bytes

result = {}

class MeasuringLog(callbacks.JsonlLogCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        reset_peak_rss()
        result["baseline_rss"] = rss_bytes()["VmRSS"]

    def on_train_end(self, args, state, control, **kwargs):
        result["peak_increase"] = rss_bytes()["VmHWM"] - result["baseline_rss"]

callbacks.JsonlLogCallback = MeasuringLog  # run_callbacks (every stage's list) builds the log callback from here
assert main(["train", sys.argv[1]]) == 0
print("RESULT " + json.dumps(result))
"""


def measure_train(config: dict, folder: Path) -> dict:
    """Run `tunelab train` on `config` in a subprocess; {'baseline_rss', 'peak_increase'} in bytes."""
    path = folder / "train.yaml"
    path.write_text(yaml.safe_dump({**config, "output_dir": str(folder / "run"), "overwrite_output_dir": True}))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"tunelab train failed:\n{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def predicted_increase(config: dict) -> int:
    from tunelab.preflight import load_config  # noqa: PLC0415
    from tunelab.train.estimate import estimate  # noqa: PLC0415

    return estimate(load_config(None, {**config, "output_dir": "unused"}, purpose="estimate"), probe_steps=0).memory.training_increase


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="16,32")
    parser.add_argument("--finetuning-type", default="full")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    mib = 1024**2
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        config = {**BASE_CONFIG, "per_device_train_batch_size": batch, "finetuning_type": args.finetuning_type}
        predicted = predicted_increase(config)
        measured = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as folder:
                measured.append(measure_train(config, Path(folder))["peak_increase"])
        spread = f" (min {min(measured) / mib:.1f}, max {max(measured) / mib:.1f})" if len(measured) > 1 else ""
        mean = sum(measured) / len(measured)
        print(f"batch {batch}: predicted {predicted / mib:.1f} MiB, measured {mean / mib:.1f} MiB{spread}, "
              f"error {100 * (predicted - mean) / mean:+.1f}%")


if __name__ == "__main__":
    main()
