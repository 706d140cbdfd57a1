"""Preprocessing throughput on a large SFT set, by preprocessing_num_workers.

Writes `--rows` alpaca rows into bench/.data/sft_large/ (the rows of bench/.data/peers/sft.json repeated, each with
its row number in the instruction so no two are equal), then builds the train set as `tunelab train` does before
training (`cached_bundle`: read, convert, tokenise, write the tokenized cache) in a fresh process with an empty
cache, once per workers setting ("default" leaves preprocessing_num_workers unset: tunelab's own choice, logged).

    python bench/inputs.py && python bench/preprocessing.py --rows 200000 --workers 1,2,default

Prints one line per setting and a JSON object (rows/s, seconds, the workers tunelab chose).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
SOURCE = BENCH / ".data" / "peers" / "sft.json"
OUT = BENCH / ".data" / "sft_large"

BUILD = """
import json, logging, os, sys, time
logging.basicConfig(level=logging.INFO, format="%(message)s")
from tunelab.preflight import load_config
from tunelab.data.cache import cached_bundle
from tunelab.data.pipeline import build_datasets
from tunelab.data.templates import get_template
from tunelab.model.tokenizer import load_tokenizer
options = json.loads(sys.argv[1])
config = load_config(None, options, purpose="data")
tokenizer = load_tokenizer(config.model)
template = get_template(config.data.template, tokenizer)
start = time.perf_counter()
bundle = cached_bundle(config.data, tokenizer, template.jinja, "sft", 0,
                       build=lambda: build_datasets(config.data, tokenizer, template, seed=0))
print("RESULT", json.dumps({"seconds": time.perf_counter() - start, "examples": len(bundle.train)}))
"""


def write_rows(rows: int) -> Path:
    path = OUT / f"sft_{rows}.json"
    if path.exists():
        return path
    base = json.loads(SOURCE.read_text(encoding="utf-8"))
    OUT.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        f.write("[")
        for i in range(rows):
            row = dict(base[i % len(base)])
            row["instruction"] = f"({i}) {row['instruction']}"
            f.write(("," if i else "") + json.dumps(row, ensure_ascii=False))
        f.write("]")
    (OUT / "dataset_info.json").write_text(json.dumps(
        {f"sft_{n.stem.split('_')[1]}": {"file_name": n.name} for n in OUT.glob("sft_*.json")}, indent=1))
    return path


def build(rows: int, workers: str, model: Path) -> dict:
    options = {"model_name_or_path": str(model), "dataset": f"sft_{rows}", "dataset_dir": str(OUT), "template": "chatml",
               "cutoff_len": 512, "stage": "sft", "output_dir": "unused"}
    if workers != "default":
        options["preprocessing_num_workers"] = int(workers)
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TUNELAB_CACHE": cache, "HF_DATASETS_CACHE": str(Path(cache) / "hf")}
        launched = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", BUILD, json.dumps(options)], capture_output=True, text=True,
                              env=env, check=False)
        wall = time.perf_counter() - launched
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))[len("RESULT "):])
    chose = [line for line in done.stderr.splitlines() if "tokenising with" in line]
    return {"workers": workers, "rows": rows, "seconds": round(result["seconds"], 2), "launch_s": round(wall, 2),
            "rows_per_s": round(rows / result["seconds"]), "examples": result["examples"],
            "tunelab_chose": chose[0].strip() if chose else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--workers", default="1,2,default")
    parser.add_argument("--model", type=Path, default=BENCH / ".data" / "peers" / "model")
    args = parser.parse_args()
    if not SOURCE.exists():
        raise SystemExit(f"{SOURCE} is missing: run python bench/inputs.py first")
    write_rows(args.rows)
    results = []
    for workers in args.workers.split(","):
        result = build(args.rows, workers, args.model)
        results.append(result)
        print(f"workers {workers:>7}: {result['rows_per_s']:>7,} rows/s ({result['seconds']} s for {args.rows:,} rows)"
              + (f"; {result['tunelab_chose']}" if result["tunelab_chose"] else ""), flush=True)
    print(json.dumps({"cpus": len(os.sched_getaffinity(0)), "results": results}, indent=1))


if __name__ == "__main__":
    main()
