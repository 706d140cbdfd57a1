"""Loading a local model folder: the tokenizer, the causal LM (dtype, attention, quantization) and the parameter count.

A vision-language model folder (model/vision.py) loads with AutoModelForImageTextToText, and its processor with
AutoProcessor (`load_processor`); text-only folders have no processor.

The trainable-parameter set-up is adapters.py's; bitsandbytes specifics are quantization.py's, QAT's (the
fake-quantized layers, before adapters) qat.py's; a Hub id is already a folder of the Hugging Face cache when it
gets here (hub.py, at config time), whose weights are fetched just before they load; a GGUF file loads dequantized
(gguf.py). Every loading failure
becomes a one-line ModelError naming model_name_or_path (or adapter_name_or_path).
"""

from __future__ import annotations

import logging

import torch
import transformers
from torch import nn
from transformers import (
    AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification, PreTrainedTokenizerBase,
)
from transformers.utils import is_flash_attn_2_available

from tunelab.config.qat_schemes import DEFAULT_GROUP_SIZE
from tunelab.config.args import FinetuningArguments, ModelArguments
from tunelab.config.training_args import TrainingArguments
from tunelab.errors import ModelError, first_line
from tunelab import hub
from tunelab.model import gguf, qat, quantization, rope, sharding, varlen_sdpa, vision
from tunelab.model.adapters import load_adapter, setup_finetuning
from tunelab.model.resolve import ATTN_IMPLEMENTATIONS, resolve_dtype

logger = logging.getLogger(__name__)


