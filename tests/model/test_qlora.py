"""QLoRA on CPU: LoRA gradients over 4-bit weights equal an fp32 twin's, also after an eval pass (quantization.py).

The twin is the same tiny Llama in float32 whose linear weights are the dequantized 4-bit weights and whose LoRA
weights are copies, so any gradient difference beyond float noise is a bug in the quantized path.
"""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install 'tunelab[qlora]')")

from transformers import AutoModelForCausalLM  # noqa: E402

from tunelab.config.args import FinetuningArguments, ModelArguments  # noqa: E402
from tunelab.config.training_args import TrainingArguments  # noqa: E402
from tunelab.model.adapters import setup_finetuning  # noqa: E402
from tunelab.model.load import count_parameters, load_model  # noqa: E402
from tunelab.model.tokenizer import load_tokenizer  # noqa: E402
from tunelab.model.quantization import (  # noqa: E402
    CPU_PACKING_SWITCH,
    build_quantization_config,
    is_cpu_packed,
    keep_4bit_trainable_on_cpu,
)

TOTAL = 106816  # tiny_llama_dir's parameters, counted by hand in test_load.py
LORA_R4 = 2 * 4 * (64 + 64 + 64 + 32 + 64 + 32 + 64 + 64 + 64 + 128 + 64 + 128 + 128 + 64)  # 8192
TOLERANCE = 1e-4  # relative; float32 noise is ~1e-6, the broken path is off by tens of percent
IDS = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def training_args(tmp_path_factory):
    return TrainingArguments(output_dir=str(tmp_path_factory.mktemp("out")), use_cpu=True)


def _qlora(model_dir, training_args, *, emulate_avx512bf16: bool, fix: bool = True):
    """The QLoRA model as load_model builds it; optionally as on a CPU with AVX512-BF16, optionally without the fix."""
    model_args = ModelArguments(model_name_or_path=str(model_dir), quantization_bit=4)
    finetuning_args = FinetuningArguments(lora_rank=4)
    if not emulate_avx512bf16 and fix:
        return load_model(model_args, finetuning_args, training_args, load_tokenizer(model_args))
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, quantization_config=build_quantization_config(model_args, torch.float32)
    )
    if emulate_avx512bf16:  # what bitsandbytes sets on a CPU with AVX512-BF16 (Sapphire Rapids and later)
        for module in model.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                setattr(module, CPU_PACKING_SWITCH, True)
    if fix:
        keep_4bit_trainable_on_cpu(model)
    model.config.use_cache = False
    return setup_finetuning(model, finetuning_args, training_args)


def _randomise_lora(model):
    # LoRA B starts at zero, which would make every lora_A gradient zero and hide errors.
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


def _fp32_twin(model, model_dir, training_args):
    twin = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.get_base_model().named_modules():
            if isinstance(module, bnb.nn.Linear4bit):
                weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
                twin.get_submodule(name.removesuffix(".base_layer")).weight.copy_(weight)
    twin = setup_finetuning(twin, FinetuningArguments(lora_rank=4), training_args)
    twin.load_state_dict({n: p for n, p in model.state_dict().items() if "lora_" in n}, strict=False)
    return twin


def _lora_grads(model):
    model.train()
    model.zero_grad()
    model(input_ids=IDS, labels=IDS).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if "lora_" in name}


def _relative_difference(grads, reference):
    assert grads.keys() == reference.keys() and len(grads) == 28
    return max(((grads[n] - reference[n]).abs().max() / reference[n].abs().max()).item() for n in grads)


def _eval_pass(model):
    model.eval()  # what Trainer's evaluation loop does between training steps
    with torch.no_grad():
        model(input_ids=IDS)
    model.train()


@pytest.mark.parametrize("emulate_avx512bf16", [False, True], ids=["this-cpu", "avx512bf16-cpu"])
def test_lora_gradients_match_fp32_twin_before_and_after_eval(tiny_llama_dir, training_args, emulate_avx512bf16):
    model = _qlora(tiny_llama_dir, training_args, emulate_avx512bf16=emulate_avx512bf16)
    _randomise_lora(model)
    twin = _fp32_twin(model, tiny_llama_dir, training_args)
    reference = _lora_grads(twin)

    before = _relative_difference(_lora_grads(model), reference)
    _eval_pass(model)
    after = _relative_difference(_lora_grads(model), reference)
    print(f"\nwith fix ({'emulated AVX512-BF16' if emulate_avx512bf16 else 'this CPU'}): "
          f"before eval {before:.2e}, after eval {after:.2e}")
    assert before < TOLERANCE
    assert not is_cpu_packed(model)
    assert after < TOLERANCE


def test_without_the_fix_eval_breaks_gradients(tiny_llama_dir, training_args):
    """The trap itself, so the fix above cannot pass vacuously; if this fails, bitsandbytes changed:
    check whether keep_4bit_trainable_on_cpu is still needed."""
    model = _qlora(tiny_llama_dir, training_args, emulate_avx512bf16=True, fix=False)
    _randomise_lora(model)
    twin = _fp32_twin(model, tiny_llama_dir, training_args)
    reference = _lora_grads(twin)

    before = _relative_difference(_lora_grads(model), reference)
    _eval_pass(model)
    with pytest.warns(UserWarning, match="autograd kernel was not registered"):
        after = _relative_difference(_lora_grads(model), reference)
    print(f"\nwithout fix (emulated AVX512-BF16): before eval {before:.2e}, after eval {after:.2e}")
    assert before < TOLERANCE
    assert is_cpu_packed(model)
    assert after > 0.05


def test_qlora_counts_the_4bit_elements(tiny_llama_dir, training_args):
    model = _qlora(tiny_llama_dir, training_args, emulate_avx512bf16=False)
    assert isinstance(model.get_base_model().model.layers[0].self_attn.q_proj.base_layer, bnb.nn.Linear4bit)
    assert count_parameters(model) == (LORA_R4, TOTAL + LORA_R4) == (8192, 115008)


def test_8bit_lora_trains_on_cpu(tiny_llama_dir, training_args):
    model_args = ModelArguments(model_name_or_path=str(tiny_llama_dir), quantization_bit=8)
    model = load_model(model_args, FinetuningArguments(lora_rank=4), training_args, load_tokenizer(model_args))
    base = model.get_base_model()
    assert isinstance(base.model.layers[0].mlp.down_proj.base_layer, bnb.nn.Linear8bitLt)
    assert count_parameters(model) == (LORA_R4, TOTAL + LORA_R4)
    _randomise_lora(model)

    twin = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, bnb.nn.Linear8bitLt):  # int8 rows times their absmax / 127
                weight = module.weight.data.float() * module.weight.SCB.unsqueeze(1) / 127
                twin.get_submodule(name.removesuffix(".base_layer")).weight.copy_(weight)
    twin = setup_finetuning(twin, FinetuningArguments(lora_rank=4), training_args)
    twin.load_state_dict({n: p for n, p in model.state_dict().items() if "lora_" in n}, strict=False)
    reference = _lora_grads(twin)

    before = _relative_difference(_lora_grads(model), reference)
    _eval_pass(model)
    after = _relative_difference(_lora_grads(model), reference)
    print(f"\n8-bit: before eval {before:.2e}, after eval {after:.2e}")
    assert before < TOLERANCE and after < TOLERANCE
