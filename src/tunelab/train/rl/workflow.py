"""What the generating stages' workflow (train/recipe.py's RLRecipe: grpo, ppo) is made of besides the loop: the
reference model, saving the policy, the run's closing metrics. Everything written lands in output_dir."""

from __future__ import annotations

import copy
import logging

from peft import PeftModel
from torch import nn

from tunelab import run_folder
from tunelab.config.args import RunConfig
from tunelab.train import outputs
from tunelab.train.memory import peak_memory_metrics

logger = logging.getLogger(__name__)


def build_reference(model: nn.Module, kl_coef: float, device) -> nn.Module | None:
    """The frozen model the KL penalty compares with, or None when no copy is needed: LoRA disables
    its adapter instead (rollout.reference_mode), and kl_coef 0 needs no reference at all."""
    if not kl_coef or isinstance(model, PeftModel):
        return None
    reference = copy.deepcopy(model).requires_grad_(False).eval()
    return reference.to(device)


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
        outputs.save_adapter_as_trained(policy, out)
        outputs.save_tokenizer_and_generation_config(policy, tokenizer, template, out)
    return policy


def finish(loop, metrics: dict, config: RunConfig) -> None:
    if not loop.accelerator.is_main_process:
        return
    metrics.update(peak_memory_metrics(loop.accelerator.device))
    run_folder.write_json(config.training.output_dir, run_folder.RESULTS, metrics)
    if config.training.plot_loss:
        outputs.plot_loss(config.training.output_dir)
