"""Rollouts sampled from merged LoRA weights (train/rl/merged_sampling.py): inside, the policy computes what the
unmerged adapter computes; afterwards its weights are the very tensors they were, bit for bit, in fp32 and bf16."""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tunelab.assets import TINY_MODEL_DIR
from tunelab.cli import main
from tunelab.data.templates import get_template
from tunelab.infer.generate import stop_token_ids
from tunelab.run_folder import read_log
from tunelab.train.rl.merged_sampling import mergeable_layers, merged_lora, plan, sampling_weights
from tunelab.train.rl.rollout import generate_rollout


# Rewards that differ between completions of one prompt, so every group has a spread and the adapter moves.
REWARDS = "def spread(prompts, completions, references):\n    return [sum(map(ord, c)) % 7 / 7 for c in completions]\n"


def grpo_config(path, out, **options):
    """A 2-step LoRA GRPO run on the tiny model with REWARDS beside it; temperature 5 so the confident model's two
    completions of a prompt differ and step 1 moves the adapter."""
    (path.parent / "rewards.py").write_text(REWARDS)
    path.write_text(yaml.safe_dump({
        "model_name_or_path": "tiny", "stage": "grpo", "finetuning_type": "lora", "template": "chatml",
        "dataset": "demo_sort", "cutoff_len": 64, "reward_funcs": "rewards.py:spread", "temperature": 5.0,
        "num_generations": 2, "per_device_train_batch_size": 2, "max_steps": 2, "logging_steps": 1,
        "learning_rate": 1e-2, "lr_scheduler_type": "constant", "seed": 0, "disable_tqdm": True, "plot_loss": False,
        "output_dir": str(out), **options,
    }))
    return path


def lora_policy(dtype=torch.float32, **lora) -> torch.nn.Module:
    """The tiny Llama with LoRA on every linear layer, B set away from zero so the adapter changes the output."""
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=dtype)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **lora)
    policy = get_peft_model(model, config)
    torch.manual_seed(1)
    for name, parameter in policy.named_parameters():
        if "lora_" in name:
            parameter.data = (torch.randn_like(parameter, dtype=torch.float32) * 0.05).to(parameter.dtype)
    return policy.eval()


def ids() -> torch.Tensor:
    return torch.tensor([[1, 17, 42, 99, 7, 250, 31, 8]])


def base_weights(policy) -> dict[str, torch.Tensor]:
    return {name: p for name, p in policy.named_parameters() if "base_layer" in name}


def test_merged_weights_compute_what_the_adapter_computes():
    policy = lora_policy()
    with torch.no_grad():
        unmerged = policy(input_ids=ids()).logits
        with policy.disable_adapter():
            base = policy(input_ids=ids()).logits
        assert (unmerged - base).abs().max() > 1e-2  # the adapter does change the output
        with merged_lora(policy):
            merged = policy(input_ids=ids()).logits
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=2e-5)


def test_a_seeded_rollout_samples_the_same_completions_merged_and_unmerged():
    policy = lora_policy()
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    template = get_template("chatml", tokenizer)
    prompts = [tokenizer(template.prompt([{"role": "user", "content": text}]), add_special_tokens=False)["input_ids"]
               for text in ("Sort the numbers.\n3 1 2", "Hi")]

    def sample(merge: bool):
        torch.manual_seed(0)
        with sampling_weights(policy, merge):
            return generate_rollout(policy, tokenizer, prompts, stop_token_ids(tokenizer, template), max_new_tokens=10,
                                    temperature=0.7, pad_id=tokenizer.pad_token_id, group_size=2)

    merged, unmerged = sample(True), sample(False)
    assert merged.input_ids.tolist() == unmerged.input_ids.tolist()
    assert merged.completions == unmerged.completions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_afterwards_the_base_weights_are_the_same_tensors_bit_for_bit(dtype):
    policy = lora_policy(dtype)
    before = base_weights(policy)
    values = {name: p.detach().clone() for name, p in before.items()}
    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    layer = mergeable_layers(policy)[0][0]
    original = layer.get_base_layer().weight
    expected = (original.float() + layer.get_delta_weight("default").float()).to(dtype)
    with merged_lora(policy):
        inside = layer.get_base_layer().weight
        assert inside is not original and torch.equal(inside, expected)  # summed in float32, rounded once
        assert layer.disable_adapters
    after = base_weights(policy)
    assert all(after[name] is before[name] for name in before)
    assert all(torch.equal(after[name], values[name]) for name in values)
    assert {name for name, p in policy.named_parameters() if p.requires_grad} == trainable
    assert not layer.disable_adapters


