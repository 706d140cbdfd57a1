"""A model folder's tokenizer and (vision-language models) processor, set up for training and inference.

Apart from model/load.py (weights, adapters, quantization) so that commands that read only data (`tunelab data`)
load them without importing peft.
"""

from __future__ import annotations

import logging

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tunelab.config.args import ModelArguments
from tunelab.errors import ModelError, first_line
from tunelab.model import gguf, vision

logger = logging.getLogger(__name__)


def load_tokenizer(model_args: ModelArguments) -> PreTrainedTokenizerBase:
    path = model_args.model_name_or_path
    source, gguf_file = gguf.pretrained_source(path)  # a GGUF's tokenizer and chat template come from its metadata
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=model_args.trust_remote_code, **gguf_file)
    except Exception as exc:  # noqa: BLE001  (any failure here is an unreadable tokenizer folder)
        raise ModelError(f"model_name_or_path: cannot load a tokenizer from {path}: {first_line(exc)}") from exc
    if model_args.add_special_tokens:
        added = tokenizer.add_tokens(list(model_args.add_special_tokens), special_tokens=True)
        logger.info("Added %d special tokens to the tokenizer (add_special_tokens): %s", added,
                    ", ".join(model_args.add_special_tokens))
    # Right padding: labels and attention masks line up with the tokens during training.
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        for role in ("eos", "unk"):
            token = getattr(tokenizer, f"{role}_token")
            if token is not None:
                tokenizer.pad_token = token
                logger.info("The tokenizer has no pad token: padding with its %s token %r.", role, token)
                break
        else:
            raise ModelError(
                f"model_name_or_path: the tokenizer in {path} has no pad, eos or unk token; "
                "add a pad_token to its tokenizer_config.json"
            )
    return tokenizer


def load_processor(model_args: ModelArguments):
    """The folder's own processor (AutoProcessor) of a vision-language model, None for a text-only model. Its
    tokenizer is set up as load_tokenizer's; the run encodes text with load_tokenizer's and images with this."""
    path = model_args.model_name_or_path
    if not vision.is_vision_model_folder(path):
        return None
    from transformers import AutoProcessor  # lazy: AutoProcessor's image processors (22 s); vision-language models only

    try:
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=model_args.trust_remote_code)
    except Exception as exc:  # noqa: BLE001  (missing processor files, a processor class that cannot load here)
        raise ModelError(
            f"model_name_or_path: {path} is a vision-language model but its processor cannot load: {first_line(exc)}; "
            "the folder needs its processor files (processor_config.json / preprocessor_config.json)"
        ) from exc
    if not hasattr(processor, "image_processor") or getattr(processor, "image_token", None) is None:
        raise ModelError(
            f"model_name_or_path: the processor in {path} ({type(processor).__name__}) has no image processor or image "
            "token; tunelab trains vision-language models whose processor expands an image token"
        )
    processor.tokenizer.padding_side = "right"
    return processor
