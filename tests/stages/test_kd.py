"""Stage kd (knowledge distillation): the generalised JSD against a hand computation, only at the answer tokens;
the teacher's tokenizer checked before any weights load; the same loss padded, padding-free and packed; the
teacher frozen and outside the optimizer; a short run on the tiny model that brings the student closer to its
teacher on held-out rows; the options' checks."""

from __future__ import annotations

import json
import math
import shutil

import datasets
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tunelab.assets import TINY_MODEL_DIR
from tunelab.cli import main
from tunelab.config.training_args import TrainingArguments
from tunelab.data.collate import PackedCollator, PaddingFreeCollator, SupervisedCollator
from tunelab.data.packing import pack_dataset
from tunelab.errors import ConfigError
from tunelab.preflight import load_config
from tunelab.train.distillation_losses import distillation_loss
from tunelab.train.distillation_trainer import DistillationTrainer, last_answer_start, split_examples

# ---- the loss against a hand computation -------------------------------------------------------------------

# One row of 4 positions over a vocabulary of 3. Position t predicts label t + 1: labels [-100, -100, 1, 2]
# supervise positions 1 and 2; positions 0 and 3 are not answer tokens and their logits are far apart on purpose.
STUDENT = [[5.0, -5.0, 0.0], [1.0, 2.0, 0.5], [0.0, 0.3, -1.0], [-4.0, 6.0, 0.0]]
TEACHER = [[-5.0, 5.0, 0.0], [0.5, 1.0, 2.0], [1.0, -0.5, 0.2], [6.0, -4.0, 1.0]]
LABELS = [-100, -100, 1, 2]


def _softmax(row: list[float], temperature: float) -> list[float]:
    exps = [math.exp(x / temperature) for x in row]
    return [e / sum(exps) for e in exps]


def _kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def _hand_jsd(student: list[float], teacher: list[float], beta: float, temperature: float) -> float:
    """The generalised JSD written out in plain Python (GKD's Eq. 1, TRL's beta convention)."""
    s, t = _softmax(student, temperature), _softmax(teacher, temperature)
    if beta == 0:
        return _kl(t, s)
    if beta == 1:
        return _kl(s, t)
    m = [beta * b + (1 - beta) * a for a, b in zip(s, t)]
    return beta * _kl(t, m) + (1 - beta) * _kl(s, m)


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5, 0.1])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_loss_is_the_generalised_jsd_of_the_answer_tokens_only(beta, temperature):
    expected = sum(_hand_jsd(STUDENT[t], TEACHER[t], beta, temperature) for t in (1, 2)) / 2
    everywhere = sum(_hand_jsd(STUDENT[t], TEACHER[t], beta, temperature) for t in range(4)) / 4
    assert abs(everywhere - expected) > 0.1  # a loss that ignored the mask would be far off
    loss = distillation_loss(torch.tensor([STUDENT]), torch.tensor([TEACHER]), torch.tensor([LABELS]), beta,
                             temperature)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_beta_zero_and_one_are_the_two_kls():
    student, teacher, labels = torch.tensor([STUDENT]), torch.tensor([TEACHER]), torch.tensor([LABELS])
    forward = distillation_loss(student, teacher, labels, beta=0.0)
    reverse = distillation_loss(student, teacher, labels, beta=1.0)
    swapped = distillation_loss(teacher, student, labels, beta=0.0)  # KL(student || teacher) with the roles swapped
    assert reverse.item() == pytest.approx(swapped.item(), abs=1e-6) and forward.item() != pytest.approx(reverse.item())


def test_chunks_and_kept_positions_give_the_same_loss_and_gradient():
    g = torch.Generator().manual_seed(0)
    student = torch.randn(2, 9, 50, generator=g, requires_grad=True)
    teacher = torch.randn(2, 9, 50, generator=g)
    labels = torch.randint(0, 50, (2, 9), generator=g)
    labels[0, :4], labels[1, :2], labels[1, 7:] = -100, -100, -100
    whole = distillation_loss(student, teacher, labels, 0.3, 1.5, num_items_in_batch=7)
    (grad,) = torch.autograd.grad(whole, student)
    chunked = distillation_loss(student, teacher, labels, 0.3, 1.5, num_items_in_batch=7, chunk=2)
    (chunked_grad,) = torch.autograd.grad(chunked, student)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[:, :-1] = labels[:, 1:] != -100
    kept = distillation_loss(student[mask], teacher[mask], labels, 0.3, 1.5, num_items_in_batch=7, chunk=3)
    (kept_grad,) = torch.autograd.grad(kept, student)
    assert chunked.item() == pytest.approx(whole.item(), abs=1e-6)
    assert kept.item() == pytest.approx(whole.item(), abs=1e-6)
    assert torch.allclose(chunked_grad, grad, atol=1e-7) and torch.allclose(kept_grad, grad, atol=1e-7)
    assert grad[~mask].abs().max() == 0  # no gradient where no answer token is predicted