def test_peft_merge_and_unmerge_would_move_bf16_base_weights():
    """Why the merged weights are a copy: adding ΔW into a bf16 weight and taking it out again rounds twice."""
    policy = lora_policy(torch.bfloat16)
    values = {name: p.detach().clone() for name, p in base_weights(policy).items()}
    policy.merge_adapter()
    policy.unmerge_adapter()
    moved = sum(int((p != values[name]).sum()) for name, p in base_weights(policy).items())
    assert moved > 0


def test_the_weights_go_back_when_sampling_fails():
    policy = lora_policy()
    before = base_weights(policy)
    with pytest.raises(RuntimeError, match="sampling failed"), merged_lora(policy):
        raise RuntimeError("sampling failed")
    assert all(base_weights(policy)[name] is before[name] for name in before)
    assert not any(layer.disable_adapters for layer in mergeable_layers(policy)[0])


def test_plan_says_what_rollouts_sample_from_and_why():
    policy = lora_policy()
    merge, line = plan(policy, "NO", enabled=True)
    layers = mergeable_layers(policy)[0]
    extra = sum(layer.get_base_layer().weight.numel() for layer in layers)
    assert merge and line == (f"rollouts sample from merged LoRA weights: {len(layers)} layers, a copy of {extra:,} "
                              "weights while sampling (rollout_merge_adapter: false samples through the adapter)")
    assert plan(policy, "MULTI_GPU", enabled=True)[0]  # DDP: every process holds whole weights
    assert plan(policy, "FSDP", enabled=True) == (
        False, "rollouts sample through the LoRA adapter: FSDP shards the weights")
    assert plan(policy, "NO", enabled=False) == (
        False, "rollouts sample through the LoRA adapter (rollout_merge_adapter: false)")
    assert plan(lora_policy(use_dora=True), "NO", enabled=True) == (
        False, "rollouts sample through the LoRA adapter: DoRA or a LoRA bias is not a plain low-rank update")
    full = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
    assert plan(full, "NO", enabled=True) == (
        False, "rollouts sample through the LoRA adapter: the policy has no LoRA layers")
    with pytest.raises(RuntimeError, match="no LoRA layers"), merged_lora(full):
        pass


def test_a_tied_adapted_weight_is_not_merged():
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, and the head adapted
    policy = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["lm_head", "q_proj"]))
    assert plan(policy, "NO", enabled=True) == (
        False, "rollouts sample through the LoRA adapter: an adapted weight is tied to another module")


@pytest.mark.slow
def test_a_lora_grpo_run_says_what_it_samples_from(tmp_path, caplog, precision):
    """Through the CLI: one log line each way, and in fp32 the same rollouts and losses merged as through the adapter
    (step 2 samples from an adapter the first step moved)."""
    records, lines = {}, {}
    for merge in (True, False):
        out = tmp_path / f"merge-{merge}"
        config = grpo_config(tmp_path / f"grpo-{merge}.yaml", out, max_samples=4, max_new_tokens=8,
                             rollout_merge_adapter=merge)
        caplog.clear()
        caplog.set_level(logging.INFO, logger="tunelab.train.rl.merged_sampling")
        assert main(["train", str(config)]) == 0
        lines[merge] = [m for m in caplog.messages if m.startswith("rollouts sample")]
        records[merge] = read_log(out)
    assert len(lines[True]) == 1 and re.fullmatch(
        r"rollouts sample from merged LoRA weights: \d+ layers, a copy of [\d,]+ weights while sampling "
        r"\(rollout_merge_adapter: false samples through the adapter\)", lines[True][0])
    assert lines[False] == ["rollouts sample through the LoRA adapter (rollout_merge_adapter: false)"]
    assert [r["step"] for r in records[True]] == [1, 2]
    assert records[True][0]["grad_norm"] > 0  # step 2 samples from an adapter that moved
    if precision == "fp32":
        fields = ("reward", "completion_length", "loss", "kl")
        assert [[r[f] for f in fields] for r in records[True]] == [
            pytest.approx([r[f] for f in fields], rel=1e-4, abs=1e-6) for r in records[False]]


@pytest.mark.slow
def test_two_processes_sample_from_merged_weights(tmp_path, capfd):
    """DDP (gloo, nproc_per_node=2): each process holds whole weights, so each samples from its merged copies while
    the adapter's gradients are still all-reduced by DDP."""
    out = tmp_path / "out"
    config = grpo_config(tmp_path / "grpo.yaml", out, max_samples=8, max_new_tokens=6)
    assert main(["train", str(config), "nproc_per_node=2"]) == 0
    err = capfd.readouterr().err
    assert "-m torch.distributed.run --nproc_per_node=2" in err
    assert err.count("rollouts sample from merged LoRA weights") >= 1
    assert "rollouts sample through" not in err
    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2] and log[0]["grad_norm"] > 0
    adapter = load_file(out / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in adapter.items())  # trained through DDP
