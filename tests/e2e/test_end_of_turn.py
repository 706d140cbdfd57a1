"""End-of-turn markers are real tokens, or the run stops (docs/data.md, "End-of-turn markers").

Phi-3.5's template ends answers with <|end|>, which the embedded tokenizer lacks. Training on it would teach
five plain tokens the model could never stop on: the run refuses with one line naming the fix, and
`add_special_tokens: <|end|>` adds it — the embeddings grow, the new row trains (LoRA: as trainable tokens
saved with the adapter; freeze: with the embedding layers), and the trained folder serves with it as a stop id.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from tunelab.assets import TINY_MODEL_DIR
from tunelab.cli import main
from tunelab.config.args import FinetuningArguments, ModelArguments
from tunelab.config.training_args import TrainingArguments
from tunelab.data.templates import get_template
from tunelab.errors import TemplateError
from tunelab.model.load import count_parameters, load_model
from tunelab.model.tokenizer import load_tokenizer


def write_config(tmp_path: Path, **options) -> Path:
    config = {
        "model_name_or_path": "tiny", "template": "phi3_5", "dataset": "demo_reverse", "max_samples": 64,
        "cutoff_len": 64, "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 8, "max_steps": 3,
        "learning_rate": 1e-3, "logging_steps": 1, "disable_tqdm": True, "finetuning_type": "lora", **options,
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_marker_the_tokenizer_lacks_stops_the_run_with_the_fix(tmp_path: Path, capsys) -> None:
    assert main(["train", str(write_config(tmp_path))]) == 2
    assert capsys.readouterr().err.strip() == (
        "tunelab: error: template 'phi3_5' ends answers with '<|end|>', which this tokenizer splits into 5 tokens, "
        "so the model could never stop on it; use the tokenizer's own template (template: model) or the one of the "
        "model's family, or add the marker as a token (add_special_tokens: <|end|>)"
    )
    assert not (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_a_secondary_marker_only_warns(caplog) -> None:
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)  # has <|eot_id|>, lacks <|eom_id|>
    with caplog.at_level("WARNING", logger="tunelab.data.templates"):
        assert get_template("llama3_1", tokenizer).stop_words == ("<|eot_id|>", "<|eom_id|>")
    assert "ends answers with '<|eom_id|>', which this tokenizer splits into 9 tokens" in caplog.text
    with pytest.raises(TemplateError, match="'<｜end▁of▁sentence｜>', which this tokenizer splits into"):
        get_template("deepseek_r1_distill", tokenizer)


@pytest.mark.slow
def test_added_marker_trains_and_serves_as_one_token(tmp_path: Path) -> None:
    assert main(["train", str(write_config(tmp_path, add_special_tokens="<|end|>"))]) == 0
    out = tmp_path / "out"
    tokenizer = AutoTokenizer.from_pretrained(out)
    (end_id,) = tokenizer("<|end|>", add_special_tokens=False)["input_ids"]
    assert end_id == 864  # one new row after the 864 of the embedded vocabulary
    adapter = yaml.safe_load((out / "adapter_config.json").read_text())
    assert adapter["trainable_token_indices"] == {"embed_tokens": [864], "lm_head": [864]}

    from tunelab.infer.engine import load_engine  # noqa: PLC0415

    engine = load_engine(str(out))
    assert engine.model.get_input_embeddings().weight.shape[0] == 865
    assert end_id in engine.stop_ids


def test_freeze_trains_the_embedding_layers_for_added_tokens() -> None:
    model_args = ModelArguments(model_name_or_path="tiny", add_special_tokens=["<|end|>"])
    tokenizer = load_tokenizer(model_args)
    finetuning = FinetuningArguments(finetuning_type="freeze", freeze_trainable_layers=1)
    training = TrainingArguments(output_dir="unused", use_cpu=True, report_to="none")
    plain, _ = count_parameters(load_model(ModelArguments(model_name_or_path="tiny"), finetuning, training,
                                           load_tokenizer(ModelArguments(model_name_or_path="tiny"))))
    model = load_model(model_args, finetuning, training, tokenizer)
    trainable, _ = count_parameters(model)
    embeddings = model.get_input_embeddings().weight
    assert embeddings.shape == (865, 128) and embeddings.requires_grad
    assert trainable == plain + 865 * 128  # the tied embedding/output matrix, once
