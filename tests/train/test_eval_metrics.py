"""Evaluation metrics of the Trainer, per eval set, against a direct computation one example at a time."""

from __future__ import annotations

import math

import datasets
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from tunelab.config.training_options import TRAINING_DEFAULTS
from tunelab.config.training_args import TrainingArguments
from tunelab.data.collate import SupervisedCollator
from tunelab.train.trainer import TunelabTrainer


def _eval_set(model, lengths: list[int], seed: int) -> tuple[datasets.Dataset, int, int]:
    """Rows whose labels are the model's own argmax at even positions and a sure miss at odd ones.

    Returns (rows, supervised tokens, tokens the model predicts right): the accuracy is known by construction.
    """
    generator = torch.Generator().manual_seed(seed)
    rows, supervised, right = [], 0, 0
    for length in lengths:
        ids = torch.randint(3, 256, (length,), generator=generator)
        with torch.no_grad():
            greedy = model(input_ids=ids[None]).logits[0].argmax(-1)
        labels = [-100, -100]  # the first two tokens are "prompt"
        for t in range(2, length):
            labels.append(int(greedy[t - 1]) if t % 2 == 0 else int(greedy[t - 1] + 1) % 256)
            supervised, right = supervised + 1, right + (t % 2 == 0)
        rows.append({"input_ids": ids.tolist(), "labels": labels})
    return datasets.Dataset.from_list(rows), supervised, right


def _direct(model, rows: datasets.Dataset) -> tuple[float, int]:
    """Summed next-token cross-entropy and supervised count, each example alone (no padding)."""
    nll, count = 0.0, 0
    for row in rows:
        ids, labels = torch.tensor([row["input_ids"]]), torch.tensor(row["labels"])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].double()
        nll += F.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="sum").item()
        count += int((labels[1:] != -100).sum())
    return nll, count


def test_eval_loss_perplexity_and_token_accuracy_per_eval_set(tiny_llama_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    sets = {"short": _eval_set(model, [5, 6, 7, 12, 9], seed=0), "long": _eval_set(model, [30, 8, 17], seed=1)}
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=2, use_cpu=True, compute_token_accuracy=True,
        **TRAINING_DEFAULTS,
    )
    trainer = TunelabTrainer(
        model=model, args=args, eval_dataset={name: rows for name, (rows, _, _) in sets.items()},
        data_collator=SupervisedCollator(pad_token_id=0),
    )
    metrics = trainer.evaluate()
    for name, (rows, supervised, right) in sets.items():
        nll, count = _direct(model, rows)
        assert count == supervised
        assert metrics[f"eval_{name}_loss"] == pytest.approx(nll / count, rel=1e-6)
        assert metrics[f"eval_{name}_perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-6)
        assert metrics[f"eval_{name}_perplexity"] == math.exp(metrics[f"eval_{name}_loss"])
        assert metrics[f"eval_{name}_token_accuracy"] == right / supervised
    # The loss is per token of the whole set, not a mean of batch means (which would weigh rows unequally).
    rows = sets["long"][0]
    batch_means = [_direct(model, rows.select(range(i, min(i + 2, len(rows))))) for i in range(0, len(rows), 2)]
    mean_of_means = sum(n / c for n, c in batch_means) / len(batch_means)
    assert mean_of_means != pytest.approx(metrics["eval_long_loss"], rel=1e-5)
    # Every evaluation is logged with its perplexity, and no logits were kept across batches.
    logged = [r for r in trainer.state.log_history if "eval_short_loss" in r]
    assert logged and "eval_short_perplexity" in logged[-1]


def test_token_accuracy_is_off_by_default(tiny_llama_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    rows, _, _ = _eval_set(model, [6, 9], seed=2)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=2, use_cpu=True, **TRAINING_DEFAULTS)
    trainer = TunelabTrainer(model=model, args=args, eval_dataset=rows, data_collator=SupervisedCollator(pad_token_id=0))
    metrics = trainer.evaluate()
    assert {"eval_loss", "eval_perplexity"} <= set(metrics) and "eval_token_accuracy" not in metrics
    assert args.prediction_loss_only
