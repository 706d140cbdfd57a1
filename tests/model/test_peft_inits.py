"""LoRA's initialisations (PiSSA, OLoRA, LoftQ) and the other peft methods (OFT, VeRA), set up by model/adapters.py.

What is proved: PiSSA and OLoRA start exactly at the base model, the base keeping W - scale·B·A; an adapter that
started away from zero is saved as a plain LoRA of the original base that reproduces the trained model through
tunelab's loaders (load_adapter: tunelab chat / eval; merge: tunelab export); OFT and VeRA train only their own
parameters and reload to the same logits; the refusals are one line naming the key.
"""

from __future__ import annotations

import json

import pytest
import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.config.configs import write
from tunelab.cli import main
from tunelab.config.args import FinetuningArguments, ModelArguments
from tunelab.config.training_args import TrainingArguments
from tunelab.errors import ConfigError
from tunelab.export.merge import merge_adapter, trained_model
from tunelab.infer.engine import load_engine
from tunelab.model.adapters import load_adapter
from tunelab.model.load import load_model
from tunelab.model.tokenizer import load_tokenizer
from tunelab.preflight import load_config
from tunelab.train.outputs import save_adapter_as_trained

IDS = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The tiny model's matrices are too small to gain from threads; on a busy 2-core machine a second one only waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def training_args(tmp_path_factory):
    return TrainingArguments(output_dir=str(tmp_path_factory.mktemp("out")), use_cpu=True)


def _load(model_dir, training_args, model_kwargs=None, **finetuning):
    """The model as `tunelab train` sets it up (model/load.py: seed, adapter, start)."""
    model_args = ModelArguments(model_name_or_path=str(model_dir), **(model_kwargs or {}))
    return load_model(model_args, FinetuningArguments(**finetuning), training_args, load_tokenizer(model_args))


