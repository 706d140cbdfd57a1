"""Gradient accumulation must not change the loss or the gradients (PEERS.md row 6).

One SGD step with lr=1 and no clipping moves every weight by exactly its gradient, so comparing
weights after one step of `accumulation 4 x micro-batch 2` with one step of `batch 8` compares the
gradients; the logged loss is compared too. Examples have very different lengths and supervised
counts, which is where a per-micro-batch mean goes wrong.
"""

from __future__ import annotations

import datasets
import pytest
import torch
import transformers

from tunelab.data.collate import SupervisedCollator
from tunelab.train.losses import causal_lm_loss
from tunelab.train.trainer import TunelabTrainer

VOCAB = 64


def tiny_model() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(config).float()


def examples() -> datasets.Dataset:
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(8):
        length = 5 + 7 * i  # 5 .. 54 tokens
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        prompt = 2 + (i * 5) % (length - 2)  # supervised part differs per example
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return datasets.Dataset.from_list(rows)


# (loss, gradients) per precision: bf16 autocast rounds each matmul's output, and micro-batches of 2 round other
# partial sums than a batch of 8 (-s prints the measured gaps).
TOLERANCE = {"fp32": (1e-5, 1e-5), "bf16": (1e-4, 1e-3)}  # measured bf16: loss 1.9e-6, grads 2.2e-4


def one_step(tmp_path, micro_batch: int, accumulation: int, precision: str = "fp32") -> tuple[dict, float]:
    model = tiny_model()  # float32 weights: under bf16, autocast computes in bf16 over them (master weights)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / f"mb{micro_batch}"), per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=1.0, optim="sgd",
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1,
        report_to="none", save_strategy="no", remove_unused_columns=False, use_cpu=True, seed=0,
        disable_tqdm=True, bf16=precision == "bf16",
    )
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer = TunelabTrainer(model=model, args=args, train_dataset=examples(), data_collator=SupervisedCollator(0))
    trainer.train()
    grads = {k: before[k] - v.detach() for k, v in model.named_parameters()}
    loss = next(log["loss"] for log in trainer.state.log_history if "loss" in log)
    return grads, loss


def test_accumulation_equals_big_batch(tmp_path, precision):
    grads_big, loss_big = one_step(tmp_path, micro_batch=8, accumulation=1, precision=precision)
    grads_acc, loss_acc = one_step(tmp_path, micro_batch=2, accumulation=4, precision=precision)
    worst = max((grads_big[k] - grads_acc[k]).abs().max().item() for k in grads_big)
    print(f"{precision}: loss {abs(loss_acc - loss_big):.1e}, grads {worst:.1e} apart")
    loss_tolerance, grad_tolerance = TOLERANCE[precision]
    assert loss_acc == pytest.approx(loss_big, abs=loss_tolerance)
    assert worst < grad_tolerance
    assert max(g.abs().max().item() for g in grads_big.values()) > 1e-3  # the step really moved the weights


def test_loss_is_mean_over_supervised_tokens_of_the_step():
    model = tiny_model()
    batch = SupervisedCollator(0)(list(examples()))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
    )
    assert causal_lm_loss(logits, batch["labels"]).item() == pytest.approx(expected.item(), abs=1e-6)
    # With a step-wide count, the per-batch losses add up to the step's mean.
    halves = [slice(0, 4), slice(4, 8)]
    count = (batch["labels"][:, 1:] != -100).sum()
    total = sum(causal_lm_loss(logits[h], batch["labels"][h], count) for h in halves)
    assert total.item() == pytest.approx(expected.item(), abs=1e-6)


def test_no_weight_decay_on_biases_and_norms(tmp_path):
    model = tiny_model()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, weight_decay=0.1)
    trainer = TunelabTrainer(model=model, args=args, train_dataset=examples(), data_collator=SupervisedCollator(0))
    trainer.create_optimizer()
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["weight_decay"]: sorted(names[id(p)] for p in g["params"]) for g in trainer.optimizer.param_groups}
    assert all("norm" in n for n in groups[0.0])
    assert "model.norm.weight" in groups[0.0] and "model.layers.0.input_layernorm.weight" in groups[0.0]
    assert all("norm" not in n for n in groups[0.1])
    assert "model.layers.0.self_attn.q_proj.weight" in groups[0.1]
