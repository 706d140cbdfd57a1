"""Which parameters train for full / freeze / LoRA, the config checks that need the model, and adapter round trips."""

from __future__ import annotations

import math

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tunelab.config.args import FinetuningArguments, ModelArguments
from tunelab.config.training_args import TrainingArguments
from tunelab.errors import ConfigError
from tunelab.model.load import count_parameters, load_model

# tiny_llama_dir by hand (see test_load.py): V=256, H=64, I=128, 2 layers, K/V width 32.
from tunelab.model.tokenizer import load_tokenizer
V, H, I, KV = 256, 64, 128, 32
LAYER = H * H + 2 * H * KV + H * H + 3 * H * I + 2 * H  # 36992
TOTAL = V * H + 2 * LAYER + H + V * H  # 106816
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
# (in, out) of each linear layer of a decoder layer, for LoRA sizes r * (in + out).
SHAPES = {"q_proj": (H, H), "k_proj": (H, KV), "v_proj": (H, KV), "o_proj": (H, H),
          "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}


@pytest.fixture(scope="module")
def training_args(tmp_path_factory):
    return TrainingArguments(output_dir=str(tmp_path_factory.mktemp("out")), use_cpu=True)


def _load(model_dir, training_args, model_kwargs=None, is_trainable=True, **finetuning):
    model_args = ModelArguments(model_name_or_path=str(model_dir), **(model_kwargs or {}))
    finetuning_args = FinetuningArguments(**finetuning)
    return load_model(model_args, finetuning_args, training_args, load_tokenizer(model_args), is_trainable)


def _trainable(model):
    return [name for name, p in model.named_parameters() if p.requires_grad]


def _lora_size(r, names=PROJ, layers=2):
    return layers * sum(r * sum(SHAPES[n]) for n in names)


# ---- full and freeze ----------------------------------------------------------------------------------------


def test_full_trains_everything(tiny_llama_dir, training_args):
    model = _load(tiny_llama_dir, training_args, finetuning_type="full")
    assert count_parameters(model) == (TOTAL, TOTAL)


def test_freeze_last_layer_all_modules(tiny_llama_dir, training_args):
    model = _load(tiny_llama_dir, training_args, finetuning_type="freeze", freeze_trainable_layers=1)
    expected = [f"model.layers.1.self_attn.{p}.weight" for p in ATTN]
    expected += [f"model.layers.1.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    expected += ["model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"]
    assert _trainable(model) == expected
    assert count_parameters(model) == (LAYER, TOTAL)


def test_freeze_first_layer_named_modules_and_extras(tiny_llama_dir, training_args):
    model = _load(
        tiny_llama_dir, training_args, finetuning_type="freeze", freeze_trainable_layers=-1,
        freeze_trainable_modules=["mlp", "q_proj"], freeze_extra_modules=["embed_tokens", "norm"],
    )
    assert _trainable(model) == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.norm.weight",
    ]
    assert count_parameters(model) == (V * H + H * H + 3 * H * I + H, TOTAL)


def test_freeze_finds_layers_of_another_architecture(tiny_qwen2_dir, training_args):
    model = _load(tiny_qwen2_dir, training_args, finetuning_type="freeze", freeze_trainable_layers=2,
                  freeze_trainable_modules=["self_attn"])
    trainable = _trainable(model)
    assert len(trainable) == 2 * 7  # q/k/v weight + bias, o weight, in layers 1 and 2
    assert {name.split(".")[2] for name in trainable} == {"1", "2"}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"freeze_trainable_layers": 3},
         "freeze_trainable_layers: 3 does not fit the 2 decoder layers of LlamaForCausalLM; "
         "use 1..2 (last N) or -1..-2 (first N)"),
        ({"freeze_trainable_layers": 0},
         "freeze_trainable_layers: 0 does not fit the 2 decoder layers of LlamaForCausalLM; "
         "use 1..2 (last N) or -1..-2 (first N)"),
        ({"freeze_trainable_modules": ["attn"]},
         "freeze_trainable_modules: 'attn' matches nothing in the decoder layers of LlamaForCausalLM; names there: "
         "self_attn, q_proj, k_proj, v_proj, o_proj, mlp, gate_proj, up_proj, down_proj, input_layernorm, "
         "post_attention_layernorm"),
        ({"freeze_extra_modules": ["embeddings"]},
         "freeze_extra_modules: 'embeddings' matches no module of LlamaForCausalLM; "
         "modules outside the decoder layers: embed_tokens, norm, lm_head"),
    ],
)
def test_freeze_config_errors(tiny_llama_dir, training_args, options, message):
    with pytest.raises(ConfigError) as err:
        _load(tiny_llama_dir, training_args, finetuning_type="freeze", **options)
    assert str(err.value) == message


