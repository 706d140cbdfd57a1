"""Start-up: wall time of each light command and what it imports; a training launch's time to its first step.

    python bench/startup.py [--launches 3]

1. Each light command (`tunelab --help`, `template list`, `template show chatml`, `data --help`, `env`) is launched
   `--launches` times; the median wall time, and whether peft, bitsandbytes or transformers' Trainer were imported.
2. The import floor: a process that only imports what any training run needs (torch, transformers' Trainer, peft,
   datasets, tunelab's sft stage), median of `--launches`.
3. The quickstart config (max_steps 2) launched through bench/peers/probe.py: time from launch to the first
   optimizer step, once with an empty cache, then `--launches` times hitting the tokenized cache (median). Minus the
   floor: what tunelab itself spends before training (config, tokenizer, cache hit, model load, Trainer set-up).
   Measured directly too: in one process, the floor's imports, then `tunelab train` with a callback noting the end
   of the first step (`after_imports_in_process`: tunelab's start-up plus one step, no import the floor pays).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIGHT = [["--help"], ["template", "list"], ["template", "show", "chatml"], ["data", "--help"], ["env"],
         ["data", "verify", str(ROOT / "examples/quickstart.yaml"), "max_samples=2000"]]
HEAVY = ("peft", "bitsandbytes", "transformers.trainer")
FLOOR = "import torch, datasets, peft, transformers; from transformers import Trainer; import tunelab.train.stages.sft"


def wall(argv: list[str], env: dict | None = None) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    return time.perf_counter() - start, done


def light_command(argv: list[str], launches: int) -> dict:
    code = ("import sys\nfrom tunelab.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            f"print('IMPORTED', sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)")
    times, imported = [], None
    for _ in range(launches):
        seconds, done = wall([sys.executable, "-c", code, *argv])
        times.append(seconds)
        imported = [line for line in done.stderr.splitlines() if line.startswith("IMPORTED")][-1][len("IMPORTED "):]
    return {"median_s": round(statistics.median(times), 2), "runs_s": [round(t, 2) for t in times], "heavy_imports": imported}


# In one process: the import floor first, then `tunelab train` on the warm cache; a callback notes when the first
# optimizer step ends. The difference is tunelab's own start-up (config, tokenizer, cache hit, model load, Trainer
# set-up) plus that one step, with no import in it that the floor does not pay.
OWN_WORK = FLOOR + """
import sys, time
from tunelab.cli import main
START = time.perf_counter()
main(["train", *sys.argv[2:], "callbacks=" + sys.argv[1] + ":FirstStep"])
"""
FIRST_STEP_CALLBACK = """
import sys, time
import transformers
class FirstStep(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            print("FIRST_STEP", time.perf_counter() - sys.modules["__main__"].START, file=sys.stderr)
"""


def quickstart_options(out: Path) -> list[str]:
    return ["model_name_or_path=tiny", "template=chatml", "dataset=demo_sort", "max_samples=9600", "cutoff_len=64",
            "per_device_train_batch_size=32", "max_steps=2", "logging_steps=1", "plot_loss=false",
            "disable_tqdm=true", f"output_dir={out}", "overwrite_output_dir=true"]


def own_work(out: Path) -> float:
    """Seconds from the end of the floor's imports to the end of the first step, in one process (warm cache)."""
    script, callback = out.parent / "own_work.py", out.parent / "first_step_callback.py"
    script.write_text(OWN_WORK)
    callback.write_text(FIRST_STEP_CALLBACK)
    _, done = wall([sys.executable, str(script), str(callback), *quickstart_options(out)])
    lines = [line for line in done.stderr.splitlines() if line.startswith("FIRST_STEP")]
    if done.returncode != 0 or not lines:
        raise SystemExit(done.stderr[-2000:])
    return float(lines[-1].split()[1])


def first_step(out: Path, probe_out: Path) -> float:
    config = quickstart_options(out)
    probe_out.unlink(missing_ok=True)
    env = {**os.environ, "BENCH_PROBE_OUT": str(probe_out)}
    launched = time.time()
    _, done = wall([sys.executable, str(ROOT / "bench/peers/probe.py"), "tunelab", "train", *config], env)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    events = [json.loads(line) for line in probe_out.read_text().splitlines()]
    step = next(e for e in events if e["event"] == "step")
    return step["time"] - launched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args()
    result: dict = {"python": sys.executable, "cpus": os.cpu_count(),
                    "load_average": [round(x, 2) for x in os.getloadavg()]}
    result["interpreter_s"] = round(statistics.median(wall([sys.executable, "-c", "pass"])[0] for _ in range(args.launches)), 2)
    result["commands"] = {" ".join(argv): light_command(argv, args.launches) for argv in LIGHT}
    floor = statistics.median(wall([sys.executable, "-c", FLOOR])[0] for _ in range(args.launches))
    result["training_import_floor_s"] = round(floor, 2)
    with tempfile.TemporaryDirectory() as tmp:
        cache = {**os.environ}
        os.environ["TUNELAB_CACHE"] = str(Path(tmp) / "cache")  # a cold cache for the first launch
        firsts = [first_step(Path(tmp) / "out", Path(tmp) / "probe.jsonl") for _ in range(1 + args.launches)]
        own = [own_work(Path(tmp) / "out") for _ in range(args.launches)]
        os.environ.clear()
        os.environ.update(cache)
    again = statistics.median(firsts[1:])
    result["time_to_first_step_s"] = {"first_launch": round(firsts[0], 2), "cached_launches": [round(t, 2) for t in firsts[1:]],
                                      "cached_median": round(again, 2), "cached_minus_floor": round(again - floor, 2),
                                      "after_imports_in_process": [round(t, 2) for t in own],
                                      "after_imports_in_process_median": round(statistics.median(own), 2)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
