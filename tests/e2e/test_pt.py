"""Whole pt runs on the embedded tiny model through the real CLI: loss falls, outputs load back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tunelab.assets import TINY_MODEL_DIR
from tunelab.cli import main
from tunelab.config.args import DataArguments
from tunelab.data.collate import SupervisedCollator
from tunelab.data.pretrain import build_pretrain_datasets
from tunelab.run_folder import read_log
from tunelab.train.losses import causal_lm_loss

CUTOFF = 64


def run_train(tmp_path: Path, **options) -> Path:
    out = tmp_path / "out"
    config = {
        "model_name_or_path": "tiny", "stage": "pt", "dataset": "demo_corpus", "max_samples": 300,
        "cutoff_len": CUTOFF, "stride": 48, "output_dir": str(out), "per_device_train_batch_size": 8,
        "max_steps": 12, "learning_rate": 3e-3, "logging_steps": 4, "seed": 0, "disable_tqdm": True, **options,
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 0
    return out


def held_out_loss(model, tokenizer) -> float:
    args = DataArguments(dataset=["demo_corpus_test"], max_samples=16, cutoff_len=CUTOFF)
    windows = build_pretrain_datasets(args, tokenizer, seed=0).train
    batch = SupervisedCollator(tokenizer.pad_token_id)(list(windows))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return causal_lm_loss(logits, batch["labels"]).item()


def check_outputs(out: Path, loss_ratio: float) -> None:
    for name in ("tunelab_config.yaml", "data_report.json", "all_results.json", "run_info.json",
                 "trainer_log.jsonl", "training_loss.png", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file(), name
    losses = [r["loss"] for r in read_log(out) if "loss" in r]
    assert len(losses) == 3 and losses[-1] < loss_ratio * losses[0]
    tokenizer = AutoTokenizer.from_pretrained(out)
    # pt trains without a chat template: the tokenizer is saved as it was loaded
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(TINY_MODEL_DIR).chat_template
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id
    report = json.loads((out / "data_report.json").read_text())
    assert report["sources"][0]["kept"] == 300
    assert report["train"]["full_windows"] == (report["train"]["tokens"] - CUTOFF) // 48 + 1


@pytest.mark.slow
def test_full_pt_learns_and_saves_a_plain_model(tmp_path, precision):
    out = run_train(tmp_path, finetuning_type="full")
    check_outputs(out, loss_ratio=0.8)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tuned = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
    assert held_out_loss(tuned, tokenizer) < 0.8 * held_out_loss(base, tokenizer)


@pytest.mark.slow
def test_lora_pt_with_val_split_reports_perplexity_and_adapter_loads(tmp_path):
    from peft import PeftModel

    out = run_train(tmp_path, finetuning_type="lora", lora_rank=16, learning_rate=1e-2, val_size=8,
                    eval_strategy="steps", eval_steps=12)
    check_outputs(out, loss_ratio=1.0)  # LoRA moves slower than full training: falling is enough here
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    metrics = json.loads((out / "all_results.json").read_text())
    assert metrics["eval_perplexity"] == pytest.approx(torch.tensor(metrics["eval_loss"]).exp().item(), rel=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(out)
    base_loss = held_out_loss(AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR), tokenizer)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR), out)
    assert held_out_loss(tuned, tokenizer) < 0.95 * base_loss
