"""TRL side of the GRPO comparison (bench/grpo_vs_trl.py): GRPOTrainer on the CPU, generating with transformers.

Run through bench/peers/probe.py in bench/.venvs/trl with one argument, the JSON spec grpo_vs_trl.py wrote.
The settings tunelab's run uses, in TRL's names: `num_generations` completions of each prompt, `prompts`
prompts per optimizer step (TRL counts completions: per_device_train_batch_size = prompts x num_generations),
one optimizer step per generation batch (steps_per_generation 1, num_iterations 1), `beta` = tunelab's kl_coef
(with LoRA the reference is the base with the adapter disabled in both), loss_type and scale_rewards as given,
plain temperature sampling (top_k 0, top_p 1), `max_completion_length` = max_new_tokens, LoRA on every linear
layer; under bf16 the frozen base in bf16 and the adapters in float32, as tunelab has them. The reward is the
partial-credit sum reward of examples/real/rewards.py, loaded from that file (it needs nothing of tunelab).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import datasets
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

REWARDS = Path(__file__).resolve().parents[2] / "examples" / "real" / "rewards.py"


def _load_sum_reward():
    """examples/real/rewards.py's sum_reward, the one tunelab's run uses (a plain file: it imports only `re`)."""
    spec = importlib.util.spec_from_file_location("real_rewards", REWARDS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.sum_reward


SUM_REWARD = _load_sum_reward()


def sum_reward(prompts, completions, answer, **_) -> list[float]:
    """TRL's reward signature (conversational completions, the answer column) around examples/real/rewards.py's."""
    texts = [completion[0]["content"] if isinstance(completion, list) else completion for completion in completions]
    return SUM_REWARD(prompts, texts, answer)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    # LoRA under bf16: the frozen base in bf16, the adapters float32 (peft), as tunelab loads it.
    dtype = torch.bfloat16 if spec["bf16"] else torch.float32
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype, attn_implementation="sdpa")
    train = datasets.load_dataset("json", data_files=spec["data_file"], split="train")
    args = GRPOConfig(
        output_dir=spec["output_dir"], max_steps=spec["max_steps"], seed=spec["seed"],
        per_device_train_batch_size=spec["prompts"] * spec["num_generations"], gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=spec["num_generations"], num_iterations=1,
        max_completion_length=spec["max_new_tokens"], temperature=1.0, top_p=1.0, top_k=0,
        beta=spec["kl_coef"], epsilon=0.2, loss_type=spec["loss_type"], scale_rewards=spec["scale_rewards"],
        learning_rate=spec["learning_rate"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        bf16=spec["bf16"], use_cpu=spec.get("device", "cpu") == "cpu", gradient_checkpointing=False, dataloader_num_workers=0,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, log_completions=False,
    )
    peft_config = LoraConfig(r=spec["lora_rank"], lora_alpha=2 * spec["lora_rank"], lora_dropout=0.0,
                             target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=sum_reward, args=args, train_dataset=train,
                          processing_class=tokenizer, peft_config=peft_config)
    trainer.train()


if __name__ == "__main__":
    main()