# ---- LoRA ---------------------------------------------------------------------------------------------------


def test_lora_all_targets_every_linear_but_the_head(tiny_llama_dir, training_args):
    model = _load(tiny_llama_dir, training_args, finetuning_type="lora")
    expected = {
        f"model.layers.{i}.{'self_attn' if p in ATTN else 'mlp'}.{p}" for i in range(2) for p in PROJ
    }
    assert set(model.targeted_module_names) == expected
    config = model.peft_config["default"]
    assert config.r == 8 and config.lora_alpha == 16 and config.lora_dropout == 0.0
    assert count_parameters(model) == (_lora_size(8), TOTAL + _lora_size(8)) == (16384, 123200)


def test_lora_all_skips_a_tied_head(tiny_qwen2_dir, training_args):
    model = _load(tiny_qwen2_dir, training_args, finetuning_type="lora", lora_rank=4)
    assert sorted(model.peft_config["default"].target_modules) == sorted(PROJ)
    assert len(model.targeted_module_names) == 3 * 7
    assert count_parameters(model)[0] == _lora_size(4, layers=3)


def test_lora_named_targets_alpha_and_additional_target(tiny_llama_dir, training_args):
    model = _load(tiny_llama_dir, training_args, finetuning_type="lora", lora_rank=4, lora_alpha=32,
                  lora_target=["q_proj", "v_proj"], additional_target=["embed_tokens"])
    assert set(model.targeted_module_names) == {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in
                                                ("q_proj", "v_proj")}
    assert model.peft_config["default"].lora_alpha == 32
    assert model.peft_config["default"].modules_to_save == ["embed_tokens"]
    # LoRA on q and v plus a trainable copy of the embeddings (the original stays, frozen).
    lora = _lora_size(4, ("q_proj", "v_proj"))
    assert count_parameters(model) == (lora + V * H, TOTAL + lora + V * H)


def test_bad_lora_target_names_the_modules(tiny_llama_dir, training_args):
    with pytest.raises(ConfigError) as err:
        _load(tiny_llama_dir, training_args, finetuning_type="lora", lora_target=["q_proj", "xyz"])
    assert str(err.value) == (
        "lora_target: 'xyz' matches no module of LlamaForCausalLM; "
        "modules: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head; groups: all, attention, mlp"
    )


def test_lora_target_groups_expand_per_family_and_say_so(tiny_llama_dir, training_args, caplog):
    caplog.set_level("INFO", logger="tunelab.model.adapters")
    model = _load(tiny_llama_dir, training_args, finetuning_type="lora", lora_target=["attention", "down_proj"])
    assert set(model.targeted_module_names) == (
        {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ATTN} | {f"model.layers.{i}.mlp.down_proj" for i in range(2)}
    )
    assert "lora_target: attention → q_proj, k_proj, v_proj, o_proj (LlamaForCausalLM)" in caplog.messages
    model = _load(tiny_llama_dir, training_args, finetuning_type="lora", lora_target=["mlp"])
    assert {n.rsplit(".", 1)[-1] for n in model.targeted_module_names} == {"gate_proj", "up_proj", "down_proj"}
    assert "lora_target: mlp → gate_proj, up_proj, down_proj (LlamaForCausalLM)" in caplog.messages
    _load(tiny_llama_dir, training_args, finetuning_type="lora")
    assert ("lora_target: all → down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (LlamaForCausalLM, "
            "every linear layer but the output head)") in caplog.messages


def test_lora_target_groups_qualify_names_shared_across_groups(training_args):
    """GPT-2 has c_proj in both attention and MLP: 'attention' must not put LoRA on mlp.c_proj."""
    from transformers import GPT2Config, GPT2LMHeadModel  # noqa: PLC0415

    from tunelab.model.adapters import lora_target_modules  # noqa: PLC0415

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    assert lora_target_modules(model, ["attention"]) == ["c_attn", "attn.c_proj"]
    assert lora_target_modules(model, ["mlp"]) == ["c_fc", "mlp.c_proj"]


def test_lora_target_all_with_names_fails(tiny_llama_dir, training_args):
    with pytest.raises(ConfigError, match=r"^lora_target: 'all' cannot be combined with other names, got all,q_proj$"):
        _load(tiny_llama_dir, training_args, finetuning_type="lora", lora_target=["all", "q_proj"])


