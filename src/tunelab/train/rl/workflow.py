"""What the grpo and ppo workflows share around the loop: the reference model, the held-out greedy
exact-match check, and saving the policy the way every stage saves (outputs.py)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

from peft import PeftModel
from torch import nn

from tunelab.config.args import RunConfig
from tunelab.infer.generate import exact_match, generate_predictions
from tunelab.train import outputs

logger = logging.getLogger(__name__)


def build_reference(model: nn.Module, kl_coef: float, device) -> nn.Module | None:
    """The frozen model the KL penalty compares with, or None when no copy is needed: LoRA disables
    its adapter instead (rollout.reference_mode), and kl_coef 0 needs no reference at all."""
    if not kl_coef or isinstance(model, PeftModel):
        return None
    reference = copy.deepcopy(model).requires_grad_(False).eval()
    return reference.to(device)


def config_dir(config: RunConfig) -> Path | None:
    """The config file's folder: relative reward-function files are also looked up there."""
    return Path(config.source).parent if config.source else None


def held_out_rows(eval_rows: dict, config: RunConfig):
    if not config.generation.eval_generation or not eval_rows:
        return None
    rows = next(iter(eval_rows.values()))
    return rows.select(range(min(config.generation.eval_generation_samples, len(rows))))


def held_out_exact_match(model, tokenizer, template, rows, config: RunConfig) -> float:
    predictions = generate_predictions(
        model, tokenizer, template, rows, max_new_tokens=config.generation.max_new_tokens,
        batch_size=config.training.per_device_eval_batch_size * 4,
    )
    return exact_match(predictions)


def save_policy(loop, tokenizer, template, config: RunConfig) -> nn.Module:
    """Model (or adapter) + tokenizer with the chat template + generation config; returns the unwrapped policy."""
    out = config.training.output_dir
    accelerator = loop.accelerator
    accelerator.wait_for_everyone()
    policy = accelerator.unwrap_model(loop.model)
    policy = getattr(policy, "policy", policy)  # ppo trains the policy and its value head as one module
    state_dict = accelerator.get_state_dict(policy)
    policy.save_pretrained(out, state_dict=state_dict, is_main_process=accelerator.is_main_process)
    if accelerator.is_main_process:
        outputs.save_tokenizer_and_generation_config(policy, tokenizer, template, out)
    return policy


def finish(loop, metrics: dict, config: RunConfig) -> None:
    if not loop.accelerator.is_main_process:
        return
    outputs.write_json(config.training.output_dir, "all_results.json", metrics)
    if config.training.plot_loss:
        outputs.plot_loss(config.training.output_dir)
