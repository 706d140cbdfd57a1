"""Greedy answers of SmolLM2-135M-Instruct to a few open questions, as it came and with a trained adapter or model:
shows whether a fine-tune on a narrow task (examples/real/) left the model fluent.
    python bench/real_samples.py saves/real/dpo            # a LoRA run's output_dir, or a full model folder
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pure_bf16 import hf_folder  # (bench/ is on the path: this runs as a script)

BASE = Path(__file__).resolve().parent / ".data" / "real" / "smollm2-hf"
QUESTIONS = [
    "What is the capital of France?",
    "Give me two tips for sleeping better.",
    "Reverse the letters.\nk,t,b,x",       # demo_reverse's question (examples/real/sft_lora.yaml)
    "Sort the numbers from smallest to largest.\n7 2 9 4",
]


def load(folder: Path):
    if (folder / "adapter_config.json").is_file():
        from peft import PeftModel

        return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), folder).eval()
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def answers(model, tokenizer, max_new_tokens: int) -> list[str]:
    out = []
    for question in QUESTIONS:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            ids = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
        out.append(tokenizer.decode(ids[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trained", type=Path, nargs="*")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    hf_folder(BASE)  # the GGUF of scripts/fetch_real.py smollm2 as a plain HF folder, made on first use
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    for folder in [BASE, *args.trained]:
        start = time.perf_counter()
        replies = answers(load(folder), tokenizer, args.max_new_tokens)
        print(f"== {folder} ({time.perf_counter() - start:.0f} s)")
        for question, reply in zip(QUESTIONS, replies):
            print(f"Q: {question!r}\nA: {reply!r}")


if __name__ == "__main__":
    main()
