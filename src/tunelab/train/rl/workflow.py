"""The grpo and ppo workflow, top to bottom, and what it is made of.

tokenizer + template → prompts (the shared pipeline, rendered with the generation prompt) → the
stage's scorer (reward functions, or stage rm's model) → policy (+ adapters) and reference → [exact
match before] → the loop (rl/loop.py with the stage's algorithm) → save → [exact match after] →
metrics. Everything written lands in output_dir.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import transformers
from peft import PeftModel
from torch import nn

from tunelab.config.args import RunConfig
from tunelab.data.prompts import build_prompt_datasets
from tunelab.data.templates import get_template
from tunelab.infer.generate import held_out_exact_match, held_out_rows, stop_token_ids
from tunelab.model.adapters import is_quantized
from tunelab.model.load import count_parameters, load_model
from tunelab.model.tokenizer import load_tokenizer
from tunelab import run_folder
from tunelab.train import outputs
from tunelab.train.memory import peak_memory_metrics
from tunelab.train.rl.loop import RLLoop, build_accelerator

logger = logging.getLogger(__name__)


def run_stage(
    config: RunConfig,
    algorithm: Callable[..., Any],
    load_scorer: Callable[[Any, Any, Any], Any],
    policy: Callable[[nn.Module], nn.Module] = lambda model: model,
    after_save: Callable[[RLLoop], None] | None = None,
) -> dict:
    """One generating stage. `load_scorer(device, tokenizer, template)` gives what scores the samples,
    `algorithm(loop, reference, tokenizer, stop_ids, scorer, config)` the step (rl/grpo.py, rl/ppo.py),
    `policy(model)` the module the loop trains, `after_save(loop)` what the stage saves beside the model."""
    args, ft = config.training, config.finetuning
    transformers.set_seed(args.seed)
    accelerator = build_accelerator(config)
    tokenizer = load_tokenizer(config.model)
    template = get_template(config.data.template, tokenizer)
    prompts = build_prompt_datasets(config.data, tokenizer, template, args.seed)
    run_folder.write_json(args.output_dir, run_folder.DATA_REPORT, prompts.report)
    scorer = load_scorer(accelerator.device, tokenizer, template)

    model = load_model(config.model, config.finetuning, args, tokenizer, is_trainable=True)
    if not is_quantized(model):  # bitsandbytes places quantized weights itself and refuses .to()
        model = model.to(accelerator.device)
    trainable, total = count_parameters(model)
    logger.info("trainable parameters: %d of %d (%.2f%%)", trainable, total, 100 * trainable / max(total, 1))
    reference = build_reference(model, ft.kl_coef, accelerator.device)
    metrics: dict = {"trainable_parameters": trainable, "total_parameters": total}

    rows = held_out_rows(prompts.eval_rows, config)
    if rows is not None:
        metrics["exact_match_before"] = held_out_exact_match(model, tokenizer, template, rows, config)

    loop = RLLoop(config, accelerator, policy(model), prompts.train, ft.num_iterations)
    step = algorithm(loop, reference, tokenizer, stop_token_ids(tokenizer, template), scorer, config)
    metrics.update(loop.train(step))
    metrics.update(loop.final_metrics(("reward", "kl")))
    trained = save_policy(loop, tokenizer, template, config)
    if after_save is not None:
        after_save(loop)

    if rows is not None:
        metrics["exact_match_after"] = held_out_exact_match(trained, tokenizer, template, rows, config)
        logger.info(
            "exact match on %d held-out rows: %.1f%% before training → %.1f%% after",
            len(rows), 100 * metrics["exact_match_before"], 100 * metrics["exact_match_after"],
        )
    finish(loop, metrics, config)
    return metrics


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
