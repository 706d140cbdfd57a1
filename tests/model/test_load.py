"""load_tokenizer / load_model / count_parameters on tiny random models (built by tests/conftest.py)."""

from __future__ import annotations

import logging
import re
import shutil

import pytest
import safetensors.torch
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from tunelab.config.args import FinetuningArguments, ModelArguments
from tunelab.config.training_args import TrainingArguments
from tunelab.errors import ModelError
from tunelab.model.load import count_parameters, load_model

# tiny_llama_dir by hand: vocab V=256, hidden H=64, intermediate I=128, 2 layers, 4 heads of 16, 2 KV heads.
from tunelab.model.tokenizer import load_tokenizer
from tunelab.model.resolve import resolve_dtype
V, H, I, KV = 256, 64, 128, 2 * 16
LLAMA_LAYER = H * H + 2 * H * KV + H * H + 3 * H * I + 2 * H  # q, k+v, o, gate/up/down, two RMSNorms = 36992
LLAMA_TOTAL = V * H + 2 * LLAMA_LAYER + H + V * H  # embed, layers, final norm, untied lm_head = 106816
# tiny_qwen2_dir: same sizes, 3 layers, q/k/v biases (64 + 32 + 32), head tied to the embeddings (counted once).
QWEN2_TOTAL = V * H + 3 * (LLAMA_LAYER + H + 2 * KV) + H


@pytest.fixture(scope="module")
def training_args(tmp_path_factory):
    return TrainingArguments(output_dir=str(tmp_path_factory.mktemp("out")), use_cpu=True)


def _load(model_dir, training_args, is_trainable=True, **model_kwargs):
    model_args = ModelArguments(model_name_or_path=str(model_dir), **model_kwargs)
    tokenizer = load_tokenizer(model_args)
    return load_model(model_args, FinetuningArguments(finetuning_type="full"), training_args, tokenizer, is_trainable)


