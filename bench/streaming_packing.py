"""Packing efficiency of `streaming: true` against its look-ahead (buffer_size), beside map-style packing.

Streaming packs best-fit decreasing within each look-ahead of buffer_size samples (data/streaming.py);
map-style packs the whole set at once (data/packing.py). Prints real tokens / row capacity for each.

    python bench/streaming_packing.py                       # demo_multiturn + demo_reverse, cutoff_len 512
    python bench/streaming_packing.py --dataset demo_sort --cutoff-len 256 --samples 4000
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="demo_multiturn,demo_reverse")
    parser.add_argument("--cutoff-len", type=int, default=512)
    parser.add_argument("--samples", type=int, default=2000, help="max_samples per dataset")
    parser.add_argument("--lookahead", default="8,32,128,512,2048")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from tunelab.assets import TINY_MODEL_DIR
    from tunelab.config.args import DataArguments
    from tunelab.data.pipeline import build_datasets
    from tunelab.data.streaming import supervised_stream
    from tunelab.data.templates import get_template

    tokenizer = AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
    template = get_template(None, tokenizer)
    options = {"dataset": args.dataset.split(","), "max_samples": args.samples, "cutoff_len": args.cutoff_len}
    report = build_datasets(DataArguments(**options, packing=True), tokenizer, template, seed=0).report
    mapped = report["packing"]["train"]
    print(f"{args.dataset}, cutoff_len {args.cutoff_len}: {mapped['samples']} samples, {mapped['tokens']:,} tokens")
    print(f"{'packing':<24}{'rows':>8}{'efficiency':>12}")
    print(f"{'map-style (whole set)':<24}{mapped['rows']:>8}{100 * mapped['efficiency']:>11.2f}%")
    for lookahead in (int(n) for n in args.lookahead.split(",")):
        data_args = DataArguments(**options, packing=True, streaming=True, buffer_size=lookahead)
        lengths = [len(row["input_ids"]) for row in supervised_stream(data_args, tokenizer, template, seed=0)]
        efficiency = np.sum(lengths) / (len(lengths) * args.cutoff_len)
        print(f"{f'streaming, look-ahead {lookahead}':<24}{len(lengths):>8}{100 * efficiency:>11.2f}%")


if __name__ == "__main__":
    main()
