"""Rollouts on the embedded tiny Llama: the log-probs of a left-padded batch equal a plain forward of each
sequence alone, and the LoRA reference (adapter disabled) equals the base model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tunelab.assets import TINY_MODEL_DIR
from tunelab.data.templates import get_template
from tunelab.infer.generate import stop_token_ids
from tunelab.train.rl.rollout import completion_log_probs, generate_rollout, reference_log_probs
from tunelab.train.rl.workflow import build_reference

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def tiny():
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR).eval()
    template = get_template("chatml", tokenizer)
    prompts = [
        template.prompt([{"role": "user", "content": text}])
        for text in ("Sort the numbers from smallest to largest.\n3 1 2", "Hi", "Reverse the letters.\nc,a,t,s")
    ]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    return model, tokenizer, stop_token_ids(tokenizer, template), prompt_ids


def _rollout(model, tokenizer, stops, prompt_ids):
    torch.manual_seed(0)
    return generate_rollout(model, tokenizer, prompt_ids, stops, max_new_tokens=12, temperature=TEMPERATURE,
                            pad_id=tokenizer.pad_token_id)


def _direct_log_probs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """One sequence alone, no padding, no position ids: the plainest forward there is."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / TEMPERATURE
    return F.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def test_rollout_layout_and_log_probs_equal_a_direct_forward(tiny):
    model, tokenizer, stops, prompt_ids = tiny
    rollout = _rollout(model, tokenizer, stops, prompt_ids)
    width = rollout.prompt_width
    assert width == max(len(p) for p in prompt_ids)
    with torch.no_grad():
        log_probs, _ = completion_log_probs(model, rollout, TEMPERATURE)
    assert log_probs.shape == rollout.completion_mask.shape
    for row, prompt in enumerate(prompt_ids):
        n = int(rollout.completion_mask[row].sum())
        completion = rollout.input_ids[row, width : width + n].tolist()
        # the mask runs through the first stop token (or to max_new_tokens), and the prompt is left-padded
        assert rollout.finished[row] == (completion[-1] in stops)
        assert not any(t in stops for t in completion[:-1])
        assert rollout.input_ids[row, width - len(prompt) : width].tolist() == prompt
        assert rollout.attention_mask[row].tolist() == [0] * (width - len(prompt)) + [1] * (len(prompt) + n) + [0] * (
            rollout.completion_mask.shape[1] - n)
        text_tokens = completion[:-1] if rollout.finished[row] else completion
        assert rollout.completions[row] == tokenizer.decode(text_tokens, skip_special_tokens=True)
        torch.testing.assert_close(log_probs[row, :n], _direct_log_probs(model, prompt, completion), rtol=0, atol=1e-5)


def test_lora_reference_is_the_base_model_with_the_adapter_disabled(tiny):
    model, tokenizer, stops, prompt_ids = tiny
    base = copy.deepcopy(model)
    policy = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(1)
    for name, param in policy.named_parameters():
        if "lora_B" in name:  # peft starts B at zero (a no-op adapter): make the adapter change the model
            torch.nn.init.normal_(param, std=0.5)
    rollout = _rollout(policy, tokenizer, stops, prompt_ids)
    mask = rollout.completion_mask.bool()
    with torch.no_grad():
        base_log_probs, _ = completion_log_probs(base, rollout, TEMPERATURE)
        policy_log_probs, _ = completion_log_probs(policy, rollout, TEMPERATURE)
    assert build_reference(policy, kl_coef=0.04, device="cpu") is None  # LoRA keeps no copy
    reference = reference_log_probs(policy, None, rollout, TEMPERATURE)
    torch.testing.assert_close(reference[mask], base_log_probs[mask], rtol=0, atol=1e-6)
    assert (policy_log_probs[mask] - base_log_probs[mask]).abs().max() > 0.1  # the adapter is back on afterwards


def test_full_finetuning_reference_is_a_frozen_copy(tiny):
    model, *_ = tiny
    reference = build_reference(model, kl_coef=0.04, device="cpu")
    assert reference is not model and not any(p.requires_grad for p in reference.parameters())
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))
    assert build_reference(model, kl_coef=0.0, device="cpu") is None


def test_entropy_is_that_of_the_distribution_each_token_was_sampled_from(tiny):
    """top_entropy_quantile ranks tokens by this: -Σ p log p of softmax(logits / T) at each completion position,
    the same log-probs as without it."""
    model, tokenizer, stops, prompt_ids = tiny
    rollout = _rollout(model, tokenizer, stops, prompt_ids)
    width = rollout.prompt_width
    with torch.no_grad():
        log_probs, entropy = completion_log_probs(model, rollout, TEMPERATURE, output_entropy=True)
        plain, _ = completion_log_probs(model, rollout, TEMPERATURE)
    torch.testing.assert_close(log_probs, plain, rtol=0, atol=0)
    prompt = prompt_ids[0]
    n = int(rollout.completion_mask[0].sum())
    completion = rollout.input_ids[0, width : width + n].tolist()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1] / TEMPERATURE
    direct = F.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(entropy[0, :n], -(direct.exp() * direct).sum(-1), rtol=0, atol=1e-4)
