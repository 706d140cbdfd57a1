"""QAT and quantized export (model/qat.py, model/export.py): torchao's fake quantisation is the arithmetic of the
quantized model it exports to, the export round-trips through plain transformers, and bad input fails in one line.

The equalities are exact where the same float operations run (a fake-quantized layer against torchao's
quantize/dequantize primitives); the whole converted model is held to 1e-4 of the fake-quantized one
(float32 logits of magnitude ~10; measured: 0).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

torchao = pytest.importorskip("torchao", reason="torchao is not installed (pip install 'tunelab[qat]')")

from torchao.quantization import IntxUnpackedToInt8Tensor, quantize_  # noqa: E402
from torchao.quantization.qat import FakeQuantizedLinear  # noqa: E402
from torchao.quantization.quant_primitives import (  # noqa: E402
    MappingType,
    choose_qparams_affine,
    dequantize_affine,
    quantize_affine,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerControl, TrainerState  # noqa: E402

from tunelab.assets import TINY_MODEL_DIR  # noqa: E402
from tunelab.cli import main  # noqa: E402
from tunelab.config.args import FinetuningArguments, ModelArguments  # noqa: E402
from tunelab.config.training_args import TrainingArguments  # noqa: E402
from tunelab.preflight import load_config  # noqa: E402
from tunelab.errors import ConfigError  # noqa: E402
from tunelab.model.load import load_model  # noqa: E402
from tunelab.model.tokenizer import load_tokenizer  # noqa: E402
from tunelab.train.callbacks import QATStartCallback  # noqa: E402
from tunelab.model.qat import (  # noqa: E402
    SCHEMES,
    fake_quantized_layers,
    prepare_qat,
    ptq_config,
    quantized_layers,
)

IDS = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))
WEIGHT_BITS = {"int8-int4": (-8, 7), "int4-weight": (-8, 7), "int8-weight": (-128, 127)}
TOLERANCE = 1e-4


def _quantize_dequantize(x: torch.Tensor, block_size: tuple[int, ...], mapping: MappingType, bounds) -> torch.Tensor:
    """torchao's reference round trip: choose scale (and zero point), quantize to integers, dequantize."""
    qmin, qmax = bounds
    scale, zero = choose_qparams_affine(x, mapping, block_size, torch.int8, quant_min=qmin, quant_max=qmax)
    q = quantize_affine(x, block_size, scale, zero, torch.int8, qmin, qmax)
    assert q.min() >= qmin and q.max() <= qmax
    return dequantize_affine(q, block_size, scale, zero, torch.int8, qmin, qmax)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_fake_quantized_layer_equals_the_quantize_dequantize_reference(scheme):
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(128, 64, bias=True))
    weight, bias = layer[0].weight.detach().clone(), layer[0].bias.detach().clone()
    x = torch.randn(3, 5, 128)
    prepare_qat(layer, scheme, group_size=32)
    assert isinstance(layer[0], FakeQuantizedLinear)

    w_ref = _quantize_dequantize(weight, (1, 32), MappingType.SYMMETRIC, WEIGHT_BITS[scheme])
    x_ref = x
    if scheme == "int8-int4":  # activations: int8, one scale and zero point per token
        x_ref = _quantize_dequantize(x, (1, 1, 128), MappingType.ASYMMETRIC, (-128, 127))
    with torch.no_grad():
        got = layer(x)
    assert torch.equal(got, F.linear(x_ref, w_ref, bias))
    assert not torch.equal(got, F.linear(x, weight, bias))  # it does quantize

    converted = torch.nn.Sequential(torch.nn.Linear(128, 64, bias=True))
    converted[0].weight.data.copy_(weight)
    converted[0].bias.data.copy_(bias)
    quantize_(converted, ptq_config(scheme, 32))  # what export applies
    assert isinstance(converted[0].weight, IntxUnpackedToInt8Tensor)
    assert torch.equal(converted[0].weight.dequantize(), w_ref)


