"""The optimizer options (train/optimizers.py): each builds what it says, trains, and resumes exactly.

Unit tests build the optimizer on the embedded tiny model (4 layers, hidden 128, 4 heads, tied embeddings) and
step it on one fixed batch; the slow tests train through `tunelab train` (checkpoint-3 of a 6-step run, resumed in
a new output_dir, must give the uninterrupted run's losses and weights exactly, as tests/train/test_resume.py).
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model
from torch import nn

from tests.config.configs import error_of
from tests.train.reliability_helpers import REPO_ROOT, assert_same_weights, losses, train, weights, write_config
from tunelab.assets import EMBEDDED_MODELS
from tunelab.config.args import FinetuningArguments
from tunelab.config.training_args import TrainingArguments
from tunelab.errors import ConfigError
from tunelab.preflight import load_config
from tunelab.train.optimizers import MuonWithAdamW, build_optimizer
from tunelab.train.rl.loop import loop_optimizer

LR = 1e-3
BATCH = torch.randint(3, 860, (4, 24), generator=torch.Generator().manual_seed(0))
LAYERS = [f"model.layers.{i}." for i in range(4)]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """GaLore's SVDs: LAPACK on two threads of a busy two-core machine ran 50x slower than on one (10 s vs 0.2 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model() -> nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(EMBEDDED_MODELS["tiny"]))


def training_args(tmp_path: Path, **options) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), learning_rate=LR, use_cpu=True, report_to="none", **options)


