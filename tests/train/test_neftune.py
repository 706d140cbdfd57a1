"""NEFTune (`neftune_noise_alpha`): while training, and only then, the input embeddings get uniform noise in
[-m, m] with m = alpha / sqrt(L * d) (L the batch's sequence length, d the embedding width), added by
transformers' Trainer through a forward hook on the embedding layer.

Real training of the embedded tiny model through the stage recipe (sft and pt), a recorder hooked on the embedding
behind NEFTune's: each forward's output minus the plain lookup of the same ids is the noise. Measured: in training
steps the noise / m is uniform on [-1, 1]; in the evaluation loop and in the generation at each evaluation (the
hook still in place) there is none; after training the hook is gone: the model in train mode, tunelab's held-out
generation and the saved folder give what a clean model with the same weights gives. The stages where it does not
act are refused with one line.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from torch import nn

from tests.config.configs import error_of
from tunelab.infer.generate import held_out_exact_match, held_out_rows
from tunelab.preflight import plan_run
from tunelab.train import outputs
from tunelab.train.generation_metrics import GenerationMetricsCallback
from tunelab.train.recipe import recipe_for

ALPHA = 5.0
BASE = {
    "model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_reverse", "max_samples": 24,
    "cutoff_len": 64, "per_device_train_batch_size": 4, "per_device_eval_batch_size": 4, "learning_rate": 1e-3,
    "seed": 0, "max_steps": 2, "finetuning_type": "full", "disable_tqdm": True, "plot_loss": False,
    "logging_steps": 1, "neftune_noise_alpha": ALPHA,
}


class EmbeddingRecorder(transformers.TrainerCallback):
    """From the start of training (NEFTune's hook is on by then, so this one runs after it): each forward of the
    input embeddings as (training?, L, d, output minus the plain lookup of its ids)."""

    def __init__(self):
        self.records: list[tuple[bool, int, int, torch.Tensor]] = []
        self.handle = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.embedding = model.get_input_embeddings()
        self.handle = self.embedding.register_forward_hook(self._record)

    def _record(self, module, inputs, output):
        noise = (output - nn.functional.embedding(inputs[0], module.weight)).detach().float()
        self.records.append((module.training, output.shape[1], output.shape[2], noise))

    def noise(self, training: bool) -> list[tuple[int, int, torch.Tensor]]:
        return [(length, width, noise) for was_training, length, width, noise in self.records if was_training == training]


def train(tmp_path, **options):
    """(recipe, trainer, recorder) after `max_steps` of real training through the stage's recipe."""
    overrides = [f"{k}={v}" for k, v in {**BASE, "output_dir": tmp_path / "out", **options}.items()]
    recipe = recipe_for(plan_run(None, overrides))
    data, model, recorder = recipe.datasets(), recipe.model(), EmbeddingRecorder()
    extra = []
    if recipe.config.generation.generate_at_eval:
        config = recipe.config
        extra.append(GenerationMetricsCallback.from_options(data.eval_rows, recipe.tokenizer, recipe.template,
                                                            config.generation, config.data, config.training))
    trainer = recipe.trainer(model, data, recorder, *extra)
    trainer.train()
    return recipe, trainer, recorder


def assert_uniform_noise_of_neftunes_scale(records) -> None:
    """Every training forward: |noise| <= alpha / sqrt(L d), and noise / that scale uniform on [-1, 1]."""
    assert records, "no training forward was recorded"
    scaled = []
    for length, width, noise in records:
        scale = ALPHA / math.sqrt(length * width)
        assert noise.abs().max().item() <= scale * (1 + 1e-5)
        scaled.append((noise / scale).flatten())
    u = torch.cat(scaled)
    assert u.numel() > 20_000
    assert u.abs().max().item() > 0.999  # the bound is reached: the scale is alpha / sqrt(L d), not smaller
    assert abs(u.mean().item()) < 0.02
    assert abs(u.std().item() - 1 / math.sqrt(3)) < 0.01  # a uniform's spread (a Gaussian's tails would exceed 1)
    assert abs((u.abs() < 0.5).float().mean().item() - 0.5) < 0.01  # flat: half of the mass in the inner half


@pytest.mark.slow
def test_sft_noise_only_while_training(tmp_path):
    recipe, trainer, recorder = train(
        tmp_path, eval_dataset="demo_reverse_test", eval_strategy="steps", eval_steps=2, generate_at_eval=True,
        eval_generation=True, eval_generation_samples=4, max_new_tokens=4,
    )
    assert_uniform_noise_of_neftunes_scale(recorder.noise(training=True))

    # Evaluations ran inside train(), NEFTune's hook in place: the eval loop and the generation at each evaluation
    # (its decoding steps embed one token at a time) saw the clean embeddings.
    evaluating = recorder.noise(training=False)
    assert {length for length, _, _ in evaluating} >= {1} and any(length > 1 for length, _, _ in evaluating)
    assert all(torch.count_nonzero(noise) == 0 for _, _, noise in evaluating)
    assert any("eval_exact_match" in record for record in trainer.state.log_history)

    # After training the hook is removed: tunelab's held-out generation embeds clean ids...
    model, before = trainer.model, len(recorder.records)
    held_out_exact_match(model, recipe.tokenizer, recipe.template,
                         held_out_rows(recipe.datasets().eval_rows, recipe.config.generation), recipe.config.generation,
                         recipe.config.data, recipe.config.training)
    assert len(recorder.records) > before and all(torch.count_nonzero(n) == 0 for *_, n in recorder.records[before:])
    recorder.handle.remove()
    embedding = model.get_input_embeddings()
    assert not hasattr(embedding, "neftune_noise_alpha")
    # ... and even in train mode the model is a clean model with the same weights.
    clean = transformers.AutoModelForCausalLM.from_config(model.config)
    clean.load_state_dict(model.state_dict())
    ids = torch.tensor([[1, 5, 9, 40, 77, 120, 3]])
    model.train()
    with torch.no_grad():
        assert torch.equal(embedding(ids), nn.functional.embedding(ids, embedding.weight))
        trained_logits = model(ids).logits
        clean_logits = clean.eval()(ids).logits
    assert torch.equal(trained_logits, clean_logits)

    # The saved model is the clean one too.
    outputs.save_model(trainer, recipe.tokenizer, recipe.template, recipe.config.training.output_dir)
    saved = transformers.AutoModelForCausalLM.from_pretrained(recipe.config.training.output_dir).eval()
    with torch.no_grad():
        assert torch.equal(saved(ids).logits, clean_logits)


def test_pt_noise_only_while_training(tmp_path):
    _, trainer, recorder = train(tmp_path, stage="pt", dataset="demo_corpus", template="")
    assert_uniform_noise_of_neftunes_scale(recorder.noise(training=True))
    recorder.handle.remove()
    embedding, ids = trainer.model.get_input_embeddings(), torch.tensor([[1, 5, 9, 40]])
    assert not hasattr(embedding, "neftune_noise_alpha")
    assert torch.equal(embedding.train()(ids), nn.functional.embedding(ids, embedding.weight))


@pytest.mark.parametrize(("stage", "options", "why"), [
    ("rm", {"dataset": "demo_preference"}, "trains a reward head, not generation"),
    ("dpo", {"dataset": "demo_preference"},
     "would noise its reference pass too (LoRA: the reference is the policy with the adapter off)"),
    ("kto", {"dataset": "demo_preference"},
     "would noise its reference pass too (LoRA: the reference is the policy with the adapter off)"),
    ("grpo", {"dataset": "demo_sort", "reward_funcs": "exact_match"}, "trains in its own loop, which adds no noise"),
    ("ppo", {"dataset": "demo_sort", "reward_model": "saves/rm"}, "trains in its own loop, which adds no noise"),
])
def test_other_stages_refuse_it(tmp_path, stage, options, why):
    config = {**BASE, "output_dir": str(tmp_path / "out"), "stage": stage, **options}
    assert error_of(tmp_path, config) == (
        f"neftune_noise_alpha applies to stages sft and pt; stage {stage} {why}: remove it"
    )


@pytest.mark.parametrize("alpha", [0, -5])
def test_a_scale_that_adds_no_noise_is_refused(tmp_path, alpha):
    assert error_of(tmp_path, {**BASE, "output_dir": str(tmp_path / "out"), "neftune_noise_alpha": alpha}) == (
        f"neftune_noise_alpha must be > 0 (the noise scale; NEFTune's paper uses 5 to 15), got {float(alpha)}; "
        "remove it to train without noise"
    )
