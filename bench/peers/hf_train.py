"""Plain Hugging Face baseline: transformers.Trainer (+ peft LoRA) written out as a user would.

Run by bench/run.py through bench/peers/probe.py, in tunelab's own venv (the same transformers,
peft and datasets as tunelab), with one argument: the JSON spec run.py wrote
({"workload", "stage", "finetuning", "model", "data_dir", "data_file", "output_dir", "cutoff_len", "batch_size",
"max_steps", "learning_rate", "seed", "lora_rank", "lora_alpha", "bf16"}).

    sft  alpaca rows rendered with the tokenizer's chat_template (ChatML); prompt tokens masked to
         -100; truncated to cutoff_len; padded per batch (DataCollatorForSeq2Seq). No packing.
    pt   the run_clm recipe: tokenise, append eos, concatenate, cut into cutoff_len blocks.
"""

from __future__ import annotations

import json
import sys
from itertools import chain
from pathlib import Path

import datasets
import probe  # bench/peers/probe.py: the process was started through it
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer,
                          TrainingArguments, default_data_collator)


ATTN = {"sdpa": "sdpa", "fa2": "flash_attention_2"}  # bench/run.py --attn


def sft_dataset(spec: dict, tokenizer) -> datasets.Dataset:
    rows = datasets.load_dataset("json", data_files=str(Path(spec["data_dir"]) / spec["data_file"]), split="train")
    cutoff = spec["cutoff_len"]

    def encode(row):
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"]
        full = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=True)["input_ids"]
        labels = [-100] * len(prompt) + full[len(prompt):]
        return {"input_ids": full[:cutoff], "attention_mask": [1] * len(full[:cutoff]), "labels": labels[:cutoff]}

    encoded = rows.map(encode, remove_columns=rows.column_names)
    return encoded.filter(lambda r: any(label != -100 for label in r["labels"]))


def pt_dataset(spec: dict, tokenizer) -> datasets.Dataset:
    docs = datasets.load_dataset("json", data_files=str(Path(spec["data_dir"]) / spec["data_file"]), split="train")
    block = spec["cutoff_len"]

    def tokenize(batch):
        return {"input_ids": [ids + [tokenizer.eos_token_id] for ids in tokenizer(batch["text"])["input_ids"]]}

    def group(batch):
        ids = list(chain(*batch["input_ids"]))
        total = len(ids) // block * block
        blocks = [ids[i : i + block] for i in range(0, total, block)]
        return {"input_ids": blocks, "attention_mask": [[1] * block for _ in blocks], "labels": [b[:] for b in blocks]}

    tokens = docs.map(tokenize, batched=True, remove_columns=docs.column_names)
    return tokens.map(group, batched=True, batch_size=1000)


def weights_dtype(spec: dict) -> torch.dtype:
    """What tunelab and LlamaFactory load under bf16: a LoRA run's frozen base in bf16 (the adapters stay float32:
    peft's autocast_adapter_dtype); a full fine-tune keeps float32 weights (masters) under bf16 autocast."""
    return torch.bfloat16 if spec["bf16"] and spec["finetuning"] == "lora" else torch.float32


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    with probe.timed("hf: load + tokenise"):
        train = pt_dataset(spec, tokenizer) if spec["stage"] == "pt" else sft_dataset(spec, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=weights_dtype(spec),
                                                 attn_implementation=ATTN[spec.get("attn", "sdpa")])
    if spec["finetuning"] == "lora":
        from peft import LoraConfig, get_peft_model  # noqa: PLC0415

        model = get_peft_model(model, LoraConfig(r=spec["lora_rank"], lora_alpha=spec["lora_alpha"], lora_dropout=0.0,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
    args = TrainingArguments(
        output_dir=spec["output_dir"], max_steps=spec["max_steps"], per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=1, learning_rate=spec["learning_rate"], lr_scheduler_type="cosine",
        warmup_steps=0, weight_decay=0.0, seed=spec["seed"], logging_steps=1, save_strategy="no", report_to=[],
        bf16=spec["bf16"], gradient_checkpointing=False, dataloader_num_workers=0, use_cpu=spec.get("device", "cpu") == "cpu",
        use_liger_kernel=spec.get("liger", False),
        remove_unused_columns=False, disable_tqdm=True,
        train_sampling_strategy="sequential" if spec.get("sequential") else "random",
    )
    collator = default_data_collator if spec["stage"] == "pt" else DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)
    Trainer(model=model, args=args, train_dataset=train, data_collator=collator).train()


if __name__ == "__main__":
    main()
