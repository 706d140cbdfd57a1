"""Start-up of the commands a user runs before training, for two source trees, launched interleaved.

    python bench/startup_ab.py --before /work/main/src --after src [--launches 5] [--only 'data stats' ...]

Each command (`tunelab --help`, `train --help`, `data stats` and `estimate --probe-steps 0`
on the quickstart, 2,000 rows) runs `--launches` times per tree as bench/startup.py runs it (`main()` in a fresh
interpreter), after one uncounted launch per tree (caches filled), alternating before / after (the after tree first
on odd rounds), so a shared machine's load falls on both alike. Prints one JSON object: per command and tree, the
median and each launch's wall time, and the modules the after tree's launch imported that the before tree's did not
(and the reverse).
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
QUICKSTART = [str(ROOT / "examples/quickstart.yaml"), "max_samples=2000"]
CODE = ("import sys\nfrom tunelab.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print('MODULES', ' '.join(sorted(sys.modules)), file=sys.stderr)")


def commands(out: Path) -> dict[str, list[str]]:
    return {"--help": ["--help"], "train --help": ["train", "--help"],
            "data stats": ["data", "stats", *QUICKSTART, "--out", str(out)],
            "estimate": ["estimate", *QUICKSTART, "--probe-steps", "0", f"output_dir={out}"]}


def launch(src: str, argv: list[str]) -> tuple[float, set[str]]:
    env = {**os.environ, "PYTHONPATH": src}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CODE, *argv], capture_output=True, text=True, env=env, timeout=900)
    seconds = time.perf_counter() - start
    lines = [line for line in done.stderr.splitlines() if line.startswith("MODULES ")]
    if not lines:
        raise SystemExit(f"{src}: {' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    return seconds, set(lines[-1].split()[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the src folder of the tree to compare against")
    parser.add_argument("--after", required=True, help="the src folder of the changed tree")
    parser.add_argument("--launches", type=int, default=5)
    parser.add_argument("--only", action="append", help="run only this command (repeatable), e.g. --only 'data stats'")
    args = parser.parse_args()
    trees = {"before": str(Path(args.before).resolve()), "after": str(Path(args.after).resolve())}
    result: dict = {"python": sys.executable, "cpus": os.cpu_count(), "trees": trees,
                    "load_average_at_start": [round(x, 2) for x in os.getloadavg()], "commands": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv in commands(Path(tmp)).items():
            if args.only and name not in args.only:
                continue
            times: dict[str, list[float]] = {"before": [], "after": []}
            modules: dict[str, set[str]] = {}
            for tree in trees:  # a first launch each, not counted: the tokenized cache and the OS file cache filled
                launch(trees[tree], argv)
            for round_ in range(args.launches):
                for tree in (("after", "before") if round_ % 2 else ("before", "after")):
                    seconds, modules[tree] = launch(trees[tree], argv)
                    times[tree].append(seconds)
            result["commands"][name] = {
                **{tree: {"median_s": round(statistics.median(t), 2), "runs_s": [round(s, 2) for s in t]}
                   for tree, t in times.items()},
                "only_after": sorted(modules["after"] - modules["before"]),
                "only_before": sorted(modules["before"] - modules["after"]),
            }
            print(name, json.dumps(result["commands"][name]["before"]), json.dumps(result["commands"][name]["after"]),
                  file=sys.stderr, flush=True)
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