def _save_tokenizer(folder, **special_tokens):
    vocab = {"<unk>": 0, "</s>": 1, "<pad>": 2, "a": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>" if "unk_token" in special_tokens else None))
    PreTrainedTokenizerFast(tokenizer_object=backend, **special_tokens).save_pretrained(folder)
    return ModelArguments(model_name_or_path=str(folder))


@pytest.mark.parametrize(
    ("special_tokens", "pad", "log"),
    [
        ({"eos_token": "</s>", "unk_token": "<unk>"}, "</s>", "padding with its eos token '</s>'"),
        ({"unk_token": "<unk>"}, "<unk>", "padding with its unk token '<unk>'"),
        ({"eos_token": "</s>", "pad_token": "<pad>"}, "<pad>", None),
    ],
)
def test_pad_token_fallback(tmp_path, caplog, special_tokens, pad, log):
    caplog.set_level(logging.INFO, logger="tunelab.model.tokenizer")
    tokenizer = load_tokenizer(_save_tokenizer(tmp_path, **special_tokens))
    assert tokenizer.pad_token == pad
    assert tokenizer.padding_side == "right"
    messages = [r.getMessage() for r in caplog.records if r.name == "tunelab.model.tokenizer"]
    assert messages == ([f"The tokenizer has no pad token: {log}."] if log else [])


def test_tokenizer_without_pad_eos_or_unk_fails(tmp_path):
    with pytest.raises(ModelError) as err:
        load_tokenizer(_save_tokenizer(tmp_path, bos_token="<pad>"))
    assert str(err.value) == (
        f"model_name_or_path: the tokenizer in {tmp_path} has no pad, eos or unk token; "
        "add a pad_token to its tokenizer_config.json"
    )


def test_missing_tokenizer_fails(tmp_path):
    expected = re.escape(f"model_name_or_path: cannot load a tokenizer from {tmp_path}: ")
    with pytest.raises(ModelError, match=f"^{expected}"):
        load_tokenizer(ModelArguments(model_name_or_path=str(tmp_path)))


def test_full_load_counts_and_training_state(tiny_llama_dir, training_args):
    model = _load(tiny_llama_dir, training_args)
    assert count_parameters(model) == (LLAMA_TOTAL, LLAMA_TOTAL) == (106816, 106816)
    assert model.config.use_cache is False
    assert model.dtype == torch.float32
    assert model.generation_config.pad_token_id == 2  # the tiny tokenizer pads with eos "</s>"


def test_tied_head_counts_once(tiny_qwen2_dir, training_args):
    model = _load(tiny_qwen2_dir, training_args)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert count_parameters(model) == (QWEN2_TOTAL, QWEN2_TOTAL) == (127808, 127808)


def test_inference_load_is_frozen(tiny_llama_dir, training_args):
    model = _load(tiny_llama_dir, training_args, is_trainable=False)
    assert count_parameters(model) == (0, LLAMA_TOTAL)
    assert not model.training
    assert model.config.use_cache is True


@pytest.mark.parametrize(
    ("compute_dtype", "bf16", "fp16", "expected"),
    [
        ("auto", False, False, torch.float32),
        ("auto", True, False, torch.bfloat16),
        ("auto", False, True, torch.float16),
        ("float16", True, False, torch.float16),
        ("float32", True, False, torch.float32),
    ],
)
def test_resolve_dtype(compute_dtype, bf16, fp16, expected):
    class Flags:  # resolve_dtype reads only these two flags; a real TrainingArguments refuses fp16 on CPU
        pass

    flags = Flags()
    flags.bf16, flags.fp16 = bf16, fp16
    assert resolve_dtype(ModelArguments(compute_dtype=compute_dtype), flags) == expected


def test_compute_dtype_reaches_the_weights(tiny_llama_dir, training_args):
    model = _load(tiny_llama_dir, training_args, compute_dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


# sdpa: run once per packed sample for training (model/varlen_sdpa.py)
@pytest.mark.parametrize(("flash_attn", "implementation"), [("disabled", "eager"), ("sdpa", "sdpa_varlen")])
def test_attention_implementation(tiny_llama_dir, training_args, flash_attn, implementation):
    model = _load(tiny_llama_dir, training_args, flash_attn=flash_attn)
    assert model.config._attn_implementation == implementation


def test_fa2_without_flash_attn_fails(tiny_llama_dir, training_args):
    from transformers.utils import is_flash_attn_2_available  # noqa: PLC0415

    if is_flash_attn_2_available():
        pytest.skip("flash-attn is installed here")
    with pytest.raises(ModelError) as err:
        _load(tiny_llama_dir, training_args, flash_attn="fa2")
    assert str(err.value) == "flash_attn: fa2 needs the flash-attn package and a CUDA GPU; set flash_attn: sdpa or auto"


def _copy_without_weights(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    return dst


def test_missing_weights_fail(tiny_llama_dir, tmp_path, training_args):
    folder = _copy_without_weights(tiny_llama_dir, tmp_path / "m")
    with pytest.raises(ModelError) as err:
        _load(folder, training_args)
    assert str(err.value).startswith(f"model_name_or_path: cannot load the model from {folder}: ")
    assert "model.safetensors" in str(err.value) and "\n" not in str(err.value)


def test_corrupt_weights_fail(tiny_llama_dir, tmp_path, training_args):
    folder = _copy_without_weights(tiny_llama_dir, tmp_path / "m")
    (folder / "model.safetensors").write_bytes((tiny_llama_dir / "model.safetensors").read_bytes()[:1000])
    expected = re.escape(f"model_name_or_path: cannot load the model from {folder}: ")
    with pytest.raises(ModelError, match=f"^{expected}"):
        _load(folder, training_args)


def test_incomplete_weights_fail(tiny_llama_dir, tmp_path, training_args):
    folder = _copy_without_weights(tiny_llama_dir, tmp_path / "m")
    state = safetensors.torch.load_file(tiny_llama_dir / "model.safetensors")
    del state["model.norm.weight"]
    safetensors.torch.save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError) as err:
        _load(folder, training_args)
    assert str(err.value) == (
        f"model_name_or_path: the weights in {folder} lack model.norm.weight; the checkpoint is incomplete"
    )


@pytest.mark.parametrize("use_kernels", [False, True])
def test_hub_kernels_only_when_asked(tiny_llama_dir, training_args, use_kernels):
    # transformers >= 5.25 turns use_kernels on by itself when `kernels` is installed; a GPU then fetches code.
    model = _load(tiny_llama_dir, training_args, use_kernels=use_kernels)
    assert model.use_kernels is use_kernels
