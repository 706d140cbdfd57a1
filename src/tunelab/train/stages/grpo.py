"""GRPO: the workflow, top to bottom.

tokenizer + template → prompts (the shared pipeline, rendered with the generation prompt) → reward
functions → policy (+ adapters) and reference → [exact match before] → the loop (rl/loop.py with
rl/grpo.py) → save → [exact match after] → metrics. Everything written lands in output_dir.
"""

from __future__ import annotations

import logging

import transformers

from tunelab.config.args import RunConfig
from tunelab.data.prompts import build_prompt_datasets
from tunelab.data.templates import get_template
from tunelab.infer.generate import stop_token_ids
from tunelab.model.adapters import is_quantized
from tunelab.model.load import count_parameters, load_model, load_tokenizer
from tunelab.train import outputs
from tunelab.train.rl import workflow
from tunelab.train.rl.grpo import GRPO
from tunelab.train.rl.loop import RLLoop, build_accelerator
from tunelab.train.rl.rewards import load_reward_functions

logger = logging.getLogger(__name__)


def run_grpo(config: RunConfig) -> dict:
    args, ft = config.training, config.finetuning
    transformers.set_seed(args.seed)
    accelerator = build_accelerator(config)
    tokenizer = load_tokenizer(config.model)
    template = get_template(config.data.template, tokenizer)
    prompts = build_prompt_datasets(config.data, tokenizer, template, args.seed)
    outputs.write_json(args.output_dir, "data_report.json", prompts.report)
    rewards = load_reward_functions(ft.reward_funcs or [], ft.reward_weights, workflow.config_dir(config))

    model = load_model(config.model, config.finetuning, args, tokenizer, is_trainable=True)
    if not is_quantized(model):  # bitsandbytes places quantized weights itself and refuses .to()
        model = model.to(accelerator.device)
    trainable, total = count_parameters(model)
    logger.info("trainable parameters: %d of %d (%.2f%%)", trainable, total, 100 * trainable / max(total, 1))
    reference = workflow.build_reference(model, ft.kl_coef, accelerator.device)
    metrics: dict = {"trainable_parameters": trainable, "total_parameters": total}

    rows = workflow.held_out_rows(prompts.eval_rows, config)
    if rows is not None:
        metrics["exact_match_before"] = workflow.held_out_exact_match(model, tokenizer, template, rows, config)

    loop = RLLoop(config, accelerator, model, prompts.train, ft.num_iterations)
    grpo = GRPO(loop, reference, tokenizer, stop_token_ids(tokenizer, template), rewards, config)
    metrics.update(loop.train(grpo))
    metrics.update(loop.final_metrics(("reward", "kl")))
    policy = workflow.save_policy(loop, tokenizer, template, config)

    if rows is not None:
        metrics["exact_match_after"] = workflow.held_out_exact_match(policy, tokenizer, template, rows, config)
        logger.info(
            "exact match on %d held-out rows: %.1f%% before training → %.1f%% after",
            len(rows), 100 * metrics["exact_match_before"], 100 * metrics["exact_match_after"],
        )
    workflow.finish(loop, metrics, config)
    return metrics
