"""What the generating stages' workflow (train/recipe.py's RLRecipe: grpo, ppo) is made of besides the loop: the
reference model, the reward scores of held-out greedy answers, saving the policy, the run's closing metrics.
Everything written lands in output_dir."""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING

from peft import PeftModel
from torch import nn

from tunelab import run_folder
from tunelab.train import outputs
from tunelab.train.memory import peak_memory_metrics
from tunelab.train.rl.rewards import RewardFunction

if TYPE_CHECKING:
    from tunelab.config.training_args import TrainingArguments

logger = logging.getLogger(__name__)


def held_out_rewards(scorer) -> list[RewardFunction]:
    """The reward functions that held-out greedy answers can be scored with: those that do not ask whether an answer
    finished or for a tool-using rollout's messages (the held-out answers do not report them). A reward model (ppo's
    scorer) is not one."""
    if not isinstance(scorer, list):
        return []
    return [f for f in scorer if isinstance(f, RewardFunction) and not f.wants_finished and not f.wants_messages]


def reward_metrics(predictions, rewards: list[RewardFunction], when: str) -> dict[str, float]:
    """Each reward function's mean over the greedy answers, and the share it scores 1 (code_tests: the share that
    pass every hidden test, pass@1)."""
    prompts, answers = [p.prompt for p in predictions], [p.prediction for p in predictions]
    references = [p.reference for p in predictions]
    metrics = {}
    for function in rewards:
        scores = function(prompts, answers, references, finished=[])
        metrics[f"{function.name}_{when}"] = sum(scores) / max(len(scores), 1)
        metrics[f"{function.name}_solved_{when}"] = sum(s >= 1.0 for s in scores) / max(len(scores), 1)
        function_stats = getattr(function.fn, "pop_stats", None)
        if function_stats is not None:
            function_stats()  # the held-out runs are not the training log's
    return metrics


def log_reward_metrics(rewards: list[RewardFunction], metrics: dict, rows: int) -> None:
    for function in rewards:
        name = function.name
        logger.info(
            "%s of the greedy answers to %d held-out rows: mean %.3f before training → %.3f after; scoring 1: "
            "%.1f%% → %.1f%%", name, rows, metrics[f"{name}_before"], metrics[f"{name}_after"],
            100 * metrics[f"{name}_solved_before"], 100 * metrics[f"{name}_solved_after"],
        )


def build_reference(model: nn.Module, kl_coef: float, device) -> nn.Module | None:
    """The frozen model the KL penalty compares with, or None when no copy is needed: LoRA disables
    its adapter instead (rollout.reference_mode), and kl_coef 0 needs no reference at all."""
    if not kl_coef or isinstance(model, PeftModel):
        return None
    reference = copy.deepcopy(model).requires_grad_(False).eval()
    return reference.to(device)


def save_policy(loop, tokenizer, template, out: str) -> nn.Module:
    """Model (or adapter) + tokenizer with the chat template + generation config into `out` (output_dir); returns the
    unwrapped policy."""
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


def finish(loop, metrics: dict, args: TrainingArguments) -> None:
    """all_results.json (the metrics and the peak memory) and the loss plots."""
    if not loop.accelerator.is_main_process:
        return
    metrics.update(peak_memory_metrics(loop.accelerator.device))
    run_folder.write_json(args.output_dir, run_folder.RESULTS, metrics)
    if args.plot_loss:
        outputs.plot_loss(args.output_dir)