def _base(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def _lora_layers(model):
    """(name, peft LoRA layer) of every adapted linear layer."""
    return [(name, module) for name, module in model.named_modules() if name.endswith(PROJ) and hasattr(module, "lora_A")]


def _train(model, steps: int, lr: float) -> list[float]:
    """Real optimizer steps (AdamW on the trainable parameters, next-token loss on IDS); the losses."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# ---- PiSSA and OLoRA: the start is the base model --------------------------------------------------------------


@pytest.mark.parametrize("pissa_iter", [-1, 4])
def test_pissa_starts_at_the_base_model_whose_weights_keep_the_residual(tiny_llama_dir, training_args, pissa_iter):
    base = _base(tiny_llama_dir)
    model = _load(tiny_llama_dir, training_args, pissa_init=True, pissa_iter=pissa_iter)
    assert model.peft_config["default"].init_lora_weights == ("pissa" if pissa_iter == -1 else "pissa_niter_4")
    assert (_logits(model) - _logits(base)).abs().max().item() < 1e-5
    layers = _lora_layers(model)
    assert len(layers) == 2 * len(PROJ)
    for name, layer in layers:
        original = base.get_submodule(name.removeprefix("base_model.model.")).weight
        principal = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        torch.testing.assert_close(layer.base_layer.weight, original - principal, atol=1e-6, rtol=0)
        assert principal.norm() > 0.3 * original.norm()  # B·A holds a real part of W, not zero
        if pissa_iter == -1:  # the full SVD: B·A·scale is W's best rank-8 approximation
            u, s, vh = torch.linalg.svd(original, full_matrices=False)
            torch.testing.assert_close(principal, u[:, :8] @ torch.diag(s[:8]) @ vh[:8], atol=1e-5, rtol=0)


def test_olora_starts_at_the_base_model(tiny_llama_dir, training_args):
    base = _base(tiny_llama_dir)
    model = _load(tiny_llama_dir, training_args, init_lora_weights="olora")
    assert (_logits(model) - _logits(base)).abs().max().item() < 1e-5
    for name, layer in _lora_layers(model):
        b = layer.lora_B["default"].weight  # Q of W's QR decomposition: orthonormal columns
        torch.testing.assert_close(b.T @ b, torch.eye(8), atol=1e-5, rtol=0)
        assert not torch.equal(layer.base_layer.weight, base.get_submodule(name.removeprefix("base_model.model.")).weight)


# ---- saved as a plain LoRA of the original base ----------------------------------------------------------------


@pytest.mark.parametrize("options", [
    {"pissa_init": True, "additional_target": ["norm"]},  # fast SVD (pissa_iter 16); a module trained in full
    {"init_lora_weights": "olora", "use_rslora": True},
], ids=["pissa", "olora-rslora"])
def test_adapter_that_started_away_from_zero_is_saved_as_plain_lora_reproducing_the_trained_model(
    tiny_llama_dir, training_args, tmp_path, options,
):
    model = _load(tiny_llama_dir, training_args, **options)
    losses = _train(model, steps=3, lr=1e-2)
    assert losses[-1] < losses[0]
    trained = _logits(model)
    out = tmp_path / "adapter"
    model.save_pretrained(out)  # what Trainer.save_model writes ...
    save_adapter_as_trained(model, str(out))  # ... and train/outputs.py then rewrites

    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["init_lora_weights"], config["r"]) == (True, 16)
    assert config["lora_alpha"] == (16 * 2**0.5 if options.get("use_rslora") else 32)  # the same scale as trained
    weights = load_file(out / "adapter_model.safetensors")
    if "additional_target" in options:  # peft's conversion drops modules_to_save; tunelab puts them back
        assert "base_model.model.model.norm.weight" in weights
    # tunelab chat / eval load the adapter on the original base; tunelab export merges it into it.
    reloaded = load_adapter(_base(tiny_llama_dir), str(out), is_trainable=False)
    assert (_logits(reloaded) - trained).abs().max().item() < 1e-5
    assert (_logits(merge_adapter(reloaded)) - trained).abs().max().item() < 1e-4
    # Without the conversion the adapter is wrong on the original base: what the rewrite fixes.
    assert (_logits(_base(tiny_llama_dir)) - trained).abs().max().item() > 1e-2


def test_pissa_convert_false_keeps_the_trained_form_which_peft_redecomposes_on_loading(
    tiny_llama_dir, training_args, tmp_path,
):
    model = _load(tiny_llama_dir, training_args, pissa_init=True, pissa_iter=-1, pissa_convert=False)
    _train(model, steps=2, lr=1e-2)
    trained = _logits(model)
    out = tmp_path / "adapter"
    model.save_pretrained(out)
    save_adapter_as_trained(model, str(out))
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["init_lora_weights"], config["r"]) == ("pissa", 8)
    reloaded = load_adapter(_base(tiny_llama_dir), str(out), is_trainable=False)
    assert (_logits(reloaded) - trained).abs().max().item() < 1e-5


@pytest.mark.slow
def test_pissa_run_saves_what_chat_and_export_load_as_trained(tmp_path):
    """Through `tunelab train` (Trainer, outputs.save_model) and the loaders of the commands that read the folder."""
    out = tmp_path / "out"
    options = {"model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_reverse", "max_samples": 16,
               "cutoff_len": 64, "per_device_train_batch_size": 8, "max_steps": 2, "save_steps": 2,
               "learning_rate": 1e-2, "seed": 0, "disable_tqdm": True, "plot_loss": False, "pissa_init": True}
    assert main(["train", str(write(tmp_path, options | {"output_dir": str(out)}))]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["init_lora_weights"], config["r"]) == (True, 16)
    # The model as trained: set up as the run set it up (same seed: same fast SVD), with the trained weights of the
    # last checkpoint, which keeps the adapter in the form it trained in.
    run = load_config(out / "tunelab_config.yaml", purpose="estimate")
    model = load_model(run.model, run.finetuning, run.training, load_tokenizer(run.model))
    set_peft_model_state_dict(model, load_file(out / "checkpoint-2" / "adapter_model.safetensors"))
    trained = _logits(model)
    assert (_logits(load_engine(str(out)).model.cpu()) - trained).abs().max().item() < 1e-5  # tunelab chat / api
    export = load_config(write(tmp_path, {"model_name_or_path": "tiny", "adapter_name_or_path": str(out),
                                          "export_dir": str(tmp_path / "export")}), purpose="export")
    assert (_logits(merge_adapter(trained_model(export.model, None))) - trained).abs().max().item() < 1e-4


# ---- OFT and VeRA ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, options, marker, lr", [
    ("oft", {"oft_block_size": 32}, "oft_", 2e-2),
    ("vera", {"vera_rank": 32}, "vera_lambda", 1e-1),  # two vectors per layer: it needs a larger step
])
def test_oft_and_vera_train_only_their_parameters_and_reload_to_the_same_logits(
    tiny_llama_dir, training_args, tmp_path, kind, options, marker, lr,
):
    base = _base(tiny_llama_dir)
    model = _load(tiny_llama_dir, training_args, finetuning_type=kind, **options)
    assert (_logits(model) - _logits(base)).abs().max().item() < 1e-5  # both start at the base model
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(marker in name for name in trainable)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    losses = _train(model, steps=8, lr=lr)
    assert losses[-1] < losses[0] - 0.2  # measured: 5.56 → 5.06 (oft), 5.56 → 5.16 (vera)
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed == trainable
    trained = _logits(model)
    out = tmp_path / kind
    model.save_pretrained(out)
    save_adapter_as_trained(model, str(out))  # a no-op: these start at zero
    assert json.loads((out / "adapter_config.json").read_text())["peft_type"] == kind.upper()
    reloaded = load_adapter(_base(tiny_llama_dir), str(out), is_trainable=False)
    assert (_logits(reloaded) - trained).abs().max().item() < 1e-5
    assert (_logits(merge_adapter(reloaded)) - trained).abs().max().item() < 1e-4


def test_continuing_an_adapter_of_another_kind_is_refused(tiny_llama_dir, training_args, tmp_path):
    model = _load(tiny_llama_dir, training_args, finetuning_type="vera", vera_rank=16)
    model.save_pretrained(tmp_path / "vera")
    with pytest.raises(ConfigError) as info:
        _load(tiny_llama_dir, training_args, {"adapter_name_or_path": str(tmp_path / "vera")}, finetuning_type="oft")
    assert str(info.value) == (f"adapter_name_or_path: {tmp_path / 'vera'} holds a vera adapter, but finetuning_type "
                               "is oft: set finetuning_type: vera")


# ---- LoftQ -----------------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a CUDA GPU")
def test_loftq_without_a_cuda_gpu_is_refused_in_one_line(tiny_llama_dir, training_args):
    pytest.importorskip("bitsandbytes")
    with pytest.raises(ConfigError) as info:
        _load(tiny_llama_dir, training_args, {"quantization_bit": 4}, init_lora_weights="loftq")
    assert str(info.value) == (
        "init_lora_weights: loftq: peft computes LoftQ on a CUDA (or XPU) GPU and this machine has none; remove "
        "init_lora_weights (QLoRA starting from zero) or train on a GPU"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peft computes LoftQ on a CUDA GPU only")
def test_loftq_starts_closer_to_the_full_precision_weights_than_plain_qlora(tiny_llama_dir, training_args):
    import bitsandbytes as bnb  # noqa: PLC0415

    model = _load(tiny_llama_dir, training_args, {"quantization_bit": 4}, init_lora_weights="loftq")
    base = _base(tiny_llama_dir)
    for name, layer in _lora_layers(model):
        quantized = bnb.functional.dequantize_4bit(layer.base_layer.weight.data, layer.base_layer.weight.quant_state)
        weight = base.get_submodule(name.removeprefix("base_model.model.")).weight.to(quantized.device)
        start = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        plain, loftq = (weight - quantized).norm().item(), (weight - quantized - start).norm().item()
        print(f"{name}: ||W - Q(W)|| = {plain:.4f}, ||W - (Q(W) + B·A)|| = {loftq:.4f}")
        # A one-pass LoftQ removes the top-8 singular directions of the error: 0.69 to 0.84 of it remains on this
        # model (measured on CPU with bitsandbytes' nf4 and torch's SVD); B = 0 would leave all of it.
        assert loftq < 0.9 * plain


# ---- refusals --------------------------------------------------------------------------------------------------


REFUSALS = [  # (options, the key the error names, its one line)
    ({"pissa_init": True, "finetuning_type": "full"}, "pissa_init",
     "pissa_init only applies to finetuning_type: lora (got 'full'): remove it or set finetuning_type: lora"),
    ({"pissa_iter": -1}, "pissa_iter", "pissa_iter only applies with pissa_init: true: set it or remove pissa_iter"),
    ({"pissa_init": True, "pissa_convert": False}, "pissa_convert", (
        "pissa_convert: false saves the adapter as trained, which peft decomposes the base again to load; the "
        "randomized fast SVD of pissa_iter: 16 would not give the residual it trained on: set pissa_iter: -1 or remove "
        "pissa_convert")),
    ({"pissa_init": True, "init_lora_weights": "olora"}, "pissa_init",
     "pissa_init and init_lora_weights: olora are two initialisations: keep one"),
    ({"pissa_init": True, "quantization_bit": 4}, "pissa_init", (
        "pissa_init decomposes the full-precision weights, which quantization_bit: 4 replaces: remove quantization_bit "
        "(init_lora_weights: loftq initialises LoRA for a 4-bit base)")),
    ({"init_lora_weights": "olora", "use_dora": True}, "init_lora_weights", (
        "init_lora_weights: olora with use_dora: the adapter is saved as its change from the start, which DoRA's "
        "magnitude vector has no form for: remove use_dora")),
    ({"pissa_init": True, "stage": "dpo", "dataset": "demo_preference"}, "pissa_init", (
        "pissa_init: stage dpo takes the model with its adapter disabled as the reference, which is not the model "
        "training starts from when the adapter starts away from zero: remove pissa_init (or set pref_loss: orpo or "
        "simpo)")),
    ({"init_lora_weights": "olora", "stage": "grpo", "reward_funcs": ["exact_match"]}, "init_lora_weights", (
        "init_lora_weights: olora: stage grpo takes the model with its adapter disabled as the reference, which is "
        "not the model training starts from when the adapter starts away from zero: remove init_lora_weights (or set "
        "kl_coef: 0)")),
    ({"init_lora_weights": "loftq"}, "init_lora_weights",
     "init_lora_weights: loftq initialises LoRA for a 4-bit base: set quantization_bit: 4 (got None)"),
    ({"init_lora_weights": "loftq", "quantization_bit": 4, "lora_alpha": 16}, "lora_alpha", (
        "init_lora_weights: loftq: peft sets B·A to the quantization error without the LoRA scale (peft issue #1982), "
        "so the scale must be 1: set lora_alpha: 8 (= lora_rank, or remove it) and remove use_rslora")),
    ({"finetuning_type": "oft", "oft_rank": 4}, "oft_rank", (
        "oft_rank and oft_block_size: set exactly one of them above 0 (blocks x block size = the layer's width), got "
        "oft_rank: 4, oft_block_size: 32")),
    ({"vera_rank": 16}, "vera_rank",
     "vera_rank only applies to finetuning_type: vera (got 'lora'): remove it or set finetuning_type: vera"),
    ({"finetuning_type": "vera", "add_special_tokens": ["<x>"]}, "add_special_tokens", (
        "add_special_tokens: the new tokens' rows train as peft trainable tokens, which only a LoRA adapter holds; "
        "finetuning_type vera cannot train them: use finetuning_type: lora (or full)")),
]


@pytest.mark.parametrize("options, key, message", REFUSALS,
                         ids=["-".join(f"{k}={v}" for k, v in options.items()) for options, _, _ in REFUSALS])
def test_refusals_are_one_line_naming_the_key(tmp_path, options, key, message):
    config = {"model_name_or_path": "tiny", "dataset": "demo_reverse", "template": "chatml",
              "output_dir": str(tmp_path / "out")}
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, config | options))
    assert (str(info.value), info.value.key) == (message, key)


def test_llamafactory_oft_and_pissa_keys_load(tmp_path):
    common = {"model_name_or_path": "tiny", "dataset": "demo_reverse", "template": "chatml",
              "output_dir": str(tmp_path / "out")}
    oft = load_config(write(tmp_path, common | {"finetuning_type": "oft", "oft_rank": 0, "oft_block_size": 16,
                                                "oft_target": "q_proj,v_proj", "module_dropout": 0.1,
                                                "additional_target": "norm"})).finetuning
    assert (oft.oft_block_size, oft.oft_target, oft.module_dropout, oft.additional_target) == (
        16, ["q_proj", "v_proj"], 0.1, ["norm"])
    pissa = load_config(write(tmp_path, common | {"pissa_init": True, "pissa_iter": -1, "pissa_convert": True}))
    assert (pissa.finetuning.lora_init(), pissa.finetuning.pissa_iter) == ("pissa", -1)