def test_bad_additional_target(tiny_llama_dir, training_args):
    with pytest.raises(ConfigError) as err:
        _load(tiny_llama_dir, training_args, finetuning_type="lora", additional_target=["embed"])
    assert str(err.value).startswith("additional_target: 'embed' matches no module of LlamaForCausalLM; modules: ")


def test_dora_switch(tiny_llama_dir, training_args):
    model = _load(tiny_llama_dir, training_args, finetuning_type="lora", use_dora=True)
    assert model.peft_config["default"].use_dora is True
    # DoRA adds one magnitude per output feature of every adapted layer.
    magnitudes = 2 * sum(out for _, out in SHAPES.values())
    assert count_parameters(model)[0] == _lora_size(8) + magnitudes == 16384 + 1024


def test_rslora_switch(tiny_llama_dir, training_args):
    model = _load(tiny_llama_dir, training_args, finetuning_type="lora", use_rslora=True)
    assert model.peft_config["default"].use_rslora is True
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q_proj.scaling["default"] == pytest.approx(16 / math.sqrt(8))


def test_mixed_precision_keeps_trainable_weights_float32(tiny_llama_dir, tmp_path):
    bf16 = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, bf16=True)
    lora = _load(tiny_llama_dir, bf16, finetuning_type="lora", additional_target=["norm"])
    freeze = _load(tiny_llama_dir, bf16, finetuning_type="freeze", freeze_trainable_layers=1)
    full = _load(tiny_llama_dir, bf16, finetuning_type="full")
    for model in (lora, freeze):
        dtypes = {(p.requires_grad, p.dtype) for p in model.parameters()}
        assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}
    assert {p.dtype for p in full.parameters()} == {torch.float32}  # float32 masters: loaded so, nothing rounded
    # pure_bf16: the trainable weights are bf16 themselves (LoRA adapters stay float32: peft's choice).
    pure = {kind: _load(tiny_llama_dir, bf16, finetuning_type=kind, pure_bf16=True, freeze_trainable_layers=1)
            for kind in ("full", "freeze")}
    assert {p.dtype for p in pure["full"].parameters()} == {torch.bfloat16}
    assert {(p.requires_grad, p.dtype) for p in pure["freeze"].parameters()} == {(True, torch.bfloat16), (False, torch.bfloat16)}
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as Trainer runs a bf16 step
        freeze(input_ids=torch.tensor([[5, 6, 7]]), labels=torch.tensor([[5, 6, 7]])).loss.backward()
    assert all(p.grad is not None for p in freeze.parameters() if p.requires_grad)


def test_activation_checkpointing_lora_gets_gradients_without_extra_steps(tiny_llama_dir, tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, activation_checkpointing=True)
    model = _load(tiny_llama_dir, args, finetuning_type="lora")
    # As Trainer does; reentrant checkpointing is the case that needs inputs requiring grad.
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    model(input_ids=torch.tensor([[5, 6, 7]]), labels=torch.tensor([[5, 6, 7]])).loss.backward()
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 14 and all(p.grad is not None for p in lora_b)


def test_adapter_with_freeze_fails(tiny_llama_dir, training_args, tmp_path):
    with pytest.raises(ConfigError, match=r"^adapter_name_or_path: continuing training .* got 'freeze'$"):
        _load(tiny_llama_dir, training_args, {"adapter_name_or_path": str(tmp_path)}, finetuning_type="freeze")


# ---- saved adapters -----------------------------------------------------------------------------------------


def test_saved_adapter_loads_with_plain_peft(tiny_llama_dir, training_args, tmp_path):
    model = _load(tiny_llama_dir, training_args, finetuning_type="lora", lora_rank=4)
    torch.manual_seed(3)
    with torch.no_grad():  # LoRA B starts at zero; give the adapter weights that change the logits
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.1)
    model.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[1, 5, 9, 200, 17, 2]])
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=ids).logits

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with torch.no_grad():
        before = base(input_ids=ids).logits
    plain = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        reloaded = plain(input_ids=ids).logits
    assert not torch.allclose(before, trained, atol=1e-3)
    assert torch.allclose(reloaded, trained, atol=1e-6, rtol=0)

    ours = _load(tiny_llama_dir, training_args, {"adapter_name_or_path": str(tmp_path / "adapter")},
                 is_trainable=False)
    with torch.no_grad():
        assert torch.allclose(ours(input_ids=ids).logits, trained, atol=1e-6, rtol=0)
    assert count_parameters(ours)[0] == 0

    resumed = _load(tiny_llama_dir, training_args, {"adapter_name_or_path": str(tmp_path / "adapter")},
                    finetuning_type="lora")
    assert count_parameters(resumed)[0] == _lora_size(4)
