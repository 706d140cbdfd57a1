"""`tunelab export`: base + LoRA merged into a plain Hugging Face folder, logits equal to base + adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from tunelab.assets import TINY_MODEL_DIR
from tunelab.cli import main
from tunelab.data.templates import get_template
from tunelab.export.merge import shard_size_bytes

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = torch.tensor([[5, 17, 40, 3, 99, 12, 7], [8, 8, 120, 60, 2, 31, 200]])


def _random_adapter(model, folder: Path, task_type=TaskType.CAUSAL_LM) -> Path:
    """A LoRA adapter whose B matrices are not zero (init_lora_weights=False), so merging changes the weights."""
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(task_type=task_type, r=4, target_modules=LINEARS, init_lora_weights=False))
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def causal_adapter(tmp_path_factory) -> Path:
    return _random_adapter(AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR), tmp_path_factory.mktemp("adapter"))


def test_merged_lora_export_is_sharded_and_matches_base_plus_adapter(causal_adapter, tmp_path):
    out = tmp_path / "merged"
    assert main(["export", f"model_name_or_path={TINY_MODEL_DIR}", f"adapter_name_or_path={causal_adapter}",
                 f"export_dir={out}", "export_size=500KB", "template=chatml", "export_dtype=float32"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() and s.endswith(".safetensors") for s in shards)
    assert not (out / "adapter_config.json").exists()

    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR), causal_adapter).eval()
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR).eval()
    with torch.no_grad():
        got, want, before = exported(IDS).logits, reference(IDS).logits, base(IDS).logits
    assert (got - want).abs().max().item() < 1e-4
    assert (want - before).abs().max().item() > 1e-2  # the adapter does change the model
    assert exported.config.use_cache is True

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == get_template("chatml").jinja
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == sorted({im_end, tokenizer.eos_token_id})


def test_export_dtype_bfloat16_and_size_strings(causal_adapter, tmp_path):
    out = tmp_path / "bf16"
    assert main(["export", f"adapter_name_or_path={causal_adapter}", f"export_dir={out}", "export_dtype=bfloat16"]) == 0
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert shard_size_bytes(2) == 2 * 10**9 and shard_size_bytes(0.5) == 5 * 10**8
    assert shard_size_bytes("500MB") == 5 * 10**8 and shard_size_bytes("2GiB") == 2 * 2**30


def test_reward_model_export_keeps_its_score_head(tiny_llama_dir, tmp_path):
    def classifier():
        torch.manual_seed(1)  # the head starts random; the adapter's saved copy of it replaces it
        return AutoModelForSequenceClassification.from_pretrained(tiny_llama_dir, num_labels=1, pad_token_id=0)

    adapter = _random_adapter(classifier(), tmp_path / "rm-adapter", TaskType.SEQ_CLS)
    out = tmp_path / "rm-merged"
    assert main(["export", f"model_name_or_path={tiny_llama_dir}", f"adapter_name_or_path={adapter}", f"export_dir={out}"]) == 0
    exported = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(exported).__name__ == "LlamaForSequenceClassification" and exported.config.num_labels == 1
    reference = PeftModel.from_pretrained(classifier(), adapter).eval()
    with torch.no_grad():
        got, want = exported(IDS).logits, reference(IDS).logits
    assert got.shape == (2, 1) and (got - want).abs().max().item() < 1e-4


def test_export_errors_are_one_line(causal_adapter, tmp_path, capsys):
    assert main(["export", f"adapter_name_or_path={causal_adapter}"]) == 2
    assert capsys.readouterr().err == "tunelab: error: export_dir is not set: add export_dir=saves/my-model-merged\n"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert main(["export", f"export_dir={tmp_path / 'full'}"]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main(["export", f"export_dir={tmp_path / 'o'}", "export_size=lots"]) == 2
    assert "export_size: cannot read 'lots'" in capsys.readouterr().err


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_vision_lora_export_saves_model_and_processor_that_load_with_plain_transformers(tmp_path):
    from PIL import Image  # noqa: PLC0415
    from transformers import AutoModelForImageTextToText, AutoProcessor  # noqa: PLC0415

    from tunelab.assets import TINY_VISION_DIR  # noqa: PLC0415

    # LoRA on the language model's linears only (the tower's are named q_proj... too: scope them by path).
    torch.manual_seed(0)
    adapter = tmp_path / "adapter"
    peft_model = get_peft_model(
        AutoModelForImageTextToText.from_pretrained(TINY_VISION_DIR),
        LoraConfig(r=4, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)", init_lora_weights=False),
    )
    peft_model.save_pretrained(adapter)
    out = tmp_path / "merged"
    assert main(["export", "model_name_or_path=tiny-vision", f"adapter_name_or_path={adapter}", f"export_dir={out}",
                 "template=chatml", "export_dtype=float32"]) == 0
    assert not (out / "adapter_config.json").exists()

    processor = AutoProcessor.from_pretrained(out)
    exported = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert type(processor).__name__ == "LlavaProcessor" and type(exported).__name__ == "LlavaForConditionalGeneration"
    text = processor.apply_chat_template([{"role": "user", "content": "<image>How many circles are there?"}],
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\n<image>How many circles are there?<|im_end|>\n<|im_start|>assistant\n"
    batch = processor(images=[Image.new("RGB", (64, 64), (30, 170, 50))], text=text, return_tensors="pt")
    reference = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(TINY_VISION_DIR), adapter).eval()
    base = AutoModelForImageTextToText.from_pretrained(TINY_VISION_DIR).eval()
    with torch.no_grad():
        got, want, before = exported(**batch).logits, reference(**batch).logits, base(**batch).logits
    assert (got - want).abs().max().item() < 1e-4
    assert (want - before).abs().max().item() > 1e-2
