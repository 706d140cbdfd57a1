"""The option groups of a run: one dataclass per concern.

Key names follow LlamaFactory where the concept exists there, so its users' YAML files carry over
(see docs/config.md for the deliberate differences). Defaults live here and nowhere else; the help
text of every option is its `metadata["help"]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import transformers

from tunelab.assets import TINY_MODEL_DIR


def _help(text: str, **kwargs):
    return field(metadata={"help": text}, **kwargs)


@dataclass
class ModelArguments:
    model_name_or_path: str = _help(
        "Local Hugging Face model folder (config.json + weights). 'tiny' is the embedded tiny Llama.",
        default="tiny",
    )
    adapter_name_or_path: str | None = _help("LoRA adapter folder to load on top of the model.", default=None)
    trust_remote_code: bool = _help("Run custom modelling code shipped in the model folder.", default=False)
    flash_attn: Literal["auto", "disabled", "sdpa", "fa2"] = _help(
        "Attention implementation: auto (transformers' choice), disabled (eager), sdpa, fa2 (flash_attention_2).",
        default="auto",
    )
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = _help(
        "dtype of the loaded weights; auto follows bf16/fp16 training flags, else float32.", default="auto"
    )
    quantization_bit: int | None = _help("Load the base weights in 4 or 8 bits with bitsandbytes (QLoRA).", default=None)
    quantization_type: Literal["nf4", "fp4"] = _help("4-bit data type.", default="nf4")
    double_quantization: bool = _help("Quantize the 4-bit quantization constants too.", default=True)

    def __post_init__(self):
        if self.model_name_or_path == "tiny":
            self.model_name_or_path = str(TINY_MODEL_DIR)


@dataclass
class DataArguments:
    template: str | None = _help(
        "Chat template: a built-in name (tunelab template list) or 'model' for the tokenizer's own chat_template.",
        default=None,
    )
    dataset: list[str] | None = _help("Training dataset names from dataset_info.json, comma separated.", default=None)
    eval_dataset: list[str] | None = _help("Evaluation dataset names, comma separated.", default=None)
    dataset_dir: str | None = _help(
        "Folder holding your dataset_info.json and data files; the built-in datasets are always available.",
        default=None,
    )
    cutoff_len: int = _help("Maximum tokens per example after tokenisation.", default=2048)
    train_on_prompt: bool = _help("Supervise prompt tokens too, not only the assistant answers.", default=False)
    mask_history: bool = _help("Supervise only the last assistant turn of each conversation.", default=False)
    mix_strategy: Literal["concat", "interleave_under", "interleave_over"] = _help(
        "How several datasets are combined.", default="concat"
    )
    interleave_probs: list[float] | None = _help("Sampling probabilities for interleave strategies.", default=None)
    max_samples: int | None = _help("Keep at most this many rows of each dataset (for quick runs).", default=None)
    val_size: float = _help("Hold out this fraction (<1) or number (>=1) of training rows for evaluation.", default=0.0)
    packing: bool = _help(
        "Pack several examples into one row of cutoff_len; samples stay isolated (attention and positions).",
        default=False,
    )
    dedup: Literal["none", "exact", "near"] = _help(
        "Remove duplicate training rows before encoding: exact (same rendered conversation) or near "
        "(MinHash LSH over the text; pip install tunelab[dedup]).",
        default="none",
    )
    dedup_threshold: float = _help(
        "dedup: near: estimated Jaccard similarity (character 5-grams) at or above which a row is a duplicate.",
        default=0.85,
    )
    stride: int | None = _help(
        "pt: step between window starts (< cutoff_len overlaps windows); default cutoff_len.", default=None
    )
    min_length: int = _help("pt: drop documents shorter than this many tokens (counted in the log).", default=1)
    tail: Literal["keep", "drop"] = _help(
        "pt: the last window shorter than cutoff_len is kept as a shorter window, or dropped (counted).",
        default="keep",
    )
    text_column: str | None = _help("pt: the text column of json/csv/parquet rows; default 'text', then 'content'.", default=None)
    txt_sample_by: Literal["line", "paragraph", "document"] = _help(
        "pt: a .txt document is one line, one blank-line-separated block, or the whole file.", default="line"
    )
    streaming: bool = _help("Read, tokenise and batch on the fly with bounded memory (needs max_steps).", default=False)
    buffer_size: int = _help("streaming: shuffle buffer size in examples.", default=16384)
    tokenized_cache_dir: str | None = _help(
        "Folder of the tokenized-dataset cache; default ~/.cache/tunelab/tokenized (or $TUNELAB_CACHE).", default=None
    )
    preprocessing_num_workers: int | None = _help("Processes used to tokenise datasets.", default=None)
    overwrite_cache: bool = _help("Rebuild tokenised datasets even if a cached copy exists.", default=False)


@dataclass
class FinetuningArguments:
    stage: Literal["pt", "sft", "rm", "dpo", "kto", "ppo", "grpo"] = _help("Training stage.", default="sft")
    finetuning_type: Literal["lora", "freeze", "full"] = _help("Which parameters train.", default="lora")
    lora_rank: int = _help("LoRA rank r.", default=8)
    lora_alpha: int | None = _help("LoRA scale alpha; default 2 * lora_rank.", default=None)
    lora_dropout: float = _help("Dropout on the LoRA input.", default=0.0)
    lora_target: list[str] = _help(
        "Modules that get LoRA: 'all' (every linear layer but the output head) or names, comma separated.",
        default_factory=lambda: ["all"],
    )
    additional_target: list[str] | None = _help(
        "Modules trained in full beside LoRA and saved with the adapter (e.g. embed_tokens,lm_head).", default=None
    )
    use_dora: bool = _help("Weight-decomposed LoRA (DoRA).", default=False)
    use_rslora: bool = _help("Rank-stabilised LoRA scaling alpha / sqrt(r).", default=False)
    freeze_trainable_layers: int = _help(
        "freeze: train the last N decoder layers (negative: the first N).", default=2
    )
    freeze_trainable_modules: list[str] = _help(
        "freeze: module names inside the trainable layers that train ('all' for every one).",
        default_factory=lambda: ["all"],
    )
    freeze_extra_modules: list[str] | None = _help(
        "freeze: modules outside the decoder layers that train too (e.g. embed_tokens,norm).", default=None
    )


@dataclass
class GenerationArguments:
    eval_generation: bool = _help(
        "Before and after training, generate greedy answers for eval rows and report exact-match accuracy.",
        default=False,
    )
    eval_generation_samples: int = _help("How many eval rows the generation check uses.", default=200)
    max_new_tokens: int = _help("Tokens generated per answer at most.", default=64)


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers.TrainingArguments with its own names, plus what LlamaFactory configs add."""

    overwrite_output_dir: bool = _help("Allow training into a non-empty output_dir.", default=False)
    plot_loss: bool = _help("Save training_loss.png (and eval loss when evaluated) in output_dir.", default=True)


ARGUMENT_GROUPS = (ModelArguments, DataArguments, FinetuningArguments, GenerationArguments, TrainingArguments)

# Defaults we change from transformers' own, for a fine-tuning tool run from a terminal.
TRAINING_DEFAULTS = {
    "logging_steps": 10,
    "report_to": "none",
    "save_strategy": "no",
    "remove_unused_columns": False,
    "ddp_find_unused_parameters": False,
    "prediction_loss_only": True,  # evaluation computes losses per batch; never gathers logits (PEERS #13)
}


@dataclass
class RunConfig:
    """Everything a run decided, resolved and checked."""

    model: ModelArguments
    data: DataArguments
    finetuning: FinetuningArguments
    generation: GenerationArguments
    training: TrainingArguments
    source: str | None = None  # the YAML file it came from