def load_model(
    model_args: ModelArguments,
    finetuning_args: FinetuningArguments,
    training_args: TrainingArguments,
    tokenizer: PreTrainedTokenizerBase,
    is_trainable: bool = True,
    reward_head: bool = False,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """The causal LM of model_name_or_path, set up to train as finetuning_args say (or frozen for inference).

    reward_head: load it as AutoModelForSequenceClassification with one label (stage rm): the backbone
    plus a scalar head `score` (new, randomly initialised, unless the folder already is a reward model).
    dtype: the weights' dtype instead of the options' (model/resolve.py), e.g. a frozen reference in its policy's.
    """
    # New weights (LoRA, reward head) start from the run's seed, whatever consumed random numbers before
    # (building the tokenized cache does; reading it back does not).
    transformers.set_seed(training_args.seed)
    path = model_args.model_name_or_path
    if dtype is None:
        dtype = resolve_dtype(model_args, training_args, finetuning_args if is_trainable else None)
    # use_kernels: transformers' own default is on wherever `kernels` is installed (one of its requirements), and on a
    # GPU its first model.train() then fetches kernels-community code from the Hub: offline it fails there.
    kwargs: dict = {"dtype": dtype, "trust_remote_code": model_args.trust_remote_code,
                    "use_kernels": model_args.use_kernels}
    if qat.is_torchao_quantized(path):
        # A quantized export computes in the dtype it was exported from (its int4 / int8 weights dequantize to it):
        # other embeddings and norms would meet those weights in another dtype.
        kwargs["dtype"] = "auto"
    attn = ATTN_IMPLEMENTATIONS[model_args.flash_attn]
    if attn == "flash_attention_2" and not is_flash_attn_2_available():
        raise ModelError("flash_attn: fa2 needs the flash-attn package and a CUDA GPU; set flash_attn: sdpa or auto")
    if attn is not None:
        kwargs["attn_implementation"] = attn
    quantization_config = quantization.build_quantization_config(model_args, dtype)
    if quantization_config is not None:
        if not reward_head and vision.is_vision_model_folder(path):
            # QLoRA on a vision-language model quantizes the language model only (as LlamaFactory does): the tower
            # and projector stay in full precision, and so does the output head (bitsandbytes' default skip).
            # (transformers matches these from the start of a module's name, or as regular expressions)
            parts = [f".*{name}" for name in (*vision.TOWER_NAMES, *vision.PROJECTOR_NAMES)]
            quantization_config.llm_int8_skip_modules = [*parts, "lm_head"]
        kwargs["quantization_config"] = quantization_config

    sharded = sharding.load_kwargs(training_args) if is_trainable else {}  # fsdp on CPU: FSDP2 shards while loading
    kwargs.update(sharded)
    hub.fetch_weights(path, model_args.allow_pickle_weights)
    if reward_head:
        kwargs.update(num_labels=1, pad_token_id=tokenizer.pad_token_id)  # the reward is read at the last non-pad token
    scaling = rope.of(model_args)
    try:
        auto_class = AutoModelForSequenceClassification if reward_head else AutoModelForCausalLM
        if not reward_head and vision.is_vision_model_folder(path):
            auto_class = AutoModelForImageTextToText
        kwargs = rope.with_rope_scaling(path, scaling, model_args.trust_remote_code, kwargs)  # (its config changed)
        model, info = gguf.from_pretrained(auto_class, path, output_loading_info=True, **kwargs)  # (a GGUF: dequantized)
    except Exception as exc:  # noqa: BLE001  (missing or corrupt files, unknown architecture, ...)
        raise ModelError(f"model_name_or_path: cannot load the model from {path}: {first_line(exc)}") from exc
    if sharded:
        logger.info("fsdp: the model is sharded layer by layer across %d processes as it loads (FSDP2 full_shard "
                    "through transformers' distributed_config)", sharding.world_size())
    snapshot = hub.snapshot_of(path)
    if snapshot is not None:
        # What an adapter saved from this model names as its base (peft's base_model_name_or_path): the Hub id,
        # which loads anywhere, not this machine's cache folder; the commit goes beside it (peft's revision).
        model.name_or_path = snapshot.repo_id
    missing_keys = info.get("missing_keys") or []
    if reward_head:  # a causal LM has no reward head yet: it starts from transformers' initialisation
        missing_keys = [k for k in missing_keys if not k.startswith(f"{reward_head_name(model)}.")]
    if missing_keys:
        # transformers would fill these with random values and only print a report.
        missing = sorted(missing_keys)
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelError(
            f"model_name_or_path: the weights in {path} lack {', '.join(missing[:3])}{more}; "
            "the checkpoint is incomplete"
        )
    new_token_ids = added_token_rows(model, tokenizer, model_args.add_special_tokens)
    _check_vocabulary(model, tokenizer, path)
    if tokenizer.pad_token_id is not None and getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id

    # Packed and padding-free rows: sdpa per sample, not over the L² square. Frozen models too: a reference or a
    # teacher takes the trained model's batches (and anything else, generation included, reaches sdpa itself).
    varlen_sdpa.use_for_training(model)
    if not is_trainable:
        if model_args.adapter_name_or_path:
            model = load_adapter(model, model_args.adapter_name_or_path, is_trainable=False)
        model.requires_grad_(False)
        return model.eval()

    model.config.use_cache = False  # the KV cache only serves generation; training would just hold it in memory
    # A vision-language model's language model reads its own (text) config: with its cache on, packed and
    # padding-free samples would attend to each other (data/packing.py).
    model.config.get_text_config().use_cache = False
    quantization.keep_4bit_trainable_on_cpu(model)
    if finetuning_args.qat:  # before LoRA, so the adapters wrap the fake-quantized base layers
        group_size = finetuning_args.qat_group_size or DEFAULT_GROUP_SIZE
        qat.prepare_qat(model, finetuning_args.qat, group_size, enabled=finetuning_args.qat_start_step == 0)
    model = setup_finetuning(model, finetuning_args, training_args, model_args.adapter_name_or_path, new_token_ids,
                             model_path=path)
    parts = vision.vision_parts(model)
    if parts is not None:
        vision.log_parts(model, parts)
    if snapshot is not None:
        for peft_config in (getattr(model, "peft_config", None) or {}).values():
            peft_config.revision = snapshot.commit
    return model


def added_token_rows(model: nn.Module, tokenizer: PreTrainedTokenizerBase, tokens: list[str] | None) -> list[int]:
    """The ids of the tokens add_special_tokens added, the embeddings grown to hold them (their rows train)."""
    if not tokens:
        return []
    ids = sorted({tokenizer.convert_tokens_to_ids(token) for token in tokens})
    rows = model.get_input_embeddings().weight.shape[0]
    if ids[-1] >= rows:
        # New rows start at the mean of the old ones (transformers' default), a sensible start for a marker.
        model.resize_token_embeddings(len(tokenizer))
        logger.info("Embeddings grown from %d to %d rows for the added tokens.", rows, len(tokenizer))
    return ids


def reward_head_name(model: nn.Module) -> str:
    """The attribute holding a sequence-classification head: `score` for decoder LMs (Llama, Qwen, Mistral...)."""
    return "score" if hasattr(model, "score") else "classifier"


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; 4-bit weights count as the elements they stand for, tied ones once."""
    trainable = total = 0
    for param in model.parameters():
        n = quantization.real_numel(param)
        total += n
        if param.requires_grad:
            trainable += n
    return trainable, total


def _check_vocabulary(model: nn.Module, tokenizer: PreTrainedTokenizerBase, path: str) -> None:
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        # Not an error: extra tokens only fail once they occur in the data (index out of range in the embedding).
        logger.warning(
            "The tokenizer in %s has %d tokens but the model embeds only %d; ids past %d will fail.",
            path, len(tokenizer), rows, rows - 1,
        )