# ---- the trainer: same inputs to both models, packed / padding-free / padded, the teacher frozen ---------------


def _teacher_of(student: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """A teacher that differs from the student: the tiny model with its weights moved by seeded noise."""
    teacher = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    teacher.config.use_cache = False
    return teacher


def _samples() -> list[dict]:
    g = torch.Generator().manual_seed(2)
    rows = []
    for i in range(6):
        length = 6 + 7 * i
        ids = torch.randint(3, 864, (length,), generator=g).tolist()
        prompt = 2 + (i * 5) % (length - 3)
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


@pytest.fixture
def trainer(tmp_path):
    student = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32)
    student.config.use_cache = False
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no",
                             remove_unused_columns=False, disable_tqdm=True)
    return DistillationTrainer(model=student, args=args, teacher=_teacher_of(student), beta=0.5, temperature=1.0)


def test_padded_padding_free_and_packed_batches_give_the_same_loss(trainer):
    student, rows = trainer.model.eval(), _samples()
    packed = PackedCollator.for_model(student, pad_token_id=0)
    padded = SupervisedCollator(pad_token_id=0)(rows)
    side_by_side = PaddingFreeCollator(packed)(rows)
    packed_rows, _ = pack_dataset(datasets.Dataset.from_list(rows), 64)
    in_packs = packed(packed_rows.to_list())
    assert "attention_mask" in padded and "position_ids" in side_by_side and "position_ids" in in_packs
    with torch.no_grad():
        losses = [trainer.compute_loss(student, batch).item() for batch in (padded, side_by_side, in_packs)]
    assert losses[0] > 0.01
    assert losses[1] == pytest.approx(losses[0], abs=1e-5) and losses[2] == pytest.approx(losses[0], abs=1e-5)


def test_the_teacher_is_frozen_and_outside_the_optimizer(trainer):
    teacher = trainer.teacher
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    optimized = {id(p) for group in trainer.create_optimizer().param_groups for p in group["params"]}
    assert optimized and not optimized & {id(p) for p in teacher.parameters()}
    batch = SupervisedCollator(pad_token_id=0)(_samples())
    trainer.model.train()
    trainer.compute_loss(trainer.model, batch).backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert any(p.grad is not None for p in trainer.model.parameters())


# ---- the workflow through the CLI ------------------------------------------------------------------------------

KD_CONFIG = {
    "model_name_or_path": "tiny", "stage": "kd", "finetuning_type": "full", "template": "chatml",
    "dataset": "demo_sort", "max_samples": 320, "val_size": 32, "cutoff_len": 64, "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 16, "learning_rate": 2e-3, "lr_scheduler_type": "constant", "max_steps": 15,
    "logging_steps": 5, "beta": 0.5, "seed": 0, "report_to": "none", "disable_tqdm": True, "plot_loss": False,
}


def _write(tmp_path, **options) -> str:
    config = tmp_path / "kd.yaml"
    config.write_text(yaml.safe_dump({**KD_CONFIG, "output_dir": str(tmp_path / "run"), **options}))
    return str(config)


@pytest.mark.slow  # the SFT'd teacher (a 60-step session fixture) and 15 steps through two models
def test_a_short_distillation_brings_the_student_closer_to_its_teacher(sft_model_dir, tmp_path, capsys):
    """Teacher: the tiny model after a short SFT (tests/stages/conftest.py); student: the tiny model before it."""
    assert main(["train", _write(tmp_path, teacher_model_name_or_path=str(sft_model_dir))]) == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "run" / "all_results.json").read_text())
    before, after = results["distillation_loss_before"], results["distillation_loss_after"]
    assert after < 0.7 * before, (before, after)
    assert "divergence to the teacher (held-out, per answer token)" in out
    assert not (tmp_path / "run" / "teacher").exists()  # the student alone is saved


