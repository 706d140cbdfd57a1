"""Peak RSS of the streaming pt data path on 1 GB and 4 GB synthetic corpora: it should stay flat.

Generates plain-text corpora (one document per line, English-like sentences from tunelab's corpus
generator) into bench/.data/ (git-ignored), then, for each corpus in a fresh subprocess, runs the
train-time data path of `streaming: true` with no model: UTF-8 check → read → tokenise (embedded tiny
tokenizer) → windows → shuffle buffer → DataLoader + SupervisedCollator batches, until a fixed token
budget is consumed. A thread samples the process RSS (psutil, else /proc/self/status VmRSS) every
0.1 s; ru_maxrss gives the true peak. Printed: RSS against tokens processed per corpus, and the ratio
of peak RSS 4 GB / 1 GB (flat ≈ 1.00).

With --map-mb N it also compares peak RSS and disk against the map-style path (Arrow files under
bench/.data/hf-cache) on a small N MB corpus, both processing the whole corpus.

    python bench/streaming_rss.py                 # 1 GB and 4 GB, 24M tokens each, + 16 MB map-style
    python bench/streaming_rss.py --sizes 1 --tokens 5e6 --map-mb 0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
DATA_DIR = BENCH_DIR / ".data"
MB = 1 << 20


# --- corpora --------------------------------------------------------------------------------------


def corpus_path(size_mb: int) -> Path:
    return DATA_DIR / f"corpus-{size_mb}mb.txt"


def make_corpus(size_mb: int) -> Path:
    """A size_mb text file of random documents drawn (with their order random) from a pool of 50k."""
    from tunelab.data.corpus import generate

    path = corpus_path(size_mb)
    if path.is_file() and path.stat().st_size >= size_mb * MB:
        return path
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    pool = [row["text"] for row in generate("corpus", "train", 50_000, seed=size_mb)]
    rng = random.Random(size_mb)
    written, target = 0, size_mb * MB
    partial = path.with_suffix(".partial")
    with open(partial, "w", encoding="utf-8") as out:
        while written < target:
            chunk = "\n".join(rng.choices(pool, k=20_000)) + "\n"
            out.write(chunk)
            written += len(chunk)
    partial.rename(path)
    return path


def register(paths: list[Path]) -> None:
    info = {path.stem: {"file_name": path.name, "formatting": "text"} for path in paths}
    (DATA_DIR / "dataset_info.json").write_text(json.dumps(info, indent=1))


# --- the measured process --------------------------------------------------------------------------


def rss_mb() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / MB
    except ImportError:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Sampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.running = rss_mb(), True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss_mb())
            time.sleep(0.1)


def worker(args: argparse.Namespace) -> None:
    """One path on one corpus; prints one JSON line."""
    import torch
    from transformers import AutoTokenizer

    from tunelab.assets import TINY_MODEL_DIR
    from tunelab.config.args import DataArguments
    from tunelab.data.collate import SupervisedCollator
    from tunelab.data.pretrain import build_pretrain_datasets
    from tunelab.data.streaming import pretrain_stream, shuffled

    tokenizer = AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
    data_args = DataArguments(dataset_dir=str(DATA_DIR), dataset=[args.corpus], cutoff_len=args.cutoff_len,
                              buffer_size=args.buffer_size, streaming=args.mode == "streaming")
    baseline = rss_mb()
    sampler = Sampler()
    sampler.start()
    start = time.time()
    if args.mode == "streaming":
        stream = pretrain_stream(data_args, tokenizer, seed=0)  # includes the UTF-8 pass over the whole file
        dataset = shuffled(stream, args.buffer_size, seed=0, repeat=args.tokens > 0)
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, collate_fn=SupervisedCollator(0))
    else:
        windows = build_pretrain_datasets(data_args, tokenizer, seed=0).train
        loader = torch.utils.data.DataLoader(windows, batch_size=args.batch_size, shuffle=True,
                                             collate_fn=SupervisedCollator(0))
    ready = time.time() - start
    budget = args.tokens or float("inf")
    step = args.tokens / 10 if args.tokens else float("inf")
    tokens, next_mark, marks = 0, step, []
    for batch in loader:
        tokens += int(batch["attention_mask"].sum())
        if tokens >= next_mark:
            marks.append((tokens, round(rss_mb(), 1)))
            next_mark += step
        if tokens >= budget:
            break
    elapsed = time.time() - start
    sampler.running = False
    sampler.join()
    print(json.dumps({
        "corpus": args.corpus, "mode": args.mode, "tokens": tokens, "seconds": round(elapsed, 1),
        "ready_seconds": round(ready, 1), "baseline_mb": round(baseline, 1), "peak_mb": round(sampler.peak, 1),
        "maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), "marks": marks,
    }))


def run_worker(mode: str, corpus: str, args: argparse.Namespace, tokens: int, env: dict) -> dict:
    command = [sys.executable, __file__, "--worker", mode, "--corpus", corpus, "--tokens", str(tokens),
               "--cutoff-len", str(args.cutoff_len), "--buffer-size", str(args.buffer_size),
               "--batch-size", str(args.batch_size)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{mode} on {corpus} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def folder_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / MB if path.exists() else 0.0


# --- the report -----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,4", help="corpus sizes in GB, comma separated")
    parser.add_argument("--tokens", type=float, default=24e6, help="token budget per corpus (0: one whole pass)")
    parser.add_argument("--cutoff-len", type=int, default=1024)
    parser.add_argument("--buffer-size", type=int, default=4096, help="shuffle buffer, in windows")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--map-mb", type=int, default=16, help="size of the map-style comparison corpus (0: skip)")
    parser.add_argument("--worker", choices=["streaming", "map"], help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.tokens = int(args.tokens)
    if args.worker:
        args.mode = args.worker
        return worker(args)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(DATA_DIR / "hf-cache"), "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    sizes = [int(s) for s in args.sizes.split(",")]
    t0 = time.time()
    paths = [make_corpus(gb * 1024) for gb in sizes] + ([make_corpus(args.map_mb)] if args.map_mb else [])
    register(paths)
    sized = ", ".join(f"{p.name} ({p.stat().st_size / MB:.0f} MB)" for p in paths)
    print(f"corpora ready in {time.time() - t0:.0f} s: {sized}")
    print(f"streaming pt: cutoff_len {args.cutoff_len}, buffer_size {args.buffer_size} windows, "
          f"batch {args.batch_size}, token budget {args.tokens / 1e6:.1f}M per corpus; RSS in MB\n")

    results = [run_worker("streaming", corpus_path(gb * 1024).stem, args, args.tokens, env) for gb in sizes]
    print(f"{'corpus':<18}{'tokens':>12}{'tok/s':>10}{'ready s':>9}{'baseline':>10}{'peak':>8}{'ru_maxrss':>11}")
    for r in results:
        print(f"{r['corpus']:<18}{r['tokens']:>12,}{r['tokens'] / r['seconds']:>10,.0f}{r['ready_seconds']:>9}"
              f"{r['baseline_mb']:>10}{r['peak_mb']:>8}{r['maxrss_mb']:>11}")
    print("\nRSS after N tokens: " + "  ".join(r["corpus"] for r in results))
    for row in zip(*(r["marks"] for r in results)):
        print(f"  {row[0][0] / 1e6:6.1f}M  " + "  ".join(f"{rss:>10}" for _, rss in row))
    if len(results) > 1:
        print(f"\npeak RSS {results[-1]['corpus']} / {results[0]['corpus']}: "
              f"{results[-1]['maxrss_mb'] / results[0]['maxrss_mb']:.2f} (ru_maxrss), "
              f"{results[-1]['peak_mb'] / results[0]['peak_mb']:.2f} (sampled)")

    if args.map_mb:
        cache = DATA_DIR / "hf-cache"
        shutil.rmtree(cache, ignore_errors=True)
        name = corpus_path(args.map_mb).stem
        mapped = run_worker("map", name, args, 0, env)
        disk = folder_mb(cache)
        streamed = run_worker("streaming", name, args, 0, env)
        print(f"\nwhole {args.map_mb} MB corpus, map-style vs streaming:")
        print(f"{'path':<12}{'tokens':>12}{'seconds':>9}{'peak':>8}{'ru_maxrss':>11}{'disk MB':>9}")
        for label, r, mb in (("map-style", mapped, disk), ("streaming", streamed, 0.0)):
            print(f"{label:<12}{r['tokens']:>12,}{r['seconds']:>9}{r['peak_mb']:>8}{r['maxrss_mb']:>11}{mb:>9.0f}")
        shutil.rmtree(cache, ignore_errors=True)
    print(f"\ntotal {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
