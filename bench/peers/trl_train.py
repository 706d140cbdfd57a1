"""TRL side of the comparison: SFTTrainer (sft, pt) and DPOTrainer (dpo), as TRL's docs show them.

Run by bench/run.py through bench/peers/probe.py in bench/.venvs/trl, with one argument: the JSON
spec run.py wrote (see hf_train.py). TRL's own defaults that differ from the matched settings are
set explicitly: gradient_checkpointing False and bf16 from the spec (TRL defaults: True and True);
with "attn": "fa2" (bench/gpu.sh) unpacked SFT runs with padding_free, TRL's varlen layout;
with "defaults" in the spec (workload sft_lora_defaults) they are left to TRL.

    sft  prompt/completion messages (bench/.data/peers/sft_chat.json) through the tokenizer's
         chat_template; loss on the completion only (TRL's default for this format);
         packing: packing_strategy "bfd" (padding-free rows whose position_ids restart per sample)
    pt   {"text"} documents, packing_strategy "wrapped": concatenated and cut into max_length blocks
    dpo  conversational prompt/chosen/rejected; sigmoid loss, beta from the spec; with LoRA the
         reference is the base with the adapter disabled (ref_model None)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import probe  # bench/peers/probe.py: the process was started through it
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer


ATTN = {"sdpa": "sdpa", "fa2": "flash_attention_2"}  # bench/run.py --attn


def weights_dtype(spec: dict) -> torch.dtype:
    """What tunelab and LlamaFactory load under bf16: a LoRA run's frozen base in bf16 (the adapters stay float32:
    peft's autocast_adapter_dtype); a full fine-tune keeps float32 weights (masters) under bf16 autocast."""
    return torch.bfloat16 if spec["bf16"] and spec["finetuning"] == "lora" else torch.float32


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    data = Path(spec["data_dir"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=weights_dtype(spec),
                                                 attn_implementation=ATTN[spec.get("attn", "sdpa")])
    peft_config = None
    if spec["finetuning"] == "lora":
        peft_config = LoraConfig(r=spec["lora_rank"], lora_alpha=spec["lora_alpha"], lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    common = dict(
        output_dir=spec["output_dir"], max_steps=spec["max_steps"], per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=1, learning_rate=spec["learning_rate"], lr_scheduler_type="cosine",
        warmup_steps=0, weight_decay=0.0, seed=spec["seed"], logging_steps=1, save_strategy="no", report_to=[],
        bf16=spec["bf16"], gradient_checkpointing=False, dataloader_num_workers=0, use_cpu=spec.get("device", "cpu") == "cpu",
        use_liger_kernel=spec.get("liger", False),
        disable_tqdm=True, max_length=spec["cutoff_len"],
        train_sampling_strategy="sequential" if spec.get("sequential") else "random",
    )
    if spec.get("defaults"):  # the sft_lora_defaults workload: TRL's own choices, as a user would run it
        for key in ("bf16", "gradient_checkpointing", "dataloader_num_workers"):
            common.pop(key)
    if spec["stage"] == "dpo":
        from trl import DPOConfig, DPOTrainer  # noqa: PLC0415

        with probe.timed("trl: load_dataset"):
            train = datasets.load_dataset("json", data_files=str(data / spec["data_file"]), split="train")
        args = DPOConfig(**common, beta=spec["beta"], loss_type=["sigmoid"])
        trainer = DPOTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer,
                             peft_config=peft_config)
    else:
        from trl import SFTConfig, SFTTrainer  # noqa: PLC0415

        with probe.timed("trl: load_dataset"):
            train = datasets.load_dataset("json", data_files=str(data / spec["data_file"]), split="train")
        packing = {"packing": True, "packing_strategy": "wrapped"} if spec["stage"] == "pt" else (
            {"packing": True, "packing_strategy": "bfd"} if spec["packing"] else {"packing": False})
        if spec.get("attn") == "fa2" and not spec["packing"]:
            packing["padding_free"] = True  # with flash-attention TRL lays unpacked examples side by side (varlen)
        args = SFTConfig(**common, **packing)
        trainer = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer,
                             peft_config=peft_config)
    trainer.train()


if __name__ == "__main__":
    main()