def test_prepare_covers_the_layers_export_quantizes_and_keeps_weights(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = set(quantized_layers(model))
    assert len(names) == 2 * 7 and "lm_head" not in names
    rng = torch.get_rng_state()
    assert prepare_qat(model, "int8-int4", 32) == 14
    assert torch.equal(torch.get_rng_state(), rng)  # LoRA set up next starts as it would without qat
    assert {name for name, module in model.named_modules() if isinstance(module, FakeQuantizedLinear)} == names
    after = model.state_dict()
    assert after.keys() == before.keys()  # a QAT checkpoint loads into a plain model and back
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_start_step_switches_fake_quantisation_on_by_step_count(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = model(IDS).logits
    prepare_qat(model, "int4-weight", 32, enabled=False)
    callback, control = QATStartCallback(start_step=2), TrainerControl()
    state = TrainerState(max_steps=4)
    callback.on_train_begin(None, state, control, model=model)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, plain)
    state.global_step = 1
    callback.on_step_begin(None, state, control, model=model)
    assert not any(layer.weight_fake_quantizer.enabled for layer in fake_quantized_layers(model))
    state.global_step = 2  # the third step is the first quantized one
    callback.on_step_begin(None, state, control, model=model)
    assert all(layer.weight_fake_quantizer.enabled for layer in fake_quantized_layers(model))
    with torch.no_grad():
        assert not torch.equal(model(IDS).logits, plain)

    resumed = QATStartCallback(start_step=2)  # a run resumed at step 3 starts quantized
    prepare_qat(fresh := AutoModelForCausalLM.from_pretrained(tiny_llama_dir), "int4-weight", 32, enabled=False)
    resumed.on_train_begin(None, TrainerState(global_step=3, max_steps=4), control, model=fresh)
    assert all(layer.weight_fake_quantizer.enabled for layer in fake_quantized_layers(fresh))


def test_lora_wraps_the_fake_quantized_base(tiny_llama_dir, tmp_path):
    model_args = ModelArguments(model_name_or_path=str(tiny_llama_dir))
    finetuning_args = FinetuningArguments(finetuning_type="lora", lora_rank=4, qat="int8-int4", qat_group_size=32)
    model = load_model(model_args, finetuning_args, TrainingArguments(output_dir=str(tmp_path), use_cpu=True),
                       load_tokenizer(model_args))
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, FakeQuantizedLinear) and not q_proj.base_layer.weight.requires_grad
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    assert len(fake_quantized_layers(model)) == 14


def _export(tmp_path, model: str, scheme: str, *extra: str):
    """Export's own read-back check runs once below (int4-weight): torchao's CPU kernels generate its greedy answers
    at a few tokens per second, 20 s per export; these tests compare the model themselves."""
    out = tmp_path / f"export-{scheme}"
    parity = [] if any(option.startswith("export_parity=") for option in extra) else ["export_parity=false"]
    assert main(["export", f"model_name_or_path={model}", f"export_dir={out}", f"export_quantization={scheme}",
                 "template=chatml", *parity, *extra]) == 0
    return out


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_quantized_export_round_trips_and_matches_the_fake_quantized_model(tmp_path, scheme):
    checked = scheme == "int4-weight"
    out = _export(tmp_path, str(TINY_MODEL_DIR), scheme, f"export_parity={str(checked).lower()}")
    if checked:  # the export read itself back with plain transformers + torchao: within the scheme's tolerance
        report = json.loads((out / "export_report.json").read_text())
        (reader,) = report["readers"]
        assert (report["ok"], report["tensor_type"], reader["reader"]) == (True, "torchao", "transformers")
        assert 0 < reader["max_logit_gap"] <= reader["tolerance"] and reader["ids_identical"]
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "torchao"
    assert config["quantization_config"]["modules_to_not_convert"] == ["lm_head"]
    assert not any(p.name.startswith(".merged") for p in out.iterdir())  # the scratch folder is gone

    exported = AutoModelForCausalLM.from_pretrained(out).eval()  # plain transformers (+ torchao)
    quantized = {
        name for name, m in exported.named_modules() if isinstance(getattr(m, "weight", None), IntxUnpackedToInt8Tensor)
    }
    reference = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    assert quantized == set(quantized_layers(reference))
    prepare_qat(reference, scheme, 32)
    ids = IDS % exported.config.vocab_size
    with torch.no_grad():
        got, want = exported(ids).logits, reference(ids).logits
    assert (got - want).abs().max().item() < TOLERANCE

    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "sort: 3 1 2"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    generated = exported.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    weights = (out / "model.safetensors").stat().st_size
    assert weights < 0.45 * (TINY_MODEL_DIR / "model.safetensors").stat().st_size  # int8 storage + float32 embedding


