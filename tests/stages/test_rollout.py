"""Rollouts on the embedded tiny Llama: the log-probs of a left-padded batch equal a plain forward of each
sequence alone, the LoRA reference (adapter disabled) equals the base model, and a group's shared prompt
(sampled and forwarded once) gives what G separate rows give."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tunelab.assets import TINY_MODEL_DIR
from tunelab.data.templates import get_template
from tunelab.infer.generate import stop_token_ids
from tunelab.train.rl import shared_prefix
from tunelab.train.rl.rollout import (
    Rollout, completion_log_probs, generate_rollout, left_pad, reference_log_probs, select_rows,
)
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


def _grouped(rollout: Rollout, group_size: int) -> Rollout:
    return dataclasses.replace(rollout, group_size=group_size)


def _random_grouped_rollout(prompt_ids: list[list[int]], group_size: int, length: int, pad_id: int) -> Rollout:
    """G completions of random tokens per prompt, of lengths 1 ... length (pads after), as generate_rollout lays them out."""
    generator = torch.Generator().manual_seed(3)
    prompts, prompt_mask = left_pad(prompt_ids, pad_id, "cpu")
    rows = len(prompt_ids) * group_size
    completion = torch.randint(10, 200, (rows, length), generator=generator)
    lengths = torch.randint(1, length + 1, (rows,), generator=generator)
    lengths[0] = length
    completion_mask = (torch.arange(length)[None] < lengths[:, None]).float()
    completion = completion.masked_fill(completion_mask == 0, pad_id)
    input_ids = torch.cat([prompts.repeat_interleave(group_size, 0), completion], dim=1)
    attention_mask = torch.cat([prompt_mask.repeat_interleave(group_size, 0), completion_mask.long()], dim=1)
    return Rollout(input_ids, attention_mask, completion_mask, prompts.shape[1], [""] * rows, [True] * rows, group_size)


def test_a_group_samples_what_its_repeated_prompts_sample(tiny):
    """generate_rollout with group_size G prefills each prompt once and repeats its KV cache: the same draws as
    G copies of each prompt sampled independently, rows group by group."""
    model, tokenizer, stops, prompt_ids = tiny
    torch.manual_seed(0)
    grouped = generate_rollout(model, tokenizer, prompt_ids, stops, max_new_tokens=12, temperature=TEMPERATURE,
                               pad_id=tokenizer.pad_token_id, group_size=3)
    repeated = _rollout(model, tokenizer, stops, [p for p in prompt_ids for _ in range(3)])
    assert grouped.group_size == 3 and repeated.group_size == 1
    assert torch.equal(grouped.input_ids, repeated.input_ids)
    assert torch.equal(grouped.attention_mask, repeated.attention_mask)
    assert grouped.completions == repeated.completions and grouped.finished == repeated.finished
    # What the draws come from: the prefilled cache continued by the last prompt token gives each row the
    # next-token logits of a plain forward of its prompt.
    prompts, prompt_mask = left_pad(prompt_ids, tokenizer.pad_token_id, "cpu")
    cache = shared_prefix.prefilled_cache(model, prompts, prompt_mask, group_size=3)
    rows_mask = prompt_mask.repeat_interleave(3, 0)
    with torch.no_grad():
        continued = model(input_ids=prompts.repeat_interleave(3, 0)[:, -1:], attention_mask=rows_mask, cache=cache,
                          position_ids=rows_mask.sum(1, keepdim=True) - 1).logits[:, -1]
    for row, prompt in enumerate(prompt_ids):
        with torch.no_grad():
            direct = model(input_ids=torch.tensor([prompt])).logits[0, -1]
        for copy_ in range(3):
            torch.testing.assert_close(continued[row * 3 + copy_], direct, rtol=0, atol=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompt_forward_equals_one_row_per_completion(tiny, attention):
    """The grouped forward (each prompt once, completion blocks masked from each other) gives the log-probs, the
    entropies and the LoRA gradients of the plain layout, with gradient checkpointing too."""
    model, tokenizer, _, prompt_ids = tiny
    policy = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(1)
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    policy.config._attn_implementation = attention
    grouped = _random_grouped_rollout(prompt_ids, group_size=3, length=7, pad_id=tokenizer.pad_token_id)
    plain = _grouped(grouped, 1)
    assert shared_prefix.applies(policy, grouped) and not shared_prefix.applies(policy, plain)
    mask = grouped.completion_mask.bool()

    def forward(rollout):
        policy.zero_grad()
        log_probs, entropy = completion_log_probs(policy, rollout, TEMPERATURE, output_entropy=True)
        (log_probs * rollout.completion_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}
        return log_probs, entropy, grads

    shared, plain_out = forward(grouped), forward(plain)
    torch.testing.assert_close(shared[0][mask], plain_out[0][mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(shared[1][mask], plain_out[1][mask], rtol=0, atol=1e-5)
    for name, grad in plain_out[2].items():
        torch.testing.assert_close(shared[2][name], grad, rtol=1e-4, atol=1e-4 * grad.abs().max().item())
    policy.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.train()
    checkpointed = forward(grouped)
    policy.eval()
    torch.testing.assert_close(checkpointed[0], shared[0], rtol=0, atol=0)
    for name, grad in shared[2].items():
        torch.testing.assert_close(checkpointed[2][name], grad, rtol=0, atol=1e-6 * grad.abs().max().item())


def test_shared_prompt_forward_applies_only_where_a_custom_mask_is_exact(tiny):
    model, tokenizer, _, prompt_ids = tiny
    grouped = _random_grouped_rollout(prompt_ids, group_size=2, length=5, pad_id=tokenizer.pad_token_id)
    row = grouped.prompt_width + 2 * 5
    assert shared_prefix.applies(model, grouped)
    config = copy.deepcopy(model.config)
    shell = SimpleNamespace(config=config)
    config.sliding_window = row - 1  # the custom mask would ignore the window: the plain layout instead
    assert not shared_prefix.applies(shell, grouped)
    config.sliding_window = row
    assert shared_prefix.applies(shell, grouped)
    config._attn_implementation = "flash_attention_2"  # takes no 4D mask
    assert not shared_prefix.applies(shell, grouped)
    # Dense attention over a grouped row of long completions costs more than the shared prompt saves.
    assert shared_prefix.cheaper(model.config, groups=4, group=4, prompt=60, completion=24)
    assert not shared_prefix.cheaper(model.config, groups=4, group=16, prompt=512, completion=1024)
    long = _random_grouped_rollout(prompt_ids, group_size=8, length=400, pad_id=tokenizer.pad_token_id)
    assert not shared_prefix.applies(model, long)
    kept = select_rows(grouped, torch.tensor([False, False, True, True, False, False]))
    assert kept.group_size == 2 and kept.input_ids.shape[0] == 2  # whole groups stay grouped


def test_a_rollout_computes_logits_for_the_last_position_only(tiny):
    # GRPO's sampling: the group's shared prompt prefilled once, then generate, never full-vocabulary logits of
    # every prompt position
    model, tokenizer, stop_ids, prompt_ids = tiny
    heads = []
    handle = model.lm_head.register_forward_hook(lambda module, args, out: heads.append(out.shape[1]))
    try:
        torch.manual_seed(0)
        generate_rollout(model, tokenizer, prompt_ids, stop_ids, max_new_tokens=3, temperature=TEMPERATURE,
                         pad_id=tokenizer.pad_token_id, group_size=2)
    finally:
        handle.remove()
    assert heads and set(heads) == {1}
