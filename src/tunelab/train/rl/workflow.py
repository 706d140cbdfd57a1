"""The grpo and ppo workflow, top to bottom, and what it is made of.

tokenizer + template → prompts (the shared pipeline, rendered with the generation prompt) → the
stage's scorer (reward functions, or stage rm's model) → policy (+ adapters) and reference → [held-out
greedy answers before: exact match, and grpo's reward functions] → the loop (rl/loop.py with the stage's
algorithm) → save → [the same after] → metrics. Everything written lands in output_dir.
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
from tunelab.infer.generate import exact_match, generate_predictions, held_out_rows, stop_token_ids
from tunelab.model.adapters import is_quantized
from tunelab.model.load import count_parameters, load_model
from tunelab.model.tokenizer import load_tokenizer
from tunelab import run_folder
from tunelab.train import outputs
from tunelab.train.memory import peak_memory_metrics
from tunelab.train.rl.loop import RLLoop, build_accelerator
from tunelab.train.rl.rewards import RewardFunction

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
    rewards = _held_out_rewards(scorer)
    if rows is not None:
        metrics.update(held_out_metrics(model, tokenizer, template, rows, config, rewards, "before"))
        logger.info("held-out greedy answers before training (%d rows): %s", len(rows),
                    ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.endswith("_before")))

    loop = RLLoop(config, accelerator, policy(model), prompts.train, ft.num_iterations)
    step = algorithm(loop, reference, tokenizer, stop_token_ids(tokenizer, template), scorer, config)
    metrics.update(loop.train(step))
    metrics.update(loop.final_metrics(("reward", "kl")))
    trained = save_policy(loop, tokenizer, template, config)
    if after_save is not None:
        after_save(loop)

    if rows is not None:
        metrics.update(held_out_metrics(trained, tokenizer, template, rows, config, rewards, "after"))
        logger.info(
            "exact match on %d held-out rows: %.1f%% before training → %.1f%% after",
            len(rows), 100 * metrics["exact_match_before"], 100 * metrics["exact_match_after"],
        )
        for function in rewards:
            logger.info(
                "%s of the greedy answers to %d held-out rows: mean %.3f before training → %.3f after; "
                "scoring 1: %.1f%% → %.1f%%", function.name, len(rows), metrics[f"{function.name}_before"],
                metrics[f"{function.name}_after"], 100 * metrics[f"{function.name}_solved_before"],
                100 * metrics[f"{function.name}_solved_after"],
            )
    finish(loop, metrics, config)
    return metrics


def _held_out_rewards(scorer) -> list[RewardFunction]:
    """grpo's reward functions that the held-out greedy answers can be scored with: those that do not ask whether
    an answer finished (greedy generation does not report it). ppo's reward model is not one."""
    if not isinstance(scorer, list):
        return []
    return [f for f in scorer if isinstance(f, RewardFunction) and not f.wants_finished]


def held_out_metrics(model, tokenizer, template, rows, config: RunConfig, rewards: list[RewardFunction],
                     when: str) -> dict[str, float]:
    """Greedy answers to the held-out rows, scored by exact match and by each reward function: its mean, and the
    share of answers it scores 1 (code_tests: the share that pass every hidden test, pass@1)."""
    predictions = generate_predictions(
        model, tokenizer, template, rows, max_new_tokens=config.generation.max_new_tokens,
        batch_size=config.training.per_device_eval_batch_size * 4, template_vars=config.data.template_kwargs,
    )
    metrics = {f"exact_match_{when}": exact_match(predictions)}
    prompts, answers = [p.prompt for p in predictions], [p.prediction for p in predictions]
    references = [p.reference for p in predictions]
    for function in rewards:
        scores = function(prompts, answers, references, finished=[])
        metrics[f"{function.name}_{when}"] = sum(scores) / max(len(scores), 1)
        metrics[f"{function.name}_solved_{when}"] = sum(s >= 1.0 for s in scores) / max(len(scores), 1)
        function_stats = getattr(function.fn, "pop_stats", None)
        if function_stats is not None:
            function_stats()  # the held-out runs are not the training log's
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