def test_export_group_size_follows_the_qat_run(tmp_path, tiny_llama_dir):
    trained = tmp_path / "trained"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    model.save_pretrained(trained)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(trained)
    (trained / "tunelab_config.yaml").write_text("qat: int4-weight\nqat_group_size: 16\n")
    out = _export(tmp_path, str(trained), "int4-weight")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_type"]["default"]["_data"]["granularity"]["_data"]["group_size"] == 16
    assert "qat_group_size: 16" in (out / "tunelab_config.yaml").read_text()


# ---- bad input: one line each ---------------------------------------------------------------------------------


def _train_config(tmp_path, **options):
    base = {"dataset": "demo_sort", "template": "chatml", "output_dir": str(tmp_path / "out"), "qat": "int8-int4"}
    return load_config(None, {**base, **{k: str(v) for k, v in options.items()}})


def test_unknown_scheme_says_the_closest_one(tmp_path):
    with pytest.raises(ConfigError, match=r"^qat: 'int8_int4' is not a quantization scheme; did you mean 'int8-int4'\? "
                                          r"schemes: int8-int4, int4-weight, int8-weight$"):
        _train_config(tmp_path, qat="int8_int4")
    with pytest.raises(ConfigError, match=r"^qat: '8da4w' .* did you mean 'int8-int4'\?"):
        _train_config(tmp_path, qat="8da4w")
    with pytest.raises(ConfigError, match=r"^export_quantization: 'int4-weights' .* did you mean 'int4-weight'\?"):
        load_config(None, {"export_dir": str(tmp_path / "e"), "export_quantization": "int4-weights"}, purpose="export")


def test_qat_with_qlora_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^qat and quantization_bit \(4-bit QLoRA\) cannot train together"):
        _train_config(tmp_path, quantization_bit=4)


def test_group_size_that_does_not_divide_a_layer_names_it(tmp_path, tiny_llama_dir):
    with pytest.raises(ConfigError, match=r"^qat_group_size: 48 does not divide the input width 64 of layer "
                                          r"model\.layers\.0\.self_attn\.q_proj; use one that divides every layer's "
                                          r"input width: 16, 32, 64$"):
        _train_config(tmp_path, model_name_or_path=tiny_llama_dir, qat_group_size=48)
    with pytest.raises(ConfigError, match=r"^qat_group_size: 256 does not divide the input width 128 of layer "
                                          r"model\.layers\.0\.self_attn\.q_proj"):
        load_config(None, {"export_dir": str(tmp_path / "e"), "export_quantization": "int8-weight",
                           "qat_group_size": "256"}, purpose="export")


def test_quantized_export_of_an_adapter_without_its_base_is_refused(tmp_path):
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "tiny"}')
    with pytest.raises(ConfigError, match=rf"^export_quantization: model_name_or_path {adapter} is a LoRA adapter "
                                          "without its base; set model_name_or_path to the base model and "
                                          "adapter_name_or_path to the adapter"):
        load_config(None, {"model_name_or_path": str(adapter), "export_dir": str(tmp_path / "e"),
                           "export_quantization": "int8-int4"}, purpose="export")


def test_other_qat_misuse_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^qat applies to stages pt and sft \(got stage: dpo\): remove qat$"):
        _train_config(tmp_path, stage="dpo", dataset="demo_preference")
    with pytest.raises(ConfigError, match=r"^qat_start_step only applies with qat"):
        load_config(None, {"dataset": "demo_sort", "template": "chatml", "output_dir": str(tmp_path / "o"),
                           "qat_start_step": "10"})
    assert _train_config(tmp_path).finetuning.qat_group_size == 32  # recorded as trained


def test_training_a_quantized_export_is_refused(tmp_path):
    out = _export(tmp_path, str(TINY_MODEL_DIR), "int8-weight")
    with pytest.raises(ConfigError, match=rf"^model_name_or_path: {out} holds torchao-quantized weights"):
        _train_config(tmp_path, model_name_or_path=out)


def test_the_example_config_resolves(tmp_path):
    example = Path(__file__).resolve().parents[2] / "examples" / "qat.yaml"
    config = load_config(str(example), {"output_dir": str(tmp_path / "out")})
    assert (config.finetuning.qat, config.finetuning.qat_group_size, config.finetuning.stage) == ("int8-int4", 32, "sft")
