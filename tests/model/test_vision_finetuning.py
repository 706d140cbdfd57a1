"""Vision-language models load with their processor; which parts train for full / freeze / LoRA (counted)."""

from __future__ import annotations

import pytest
from torch import nn
from transformers import AutoModelForImageTextToText

from tunelab.config.args import FinetuningArguments, ModelArguments
from tunelab.config.training_args import TrainingArguments
from tunelab.errors import ConfigError
from tunelab.model.load import count_parameters, load_model
from tunelab.model.tokenizer import load_processor, load_tokenizer
from tunelab.model.vision import vision_parts


@pytest.fixture(scope="module")
def training_args(tmp_path_factory):
    return TrainingArguments(output_dir=str(tmp_path_factory.mktemp("out")), use_cpu=True)


def _load(model_dir, training_args, **finetuning):
    model_args = ModelArguments(model_name_or_path=str(model_dir))
    return load_model(model_args, FinetuningArguments(**finetuning), training_args, load_tokenizer(model_args))


def _part_sizes(model_dir) -> dict[str, int]:
    """Parameters per part of the plain model, and the LoRA size (r=8) of each part's linear layers."""
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    parts = vision_parts(model)
    sizes = {"tower": 0, "projector": 0, "language": 0, "lora_tower": 0, "lora_projector": 0, "lora_language": 0}
    for name, param in model.named_parameters():
        sizes[parts.part_of(name)] += param.numel()
    head = model.get_output_embeddings()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not head:
            sizes[f"lora_{parts.part_of(name)}"] += 8 * (module.in_features + module.out_features)
    return sizes


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_processor_and_model_load_from_the_folder(tiny_vlm_dirs, family):
    model_args = ModelArguments(model_name_or_path=str(tiny_vlm_dirs[family]))
    processor = load_processor(model_args)
    assert type(processor).__name__ == {"llava": "LlavaProcessor", "gemma3": "Gemma3Processor"}[family]
    assert load_processor(ModelArguments(model_name_or_path="tiny")) is None  # text-only: no processor


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_trainable_parameters_per_option(tiny_vlm_dirs, training_args, family):
    folder = tiny_vlm_dirs[family]
    size = _part_sizes(folder)
    total = size["tower"] + size["projector"] + size["language"]
    cases = [
        ({"finetuning_type": "full"}, size["language"]),  # tower and projector frozen by default
        ({"finetuning_type": "full", "freeze_vision_tower": False}, size["language"] + size["tower"]),
        ({"finetuning_type": "full", "freeze_multi_modal_projector": False}, size["language"] + size["projector"]),
        ({"finetuning_type": "full", "train_mm_proj_only": True}, size["projector"]),
        ({"finetuning_type": "lora"}, size["lora_language"]),
        ({"finetuning_type": "lora", "freeze_vision_tower": False}, size["lora_language"] + size["lora_tower"]),
        ({"finetuning_type": "lora", "freeze_multi_modal_projector": False},
         size["lora_language"] + size["lora_projector"]),
    ]
    for options, expected in cases:
        model = _load(folder, training_args, **options)
        trainable, counted_total = count_parameters(model)
        assert trainable == expected, options
        assert counted_total == total + (trainable if options["finetuning_type"] == "lora" else 0)
    lora = _load(folder, training_args, finetuning_type="lora")
    assert not [n for n, _ in lora.named_parameters() if "lora_" in n and ("vision_tower" in n or "projector" in n)]


def test_freeze_trains_the_last_decoder_layers_of_the_language_model(tiny_vlm_dirs, training_args):
    model = _load(tiny_vlm_dirs["llava"], training_args, finetuning_type="freeze", freeze_trainable_layers=1)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(n.startswith("model.language_model.layers.1.") for n in names)
    model = _load(tiny_vlm_dirs["llava"], training_args, finetuning_type="freeze", freeze_trainable_layers=1,
                  freeze_multi_modal_projector=False)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n.split(".")[1] for n in names} == {"language_model", "multi_modal_projector"}


def test_vision_options_refused_where_they_cannot_apply(tiny_vlm_dirs, training_args):
    with pytest.raises(ConfigError) as info:
        _load(tiny_vlm_dirs["llava"], training_args, finetuning_type="lora", train_mm_proj_only=True)
    assert str(info.value) == (
        "train_mm_proj_only: trains the projector's weights themselves, so it needs finetuning_type: full (got lora)"
    )
    with pytest.raises(ConfigError) as info:
        _load("tiny", training_args, finetuning_type="full", freeze_vision_tower=False)
    assert str(info.value) == "freeze_vision_tower: model_name_or_path is a text-only model (no vision tower): remove it"
