"""Per-step cost of TunelabTrainer against plain transformers.Trainer on identical work, in one process.

Same model (random init from a model folder's config), same batches (fully supervised rows of random token ids,
as pt and packed SFT give), same optimizer and schedule; only the trainer class (and its loss function) differs.
Variants run interleaved, `--repeats` times each, and the median train_runtime of `--steps` optimizer steps is
reported (the Trainer's own figure: setup and model load excluded). `position_ids` variants feed each row as
several isolated documents, as tunelab's packed batches do; the plain variants are one causal row.

    python bench/trainer_overhead.py --steps 30 --repeats 3 [--model src/tunelab/assets/tiny-llama] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile

import torch
import transformers

from tunelab.train.trainer import TunelabTrainer


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int, documents: int):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, vocab, (n, length), generator=generator)
        self.length, self.documents = length, documents

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        row = {"input_ids": self.ids[i], "labels": self.ids[i].clone()}
        if self.documents > 1:  # isolated documents of equal length, position ids restarting at each
            size = self.length // self.documents
            row["position_ids"] = torch.arange(self.length) % size
        return row


def run(variant: str, args, model_dir: str) -> float:
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    config.use_cache = False
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    documents = args.documents if variant.endswith("position_ids") else 1
    data = Rows(args.batch_size * args.steps, args.length, config.vocab_size, documents)
    with tempfile.TemporaryDirectory() as out:
        training = transformers.TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch_size, learning_rate=1e-4,
            lr_scheduler_type="cosine", logging_steps=args.logging_steps, save_strategy="no", report_to="none",
            use_cpu=True, disable_tqdm=True, remove_unused_columns=False, dataloader_num_workers=0,
        )
        cls = TunelabTrainer if variant.startswith("tunelab") else transformers.Trainer
        trainer = cls(model=model, args=training, train_dataset=data,
                      data_collator=transformers.default_data_collator)
        if args.profile and variant.startswith("tunelab"):
            profiler = cProfile.Profile()
            profiler.enable()
            result = trainer.train()
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        else:
            result = trainer.train()
    return result.metrics["train_runtime"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder (default: the embedded tiny Llama)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--documents", type=int, default=4, help="isolated documents per row (position_ids variants)")
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--variants", default="hf,tunelab,hf_position_ids,tunelab_position_ids")
    parser.add_argument("--profile", action="store_true", help="cProfile the tunelab variants (25 top functions)")
    args = parser.parse_args()
    from tunelab.assets import TINY_MODEL_DIR  # noqa: PLC0415

    model_dir = args.model or str(TINY_MODEL_DIR)
    variants = args.variants.split(",")
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for variant in variants:  # interleaved: a load change on a shared machine hits every variant alike
            times[variant].append(run(variant, args, model_dir))
    medians = {v: statistics.median(t) for v, t in times.items()}
    print(json.dumps({"threads": torch.get_num_threads(), "steps": args.steps, "runs_s": times, "median_s": medians}))
    for variant in variants:
        base = "hf_position_ids" if variant.endswith("position_ids") else "hf"
        if base in medians and variant != base:
            print(f"{variant}: {medians[base] / medians[variant]:.3f}x {base} (median {medians[variant]:.2f} s "
                  f"vs {medians[base]:.2f} s for {args.steps} steps)")


if __name__ == "__main__":
    main()
