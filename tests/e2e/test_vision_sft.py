"""tunelab train with images through the real CLI: sft with full / freeze / LoRA / QLoRA on a tiny LLaVA folder,
an alpaca set (images column, <image> placeholders, relative paths) mixed with an openai set (image_url data URI
content parts) and a text-only row; the output folder loads back with plain transformers (model + processor)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import yaml
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from tunelab.cli import main

COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}


def image_dataset(folder: Path) -> Path:
    (folder / "imgs").mkdir(parents=True)
    for name, colour in COLOURS.items():
        Image.new("RGB", (32, 32), colour).save(folder / "imgs" / f"{name}.png")
    rows = [{"instruction": "<image>What colour is this?", "output": name, "images": [f"imgs/{name}.png"]}
            for name in list(COLOURS) * 3]
    rows.append({"instruction": "Say hi.", "output": "hi", "images": []})
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), COLOURS["green"]).save(buffer, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    parts = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "Colour?"}]
    row = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "green"}]}
    (folder / "openai.jsonl").write_text("\n".join(json.dumps(row) for _ in range(3)))
    (folder / "dataset_info.json").write_text(json.dumps({
        "colours": {"file_name": "train.jsonl", "columns": {"prompt": "instruction", "response": "output",
                                                             "images": "images"}},
        "colours_openai": {"file_name": "openai.jsonl", "formatting": "openai"},
    }))
    return folder


def train(tmp_path: Path, model_dir: Path, **options) -> tuple[Path, dict]:
    out = tmp_path / "out"
    config = {
        "model_name_or_path": str(model_dir), "template": "model", "stage": "sft", "finetuning_type": "lora",
        "dataset": "colours,colours_openai", "dataset_dir": str(image_dataset(tmp_path / "data")),
        "cutoff_len": 96, "max_steps": 3, "per_device_train_batch_size": 4, "learning_rate": 1e-3,
        "logging_steps": 1, "output_dir": str(out), "report_to": "none", "disable_tqdm": True, "seed": 0,
        "tokenized_cache_dir": str(tmp_path / "cache"), **options,
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "cfg.yaml")]) == 0
    return out, json.loads((out / "data_report.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    {"finetuning_type": "lora"}, {"finetuning_type": "lora", "quantization_bit": 4},
    {"finetuning_type": "freeze", "freeze_trainable_layers": 1}, {"finetuning_type": "full"},
], ids=["lora", "qlora", "freeze", "full"])
def test_sft_with_images(tmp_path, tiny_vlm_dirs, options, precision):
    out, report = train(tmp_path, tiny_vlm_dirs["llava"], **options)
    # 10 alpaca rows (9 with an image) + 3 openai rows with one image each; nothing dropped.
    assert (report["train"]["examples"], report["train"]["images"], report["train"]["images_dont_fit"]) == (13, 12, 0)
    assert report["train"]["image_tokens"] == 12 * 16  # LLaVA: (32 / 8)^2 patch features per image
    results = json.loads((out / "all_results.json").read_text())
    assert results["train_loss"] > 0
    processor = AutoProcessor.from_pretrained(out)
    assert type(processor).__name__ == "LlavaProcessor"
    if options["finetuning_type"] == "full":
        AutoModelForImageTextToText.from_pretrained(out)
    else:
        assert (out / ("adapter_config.json" if options["finetuning_type"] == "lora" else "model.safetensors")).exists()


@pytest.mark.slow
def test_dpo_on_image_pairs(tmp_path, tiny_vlm_dirs):
    data = tmp_path / "data"
    (data / "imgs").mkdir(parents=True)
    rows = []
    for name, colour in COLOURS.items():
        Image.new("RGB", (32, 32), colour).save(data / "imgs" / f"{name}.png")
        wrong = next(other for other in COLOURS if other != name)
        rows += [{"instruction": "<image>What colour is this?", "chosen": name, "rejected": wrong,
                  "images": [f"imgs/{name}.png"]}] * 2
    (data / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (data / "dataset_info.json").write_text(json.dumps({"pairs": {"file_name": "pairs.jsonl", "ranking": True, "columns": {
        "prompt": "instruction", "chosen": "chosen", "rejected": "rejected", "images": "images"}}}))
    out = tmp_path / "out"
    config = {
        "model_name_or_path": str(tiny_vlm_dirs["llava"]), "template": "model", "stage": "dpo",
        "finetuning_type": "lora", "dataset": "pairs", "dataset_dir": str(data), "cutoff_len": 96, "max_steps": 2,
        "per_device_train_batch_size": 2, "learning_rate": 1e-3, "output_dir": str(out), "report_to": "none",
        "disable_tqdm": True, "tokenized_cache_dir": str(tmp_path / "cache"),
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "cfg.yaml")]) == 0
    report = json.loads((out / "data_report.json").read_text())
    assert report["train"]["examples"] == 6
    assert json.loads((out / "all_results.json").read_text())["train_loss"] > 0
    assert type(AutoProcessor.from_pretrained(out)).__name__ == "LlavaProcessor"


@pytest.mark.slow
def test_sft_with_images_on_gemma3(tmp_path, tiny_vlm_dirs):
    """The second family end to end: token_type_ids from the processor, padding-free falling back to padding."""
    out, report = train(tmp_path, tiny_vlm_dirs["gemma3"])
    # Gemma 3 (fixture): <start_of_image> + 4 soft tokens + <end_of_image> per image.
    assert (report["train"]["images"], report["train"]["image_tokens"]) == (12, 12 * 6)
    assert json.loads((out / "all_results.json").read_text())["train_loss"] > 0
    assert type(AutoProcessor.from_pretrained(out)).__name__ == "Gemma3Processor"
