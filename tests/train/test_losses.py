"""label_smoothing_factor in the causal-LM loss: torch's smoothed cross-entropy per supervised token, normalised
per optimizer step like the plain loss (so accumulation still equals one big batch); refused where it has no
meaning (the preference and generating stages)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
import yaml

from tests.train.test_accumulation import VOCAB, examples, tiny_model
from tunelab.preflight import load_config
from tunelab.data.collate import SupervisedCollator
from tunelab.errors import ConfigError
from tunelab.train.losses import CausalLMLoss, causal_lm_loss, causal_lm_loss_func
from tunelab.train.trainer import TunelabTrainer


def logits_and_labels() -> tuple[torch.Tensor, torch.Tensor]:
    batch = SupervisedCollator(0)(list(examples()))
    with torch.no_grad():
        logits = tiny_model()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logits, batch["labels"]


@pytest.mark.parametrize("epsilon", [0.1, 0.3])
def test_smoothed_loss_is_torch_label_smoothing_over_supervised_tokens(epsilon):
    logits, labels = logits_and_labels()
    flat_logits, flat_labels = logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1)
    expected = torch.nn.functional.cross_entropy(flat_logits, flat_labels, ignore_index=-100, label_smoothing=epsilon)
    assert causal_lm_loss(logits, labels, label_smoothing=epsilon).item() == pytest.approx(expected.item(), abs=1e-6)
    # the same by hand: (1 - eps) * nll of the label + eps * mean over the vocabulary of -log p
    supervised = flat_labels != -100
    log_probs = flat_logits[supervised].log_softmax(-1)
    nll = -log_probs.gather(1, flat_labels[supervised, None]).squeeze(1)
    by_hand = ((1 - epsilon) * nll - epsilon * log_probs.mean(-1)).mean()
    assert expected.item() == pytest.approx(by_hand.item(), abs=1e-6)
    assert abs(expected.item() - causal_lm_loss(logits, labels).item()) > 5e-4  # the factor is not ignored


def test_smoothed_loss_adds_up_over_micro_batches_with_a_step_wide_count():
    logits, labels = logits_and_labels()
    count = (labels[:, 1:] != -100).sum()
    halves = sum(causal_lm_loss(logits[part], labels[part], count, 0.3) for part in (slice(0, 3), slice(3, 8)))
    assert halves.item() == pytest.approx(causal_lm_loss(logits, labels, label_smoothing=0.3).item(), abs=1e-6)


def one_step(tmp_path: Path, micro_batch: int, accumulation: int, epsilon: float) -> tuple[dict, float]:
    model = tiny_model()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / f"mb{micro_batch}-{epsilon}"), per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=1.0, optim="sgd",
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, report_to="none",
        save_strategy="no", remove_unused_columns=False, use_cpu=True, seed=0, disable_tqdm=True,
        label_smoothing_factor=epsilon,
    )
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer = TunelabTrainer(model=model, args=args, train_dataset=examples(), data_collator=SupervisedCollator(0))
    assert trainer.compute_loss_func == (CausalLMLoss(epsilon) if epsilon else causal_lm_loss_func)
    trainer.train()
    grads = {k: before[k] - v.detach() for k, v in model.named_parameters()}
    return grads, next(log["loss"] for log in trainer.state.log_history if "loss" in log)


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_training_uses_the_factor_and_accumulation_still_equals_one_batch(tmp_path):
    logits, labels = logits_and_labels()
    grads_big, loss_big = one_step(tmp_path, micro_batch=8, accumulation=1, epsilon=0.3)
    assert loss_big == pytest.approx(causal_lm_loss(logits, labels, label_smoothing=0.3).item(), abs=1e-4)
    _, loss_plain = one_step(tmp_path, micro_batch=8, accumulation=1, epsilon=0.0)
    assert loss_plain == pytest.approx(causal_lm_loss(logits, labels).item(), abs=1e-4)
    grads_acc, loss_acc = one_step(tmp_path, micro_batch=2, accumulation=4, epsilon=0.3)
    assert loss_acc == pytest.approx(loss_big, abs=1e-5)
    assert max((grads_big[k] - grads_acc[k]).abs().max().item() for k in grads_big) < 1e-5


@pytest.mark.parametrize(("stage", "dataset", "value", "message"), [
    ("dpo", "demo_preference", 0.1, "label_smoothing_factor smooths the token cross-entropy of stages sft and pt; "
     "stage dpo does not train on it: remove it (dpo_label_smoothing smooths the preference labels)"),
    ("rm", "demo_preference", 0.1, "label_smoothing_factor smooths the token cross-entropy of stages sft and pt; "
     "stage rm does not train on it: remove it"),
    ("sft", "demo_reverse", 1.0, "label_smoothing_factor must be in [0, 1), got 1.0"),
])
def test_label_smoothing_is_refused_where_it_means_nothing(tmp_path, stage, dataset, value, message):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({
        "model_name_or_path": "tiny", "stage": stage, "dataset": dataset, "template": "chatml",
        "output_dir": str(tmp_path / "out"), "label_smoothing_factor": value,
    }))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == message