def step(model, optimizer) -> float:
    loss = model(input_ids=BATCH, labels=BATCH).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def state_bytes(optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


def steps(model, optimizer, count: int) -> list[float]:
    """The fixed batch's loss before each of `count` steps (9.94 at the start; AdamW at LR: 6.35 after 4 steps)."""
    return [step(model, optimizer) for _ in range(count)]


def test_layerwise_galore_steps_each_weight_as_the_whole_optimizer_would(tmp_path) -> None:
    """With one micro-batch per step and no clipping, stepping each weight as soon as its gradient is complete is
    the same update."""
    ft = FinetuningArguments(finetuning_type="full", use_galore=True, galore_rank=4)
    runs = []
    for layerwise in (True, False):
        model = tiny_model()
        options = dataclasses.replace(ft, galore_layerwise=layerwise)
        runs.append(steps(model, build_optimizer(model, training_args(tmp_path), options), 3))
    assert runs[0] == runs[1]
    assert runs[0][-1] < runs[0][0] - 2.0, runs


def test_no_option_builds_nothing_and_the_rl_loop_falls_back_to_transformers_adamw(tmp_path) -> None:
    model, args = tiny_model(), training_args(tmp_path)
    assert build_optimizer(model, args, FinetuningArguments(finetuning_type="full")) is None
    assert build_optimizer(model, args, None) is None


def test_the_rl_loop_takes_the_optimizer_from_the_same_place(tmp_path) -> None:
    config = load_config(REPO_ROOT / "examples" / "grpo.yaml", {
        "model_name_or_path": "tiny", "output_dir": str(tmp_path / "out"), "use_muon": True,
    })
    assert isinstance(loop_optimizer(tiny_model(), config.training, config.finetuning), MuonWithAdamW)
    config = dataclasses.replace(config, finetuning=dataclasses.replace(config.finetuning, use_muon=False))
    default = loop_optimizer(tiny_model(), config.training, config.finetuning)
    assert type(default) is torch.optim.AdamW
    assert [len(g["params"]) for g in default.param_groups] == [29, 9]  # the matrices, then the norms (no decay)


def test_galore_projects_the_targeted_matrices_at_galore_rank(tmp_path) -> None:
    model = tiny_model()
    ft = FinetuningArguments(finetuning_type="full", use_galore=True, galore_rank=4, galore_target=["q_proj", "mlp"])
    optimizer = build_optimizer(model, training_args(tmp_path, weight_decay=0.1), ft)
    params = dict(model.named_parameters())
    projected = optimizer.param_groups[-1]
    assert (projected["rank"], projected["update_proj_gap"], projected["scale"], projected["proj_type"]) == (
        4, 200, 2.0, "std")
    assert projected["weight_decay"] == 0.1
    expected = [f"{layer}{block}.{name}.weight" for layer in LAYERS
                for block, name in (("self_attn", "q_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))]
    assert [id(p) for p in projected["params"]] == [id(params[n]) for n in expected]
    assert [g["weight_decay"] for g in optimizer.param_groups[:-1]] == [0.1, 0.0]  # the rest: decay / norms
    losses = steps(model, optimizer, 5)
    assert losses[0] == pytest.approx(9.9395, abs=1e-3) and losses[-1] < 7.0, losses
    state = optimizer.state
    # std projects the smaller side: q_proj 128x128 and down_proj 128x384 keep rank rows or columns; k_proj is whole.
    assert state[params["model.layers.0.self_attn.q_proj.weight"]]["exp_avg"].shape == (128, 4)
    assert state[params["model.layers.0.mlp.down_proj.weight"]]["exp_avg"].shape == (4, 384)
    assert state[params["model.layers.0.mlp.up_proj.weight"]]["exp_avg"].shape == (384, 4)
    assert state[params["model.layers.0.self_attn.k_proj.weight"]]["exp_avg"].shape == (128, 128)


def test_apollo_keeps_rank_apollo_rank_states_for_the_targeted_matrices(tmp_path) -> None:
    model = tiny_model()
    ft = FinetuningArguments(finetuning_type="full", use_apollo=True, apollo_rank=2, apollo_target=["all"])
    optimizer = build_optimizer(model, training_args(tmp_path), ft)
    params = dict(model.named_parameters())
    projected = optimizer.param_groups[-1]
    assert (projected["rank"], projected["proj"], projected["scale"], projected["scale_type"]) == (2, "random", 32.0, "channel")
    expected = {f"{layer}{block}.{name}.weight" for layer in LAYERS for name in LINEARS
                for block in ("self_attn", "mlp") if f"{layer}{block}.{name}.weight" in params}
    assert {id(p) for p in projected["params"]} == {id(params[n]) for n in expected}
    assert len(expected) == 28  # every linear layer but the (tied) output head
    losses = steps(model, optimizer, 5)
    assert losses[-1] < 4.0, losses
    assert optimizer.state[params["model.layers.0.self_attn.q_proj.weight"]]["exp_avg"].shape == (128, 2)
    assert optimizer.state[params["model.norm.weight"]]["exp_avg"].shape == (128,)


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_badam_trains_one_decoder_layer_per_switch_interval(tmp_path) -> None:
    """switch interval 2, ascending: badam's count switches after steps 1, 3, 5, so layer 0 trains step 1, layer 1
    steps 2-3, layer 2 steps 4-5, layer 3 step 6; embeddings and the final norm never change."""
    model = tiny_model()
    ft = FinetuningArguments(finetuning_type="full", use_badam=True, badam_switch_interval=2)
    optimizer = build_optimizer(model, training_args(tmp_path), ft)
    changed_per_step, losses = [], []
    for _ in range(6):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        losses.append(step(model, optimizer))
        changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        changed_per_step.append(sorted({next((layer for layer in LAYERS if n.startswith(layer)), n) for n in changed}))
    assert changed_per_step == [[LAYERS[0]], [LAYERS[1]], [LAYERS[1]], [LAYERS[2]], [LAYERS[2]], [LAYERS[3]]]
    assert losses[-1] < losses[0] - 3.0, losses
    # each changed layer changed whole: its 7 matrices and 2 norms
    assert sum(1 for n, p in model.named_parameters() if n.startswith(LAYERS[3]) and p.requires_grad) == 9


def test_adam_mini_keeps_one_second_moment_per_head_and_neuron(tmp_path) -> None:
    model = tiny_model()
    optimizer = build_optimizer(model, training_args(tmp_path), FinetuningArguments(finetuning_type="full",
                                                                                     use_adam_mini=True))
    losses = steps(model, optimizer, 5)
    assert losses[-1] < 5.5, losses
    params = dict(model.named_parameters())
    state = optimizer.state
    assert state[params["model.layers.0.self_attn.q_proj.weight"]]["vmean"].shape == (4, 1)  # one per head
    assert state[params["model.layers.0.mlp.up_proj.weight"]]["vmean"].shape == (384, 1)  # one per output neuron
    adamw_bytes = 2 * 4 * sum(p.numel() for p in model.parameters())  # exp_avg and exp_avg_sq in float32
    assert state_bytes(optimizer) < 0.51 * adamw_bytes


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_muon_gets_only_the_2d_hidden_weights(tmp_path) -> None:
    model = tiny_model()
    optimizer = build_optimizer(model, training_args(tmp_path, weight_decay=0.1), FinetuningArguments(
        finetuning_type="full", use_muon=True))
    params = dict(model.named_parameters())
    muon = {id(p) for g in optimizer.muon.param_groups for p in g["params"]}
    adamw = {id(p) for g in optimizer.adamw.param_groups for p in g["params"]}
    hidden = {f"{layer}{block}.{name}.weight" for layer in LAYERS for name in LINEARS for block in ("self_attn", "mlp")}
    assert muon == {id(params[n]) for n in hidden & params.keys()} and len(muon) == 28
    assert adamw == {id(p) for n, p in params.items() if n not in hidden}  # the embeddings (= head) and the norms
    assert [g["weight_decay"] for g in optimizer.adamw.param_groups] == [0.1, 0.0]
    assert optimizer.muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    losses = steps(model, optimizer, 5)
    assert losses[-1] < 8.5, losses
    assert set(optimizer.state) == set(optimizer.muon.state) | set(optimizer.adamw.state)
    rest = [p for n, p in params.items() if n not in hidden]
    # float32: one momentum per Muon matrix; AdamW's two moments and a step count per other parameter
    assert state_bytes(optimizer) == 4 * (sum(params[n].numel() for n in hidden & params.keys())
                                          + sum(2 * p.numel() + 1 for p in rest))


def test_loraplus_trains_b_at_lr_times_the_ratio(tmp_path) -> None:
    model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "embed_tokens"]))
    ft = FinetuningArguments(finetuning_type="lora", loraplus_lr_ratio=16.0, loraplus_lr_embedding=1e-5)
    optimizer = build_optimizer(model, training_args(tmp_path), ft)
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert len(lr_of) == len(trainable)
    for name, param in trainable.items():
        expected = 1e-5 if "lora_embedding" in name else LR * 16 if "lora_B" in name else LR
        assert lr_of[id(param)] == pytest.approx(expected), name
    kinds = {part for n in trainable for part in n.split(".") if part.startswith("lora_")}
    assert kinds == {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"}


# ---- through the Trainer: trains, checkpoints and resumes exactly ----------------------------------------------

RUNS = {
    "galore": {"finetuning_type": "full", "use_galore": True, "galore_rank": 4, "galore_update_interval": 2},
    "apollo": {"finetuning_type": "full", "use_apollo": True, "apollo_rank": 4, "apollo_update_interval": 2},
    "badam": {"finetuning_type": "full", "use_badam": True, "badam_switch_interval": 2, "badam_switch_mode": "random"},
    "adam_mini": {"finetuning_type": "full", "use_adam_mini": True},
    "muon": {"finetuning_type": "full", "use_muon": True},
    "loraplus": {"loraplus_lr_ratio": 16.0},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, name) -> None:
    options = {**RUNS[name], "learning_rate": LR}
    reference = tmp_path / "full" / "out"
    assert train(write_config(tmp_path / "full", **options)) == 0
    expected = losses(reference)
    assert expected[6] < expected[1] - 1.0, expected  # it trains

    out = tmp_path / "resumed" / "out"
    shutil.copytree(reference / "checkpoint-3", out / "checkpoint-3")
    assert train(write_config(tmp_path / "resumed", **options, resume_from_checkpoint=True)) == 0
    assert losses(out) == {step: loss for step, loss in expected.items() if step > 3}  # exact floats
    assert_same_weights(weights(out), weights(reference))


# ---- refusals ----------------------------------------------------------------------------------------------------

BASE = {"model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_reverse", "finetuning_type": "full"}


@pytest.mark.parametrize(("options", "message"), [
    ({"use_galore": True, "use_muon": True}, "use_galore and use_muon each choose the optimizer: keep one"),
    ({"use_galore": True, "finetuning_type": "lora"},
     "use_galore only applies to finetuning_type: full / freeze (got 'lora'): remove it or set finetuning_type: "
     "full / freeze"),
    ({"use_badam": True, "finetuning_type": "freeze"},
     "use_badam only applies to finetuning_type: full (got 'freeze'): remove it or set finetuning_type: full"),
    ({"loraplus_lr_ratio": 16}, "loraplus_lr_ratio only applies to finetuning_type: lora (got 'full'): remove it or "
     "set finetuning_type: lora"),
    ({"galore_rank": 8}, "galore_rank only applies with use_galore: true: set use_galore: true or remove galore_rank"),
    ({"use_galore": True, "galore_rank": 0}, "galore_rank must be at least 1, got 0"),
    ({"use_apollo": True, "optim": "adafactor"},
     "use_apollo works with optim: adamw_torch / adamw_torch_fused, got optim: adafactor; remove optim"),
    ({"use_badam": True, "badam_mode": "ratio"},
     "badam_mode: ratio is not supported: badam 1.4's ratio mode makes sparse gradients, which gradient clipping "
     "cannot take, and fails on models with tied embeddings; use badam_mode: layer"),
    ({"use_badam": True, "badam_switch_interval": -1},
     "badam_switch_interval must be at least 1, got -1 (to train one block only, set badam_switch_mode: fixed)"),
    ({"use_badam": True, "stage": "rm", "dataset": "demo_preference"},
     "use_badam trains the decoder layers only, so stage rm's value head would never learn: remove use_badam"),
    ({"use_galore": True, "galore_layerwise": True, "gradient_accumulation_steps": 2},
     "galore_layerwise steps each weight during its backward pass, so gradients cannot accumulate: set "
     "gradient_accumulation_steps: 1 or remove it"),
    ({"use_apollo": True, "apollo_layerwise": True, "nan_policy": "skip"},
     "nan_policy: skip cannot undo the steps apollo_layerwise took during backward: remove nan_policy: skip or "
     "apollo_layerwise"),
    ({"use_muon": True, "deepspeed": "examples/deepspeed/ds_z2_config.json"},
     "use_muon builds its own optimizer states, which deepspeed cannot shard: remove use_muon or deepspeed"),
])
def test_refusals_name_the_key_and_the_fix(tmp_path, options, message) -> None:
    if "deepspeed" in options:
        options = {**options, "deepspeed": str(REPO_ROOT / options["deepspeed"])}
    assert error_of(tmp_path, {**BASE, "output_dir": str(tmp_path / "out"), **options}) == message


def test_a_missing_package_says_which_extra_to_install(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "galore_torch", None)  # import galore_torch now fails, as when not installed
    assert error_of(tmp_path, {**BASE, "output_dir": str(tmp_path / "out"), "use_galore": True}) == (
        "use_galore needs the galore_torch package: pip install 'tunelab[galore]'")


def test_a_target_that_matches_nothing_names_the_layers(tmp_path) -> None:
    ft = FinetuningArguments(finetuning_type="full", use_galore=True, galore_target=["qkv"])
    with pytest.raises(ConfigError, match=r"^galore_target: 'qkv' matches no trainable linear layer of LlamaForCausalLM; "
                                        r"layers: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj$"):
        build_optimizer(tiny_model(), training_args(tmp_path), ft)
