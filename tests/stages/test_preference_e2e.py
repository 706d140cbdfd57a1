"""Stages rm / dpo / kto end to end through `tunelab train`, from the SFT'd tiny model: a few steps each,
then the saved output loads back the documented way and reproduces the figures the run reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from tests.precisions import autocast
from tunelab.cli import main
from tunelab.config.args import DataArguments
from tunelab.data.collate import PairedCollator
from tunelab.data.formats import to_canonical
from tunelab.data.pairwise import preference_encoder
from tunelab.data.dataset_files import load_rows
from tunelab.data.registry import load_registry
from tunelab.data.templates import get_template
from tunelab.model.reward import load_reward_model
from tunelab.run_folder import read_log
from tunelab.train.preference_trainer import batch_log_probs

pytestmark = pytest.mark.slow
HELD_OUT = 16


def train(tmp_path: Path, sft_model_dir: Path, name: str, **options) -> Path:
    out = tmp_path / name
    config = {
        "model_name_or_path": str(sft_model_dir), "template": "chatml", "dataset": "demo_preference",
        "eval_dataset": "demo_preference_test", "max_samples": HELD_OUT, "cutoff_len": 64,
        "per_device_train_batch_size": 4, "per_device_eval_batch_size": HELD_OUT, "max_steps": 2,
        "logging_steps": 1, "learning_rate": 1e-3, "seed": 0, "disable_tqdm": True, "plot_loss": False,
        "output_dir": str(out), **options,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 0
    return out


def held_out_batch(out: Path) -> dict:
    """The run's held-out pairs, encoded and collated as training does, with the saved tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(out)
    spec = load_registry()["demo_preference_test"]
    rows, _ = to_canonical(load_rows(spec).select(range(HELD_OUT)), spec)
    encoder = preference_encoder("dpo", tokenizer, get_template("chatml", tokenizer), DataArguments(cutoff_len=64))
    pairs = rows.map(encoder, batched=True, remove_columns=rows.column_names)
    return PairedCollator(tokenizer.pad_token_id)(list(pairs.select_columns(
        ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"])))


def rewards_of(model, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)


def results(out: Path) -> dict:
    return json.loads((out / "all_results.json").read_text())


def test_rm_full_saves_a_sequence_classifier(tmp_path, sft_model_dir, precision):
    out = train(tmp_path, sft_model_dir, "rm-full", stage="rm", finetuning_type="full")
    batch = held_out_batch(out)
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id == 0
    with autocast(precision):  # as the run evaluated (float32 master weights saved, bf16 autocast)
        rewards = rewards_of(model, batch)
        reloaded = load_reward_model(out)
        assert torch.equal(rewards_of(reloaded, batch), rewards)
    assert reloaded.use_kernels is False  # transformers' own default would turn Hub kernels on
    chosen, rejected = rewards.chunk(2)
    reported = results(out)
    assert (chosen > rejected).float().mean().item() == reported["reward_accuracy_after"]
    assert (chosen - rejected).mean().item() == pytest.approx(reported["after_margin"], abs=1e-5)
    assert "reward_accuracy_before" in reported
    train_lines = [r for r in read_log(out) if "loss" in r]
    assert {"accuracy", "margin", "rewards/chosen", "rewards/rejected"} <= set(train_lines[0])


def test_rm_lora_saves_an_adapter_with_the_head(tmp_path, sft_model_dir):
    out = train(tmp_path, sft_model_dir, "rm-lora", stage="rm", finetuning_type="lora", lora_rank=4)
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS" and "score" in adapter["modules_to_save"]
    assert Path(adapter["base_model_name_or_path"]) == sft_model_dir
    batch = held_out_batch(out)
    base = AutoModelForSequenceClassification.from_pretrained(sft_model_dir, num_labels=1, pad_token_id=0)
    rewards = rewards_of(PeftModel.from_pretrained(base, out).eval(), batch)
    assert rewards_of(load_reward_model(out), batch).tolist() == pytest.approx(rewards.tolist(), abs=1e-5)
    chosen, rejected = rewards.chunk(2)
    assert (chosen > rejected).float().mean().item() == results(out)["reward_accuracy_after"]


def policy_accuracy(model, batch: dict) -> float:
    with torch.no_grad():
        logps, _ = batch_log_probs(model, batch)
    chosen, rejected = logps.chunk(2)
    return (chosen > rejected).float().mean().item()


def test_dpo_lora_with_precomputed_reference(tmp_path, sft_model_dir):
    out = train(
        tmp_path, sft_model_dir, "dpo-lora", stage="dpo", finetuning_type="lora", lora_rank=4,
        precompute_ref_log_probs=True, pref_ftx=0.5, eval_generation=True, eval_generation_samples=4,
        max_new_tokens=12,
    )
    base = AutoModelForCausalLM.from_pretrained(sft_model_dir)
    model = PeftModel.from_pretrained(base, out).eval()
    reported = results(out)
    assert policy_accuracy(model, held_out_batch(out)) == reported["preference_accuracy_after"]
    assert {"exact_match_before", "exact_match_after", "preference_accuracy_before"} <= set(reported)
    log = read_log(out)
    metrics = {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"}
    assert metrics <= set(next(r for r in log if "loss" in r))
    assert {f"after_{m}" for m in metrics} <= set(reported)


def test_dpo_full_with_reference_copy(tmp_path, sft_model_dir, precision):
    out = train(tmp_path, sft_model_dir, "dpo-full", stage="dpo", finetuning_type="full", learning_rate=1e-4)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    reported = results(out)
    with autocast(precision):
        assert policy_accuracy(model, held_out_batch(out)) == reported["preference_accuracy_after"]
    first, second = [r for r in read_log(out) if "loss" in r]
    # Step 1's forward: the policy still is its frozen reference (same weights, same dtype). Under bf16 autocast the
    # policy's forward (with gradients) and the reference's (without) may take other bf16 kernels: measured 1.2e-3.
    assert abs(first["rewards/margins"]) <= {"fp32": 0.0, "bf16": 1e-2}[precision]
    assert abs(second["rewards/margins"]) > abs(first["rewards/margins"]) + 1e-3  # step 2: it moved away (4.6e-3)


def test_kto_full(tmp_path, sft_model_dir):
    out = train(tmp_path, sft_model_dir, "kto-full", stage="kto", finetuning_type="full", learning_rate=1e-4)
    AutoModelForCausalLM.from_pretrained(out)
    first = next(r for r in read_log(out) if "loss" in r)
    assert {"rewards/chosen", "rewards/rejected", "kl"} <= set(first)
    report = json.loads((out / "data_report.json").read_text())
    assert report["train"]["examples"] == 2 * HELD_OUT  # each pair: a desirable and an undesirable example
