"""RoPE scaling (`rope_scaling`, `rope_factor`; model/rope.py): the loaded model's rotary embedding is scaled as the
type says (linear: positions divided by the factor), training runs past the model's max_position_embeddings, and
the scaling travels with the outputs: a full run's config.json (reloaded by plain transformers: the same logits), a
LoRA run's tunelab_config.yaml (its base scaled again by eval, chat and export; the export's config.json). Refusals
are one line, before any weights load. The embedded tiny Llama: max_position_embeddings 512, head_dim 32.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from tests.config.configs import error_of
from tunelab.assets import TINY_MODEL_DIR
from tunelab.cli import main
from tunelab.config.loader import build_config, read_values
from tunelab.infer.engine import load_engine
from tunelab.model import device, rope
from tunelab.model.load import load_model
from tunelab.model.tokenizer import load_tokenizer
from tunelab.preflight import load_config, plan_run
from tunelab.run_folder import read_run_record
from tunelab.train import outputs
from tunelab.train.recipe import recipe_for

BASE = {
    "model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_reverse", "max_samples": 16,
    "cutoff_len": 64, "per_device_train_batch_size": 4, "learning_rate": 1e-3, "seed": 0, "max_steps": 2,
    "disable_tqdm": True, "plot_loss": False,
}


def config_file(tmp_path: Path, **options) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({**BASE, "output_dir": str(tmp_path / "out"), **options}))
    return path


def rotary(model, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(1, 1, 32)
    return model.model.rotary_emb(x, positions[None])


# ---- what the loaded model has ---------------------------------------------------------------------------------


def test_linear_scaling_divides_the_positions_by_the_factor(tmp_path):
    # cutoff_len 1024 over the model's 512 positions: factor 2, as LlamaFactory derives it.
    config = load_config(config_file(tmp_path, rope_scaling="linear", cutoff_len=1024))
    assert (config.model.rope_scaling, config.model.rope_factor) == ("linear", 2.0)
    model = load_model(config.model, config.finetuning, config.training, load_tokenizer(config.model),
                       is_trainable=False)
    assert model.config.rope_parameters == {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}
    assert model.config.max_position_embeddings == 1024
    plain = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
    positions = torch.arange(1024, dtype=torch.float32)
    scaled_cos, scaled_sin = rotary(model, positions)
    plain_cos, plain_sin = rotary(plain, positions / 2)  # what the unscaled model gives at half the position
    assert torch.allclose(scaled_cos, plain_cos, atol=1e-6) and torch.allclose(scaled_sin, plain_sin, atol=1e-6)
    assert not torch.allclose(scaled_cos, rotary(plain, positions)[0], atol=1e-2)


def test_preflight_resolves_the_factor_into_new_values_leaving_the_read_config_as_read(tmp_path):
    read = read_values(config_file(tmp_path, rope_scaling="linear", cutoff_len=1024), None, "train", device.machine())
    config = build_config(read, False)
    resolved = rope.resolve_rope_scaling(config.model, config.data)
    assert (resolved.rope_scaling, resolved.rope_factor) == ("linear", 2.0)
    assert config.model.rope_factor is None  # the config it was given is as it was read


@pytest.mark.parametrize(("kind", "parameters", "positions", "attention_scaling"), [
    ("dynamic", {"factor": 4.0}, 512, 1.0),  # transformers' dynamic NTK grows from max_position_embeddings
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 512}, 2048, 0.1 * math.log(4.0) + 1),
    ("llama3", {"factor": 4.0, "original_max_position_embeddings": 512, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0}, 2048, 1.0),
])
def test_each_type_sets_transformers_rope_parameters(kind, parameters, positions, attention_scaling):
    config = rope.scaled_config(str(TINY_MODEL_DIR), rope.RopeScaling(kind, 4.0), trust_remote_code=False)
    assert config.rope_parameters == {"rope_theta": 10000.0, "rope_type": kind, **parameters}
    assert config.max_position_embeddings == positions
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, config=config)
    assert model.model.rotary_emb.rope_type == kind
    assert model.model.rotary_emb.attention_scaling == pytest.approx(attention_scaling)


# ---- a full run: past max_position_embeddings, saved, reloaded --------------------------------------------------


@pytest.mark.slow
def test_full_run_trains_past_max_positions_and_its_folder_reloads_with_the_scaling(tmp_path):
    # stage pt: windows of 1024 tokens, twice the positions the model was trained on.
    cfg = config_file(tmp_path, stage="pt", dataset="demo_corpus", template="", finetuning_type="full",
                      cutoff_len=1024, max_samples=200, per_device_train_batch_size=1, max_steps=1,
                      rope_scaling="linear")
    recipe = recipe_for(plan_run(cfg))
    data = recipe.datasets()
    assert len(data.train[0]["input_ids"]) == 1024
    trainer = recipe.trainer(recipe.model(), data)
    result = trainer.train()
    assert math.isfinite(result.metrics["train_loss"])
    outputs.write_run_start(recipe.config)
    outputs.save_model(trainer, recipe.tokenizer, None, recipe.config.training.output_dir)

    out = Path(recipe.config.training.output_dir)
    saved = json.loads((out / "config.json").read_text())
    assert saved["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}
    assert saved["max_position_embeddings"] == 1024
    record = read_run_record(out)
    assert (record["rope_scaling"], record["rope_factor"]) == ("linear", 2.0)

    ids = torch.tensor([data.train[0]["input_ids"]])
    trained = trainer.model.eval()
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, trained(ids).logits)
        # (the same weights read without the scaling answer otherwise: the config.json is what carries it)
        unscaled = AutoModelForCausalLM.from_pretrained(out, rope_parameters={"rope_theta": 10000.0,
                                                                             "rope_type": "default"})
        assert not torch.allclose(unscaled(ids).logits, trained(ids).logits, atol=1e-3)

    # The run's own YAML on the folder (`tunelab chat cfg.yaml model_name_or_path=...`) reads it as it is, scaled so
    # already: nothing is scaled twice.
    again = load_config(cfg, [f"model_name_or_path={out}"], purpose="serve")
    assert again.model.rope_factor == 2.0
    assert rope.scaled_config(str(out), rope.of(again.model), trust_remote_code=False) is None


# ---- a LoRA run: the record carries it to eval, chat and export --------------------------------------------------


@pytest.mark.slow
def test_lora_run_records_it_and_eval_chat_export_apply_it(tmp_path):
    cfg = config_file(tmp_path, rope_scaling="yarn", rope_factor=2)
    assert main(["train", str(cfg)]) == 0
    out = tmp_path / "out"
    assert not (out / "config.json").exists()  # an adapter folder: the run record says how its base loads
    record = read_run_record(out)
    assert (record["rope_scaling"], record["rope_factor"]) == ("yarn", 2.0)
    expected = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512}

    # tunelab eval of the adapter, with no rope key given: the base loads scaled as it trained.
    config = load_config(None, [f"adapter_name_or_path={out}", "dataset=demo_reverse",
                                "eval_dataset=demo_reverse_test", f"output_dir={tmp_path / 'eval'}"], purpose="eval")
    assert (config.model.rope_scaling, config.model.rope_factor) == ("yarn", 2.0)
    evaluated = load_model(config.model, config.finetuning, config.training, load_tokenizer(config.model),
                           is_trainable=False)
    assert evaluated.config.rope_parameters == expected

    engine = load_engine(str(out))  # tunelab chat / api on the folder
    assert engine.model.config.rope_parameters == expected and engine.model.config.max_position_embeddings == 1024

    export = tmp_path / "export"
    # (0: its check read the folder back with plain transformers and found the model as trained)
    assert main(["export", f"adapter_name_or_path={out}", f"export_dir={export}"]) == 0
    exported = json.loads((export / "config.json").read_text())
    assert exported["rope_parameters"] == expected and exported["max_position_embeddings"] == 1024
    ids = torch.tensor([[1, 5, 9, 40, 77, 120, 3, 8, 13]])
    with torch.no_grad():
        served = engine.model(ids).logits
        assert torch.allclose(AutoModelForCausalLM.from_pretrained(export)(ids).logits, served, atol=1e-5)


# ---- refusals --------------------------------------------------------------------------------------------------


def test_refusals_name_the_key_and_the_fix(tmp_path):
    data = {**BASE, "output_dir": str(tmp_path / "out")}
    assert error_of(tmp_path, {**data, "rope_scaling": "ntk"}) == (
        "rope_scaling: 'ntk' is not one of linear, dynamic, yarn, llama3"
    )
    assert error_of(tmp_path, {**data, "rope_scaling": "linear", "rope_factor": 1}) == (
        "rope_factor must be > 1 (the context grows by that factor), got 1.0; remove it to derive it from cutoff_len"
    )
    assert error_of(tmp_path, {**data, "rope_factor": 2}) == (
        "rope_factor only applies with rope_scaling: set rope_scaling (linear, dynamic, yarn or llama3) or remove "
        "rope_factor"
    )
    assert error_of(tmp_path, {**data, "rope_scaling": "linear", "cutoff_len": 512}) == (
        f"rope_scaling: cutoff_len 512 fits in the 512 positions model_name_or_path {TINY_MODEL_DIR} was trained on "
        "(max_position_embeddings), so the factor would be 1: raise cutoff_len, set rope_factor > 1, or remove "
        "rope_scaling"
    )


def test_a_model_without_rope_or_scaled_otherwise_is_refused(tmp_path):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 128}))
    data = {**BASE, "output_dir": str(tmp_path / "out"), "rope_scaling": "linear", "rope_factor": 2}
    assert error_of(tmp_path, {**data, "model_name_or_path": str(gpt2)}) == (
        f"rope_scaling: model_name_or_path {gpt2} (gpt2) has no rotary position embeddings (RoPE) to scale: remove "
        "rope_scaling"
    )
    llama31 = tmp_path / "llama31"
    llama31.mkdir()
    tiny = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    (llama31 / "config.json").write_text(json.dumps({**tiny, "max_position_embeddings": 4096, "rope_parameters": {
        "rope_theta": 10000.0, "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 512,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0}}))
    assert error_of(tmp_path, {**data, "model_name_or_path": str(llama31)}) == (
        f"rope_scaling: model_name_or_path {llama31} scales its RoPE already (llama3, factor 8.0); remove "
        "rope_scaling, or edit rope_parameters in its config.json"
    )