def test_a_teacher_with_another_tokenizer_is_one_line_before_any_weights_load(tmp_path, capsys, monkeypatch):
    teacher = tmp_path / "teacher"
    shutil.copytree(TINY_MODEL_DIR, teacher)
    tokenizer = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two tokens trade ids: same size, other ids
    (teacher / "tokenizer.json").write_text(json.dumps(tokenizer))

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the tokenizer check")

    monkeypatch.setattr("tunelab.model.load.load_model", no_weights)
    assert main(["train", _write(tmp_path, teacher_model_name_or_path=str(teacher))]) != 0
    out = capsys.readouterr()
    errors = [line for line in out.err.splitlines() if line.startswith("tunelab: error:")]
    assert len(errors) == 1 and "Traceback" not in out.out + out.err, out.err
    assert str(teacher) in errors[0] and str(TINY_MODEL_DIR) in errors[0] and "2 tokens have other ids" in errors[0]


def test_the_options_checks(tmp_path):
    base = {"stage": "kd", "template": "chatml", "dataset": "demo_sort", "output_dir": str(tmp_path / "out"),
            "teacher_model_name_or_path": "tiny"}
    config = load_config(None, {**base, "beta": "0", "temperature": "2"})
    assert (config.finetuning.beta, config.generation.temperature, config.finetuning.lmbda) == (0.0, 2.0, 0.0)
    cases = {
        "teacher_model_name_or_path: stage kd needs a teacher": {"teacher_model_name_or_path": None},
        "beta must be in [0, 1]": {"beta": "1.5"},
        "lmbda must be in [0, 1]": {"lmbda": "1.5"},
        "beta only applies to stage kd (got stage: sft)": {"stage": "sft", "teacher_model_name_or_path": None,
                                                           "beta": "0.1"},
        "teacher_model_name_or_path only applies to stage kd": {"stage": "sft"},
    }
    for message, overrides in cases.items():
        with pytest.raises(ConfigError) as info:
            load_config(None, {k: v for k, v in {**base, **overrides}.items() if v is not None})
        assert message in str(info.value) and "\n" not in str(info.value)


# ---- on-policy examples (lmbda > 0) ------------------------------------------------------------------------------


def test_the_examples_of_padded_padding_free_and_packed_batches_come_back_whole(trainer):
    rows = _samples()
    packed = PackedCollator.for_model(trainer.model, pad_token_id=0)
    packed_rows, _ = pack_dataset(datasets.Dataset.from_list(rows), 64)
    expected = sorted((tuple(r["input_ids"]), tuple(r["labels"])) for r in rows)
    for batch in (SupervisedCollator(0)(rows), PaddingFreeCollator(packed)(rows), packed(packed_rows.to_list())):
        found = sorted((tuple(e["input_ids"]), tuple(e["labels"])) for e in split_examples(batch))
        assert found == expected


def test_lmbda_one_trains_every_example_on_the_students_own_answer(tmp_path):
    student = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32)
    student.config.use_cache = False
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no",
                             remove_unused_columns=False, disable_tqdm=True)
    trainer = DistillationTrainer(model=student, args=args, teacher=_teacher_of(student), beta=0.5, temperature=1.0,
                                  lmbda=1.0, stop_ids=[4], max_new_tokens=5, data_collator=SupervisedCollator(0),
                                  processing_class=AutoTokenizer.from_pretrained(TINY_MODEL_DIR))
    rows = _samples()
    student.train()
    batch, drawn = trainer.with_student_answers(student, SupervisedCollator(0)(rows))
    assert drawn == len(rows) == trainer.on_policy_examples and student.training
    for old, new in zip(rows, split_examples(batch)):
        start = last_answer_start(old["labels"])
        assert new["input_ids"][:start] == old["input_ids"][:start] and new["labels"][:start] == old["labels"][:start]
        answer = new["input_ids"][start:]
        assert 1 <= len(answer) <= 5 and new["labels"][start:] == answer  # the sampled tokens are the ones trained
        assert 4 not in answer[:-1]  # nothing after the end-of-turn token
    trainer._own_mean = True
    loss = trainer.compute_loss(student, batch)
    assert torch.isfinite(loss) and loss.item() > 0


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_a_run_with_lmbda_trains_on_some_of_the_students_own_answers(tmp_path):
    config = _write(tmp_path, teacher_model_name_or_path="tiny", lmbda=0.5, max_steps=2, val_size=0, max_samples=64)
    assert main(["train", config]) == 0
    results = json.loads((tmp_path / "run" / "all_results.json").read_text())
    assert 0 < results["on_policy_examples"] < 2 * 16
