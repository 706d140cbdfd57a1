"""Rows with images → examples for a vision-language model, through the model's own processor.

The processor does everything image-specific: it resizes and normalises the images (pixel values and whatever
else its model takes: image_sizes, image_grid_thw, ...) and says what text each image stands for in the prompt
(its expansion: LLaVA repeats `<image>` once per patch feature, Gemma 3 writes
`\\n\\n<start_of_image>` + `<image_soft_token>` x 256 + `<end_of_image>\\n\\n`). tunelab asks it for exactly that,
per row, through its public call (`return_text_replacement_offsets`), and never writes an expansion itself:

    row:     user "<image>What colour?"  assistant "Red"   images [img]
    1. processor(images=[img], text=image_token)      → the expansion E of img (and its pixel values)
    2. the row's <image> placeholders become E, in order, and the text encoder (data/encode.py) encodes the
       conversation as any other: per segment, the template deciding what trains. E sits in a user turn, so
       image tokens are never supervised (and their ids are masked again here, to be sure).
    3. the example keeps its images (the storage dicts of the canonical row); the collator (VisionCollator below)
       runs the processor's image processor on them again at batch time. Same image, same processor: the same
       tensors the expansion was computed for.

The ids equal the processor's own call on the rendered conversation (tests/data/test_vision_encode.py), up to the
encoder's rule that an answer is tokenised as it is generated (the prompt alone, then the answer).

Images never get cut in half. An example that lost part of an image's tokens to cutoff_len (or an image whose
turn was dropped with the earliest exchanges) is dropped and counted (``images_dont_fit``); rows without images
encode exactly as in a text run.
"""

from __future__ import annotations

import inspect
import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch

from tunelab.data.collate import (
    PackedCollator,
    PaddingFreeCollator,
    PairedCollator,
    SupervisedCollator,
    padding_free_layout,
)
from tunelab.data.encode import (
    COUNTER_COLUMNS,
    IGNORE_INDEX,
    IMAGE_COUNTERS,
    SupervisedEncoder,
)
from tunelab.data.formats import IMAGE_PLACEHOLDER, IMAGES_FEATURE, template_messages
from tunelab.data.images import fit_pixels, open_images
from tunelab.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

_RANGE_KEY = "_image_range"  # on each template message: the indices of the row's images it holds


@dataclass(frozen=True)
class ImageSettings:
    """How images reach the processor: LlamaFactory's image_max_pixels / image_min_pixels."""

    max_pixels: int | None = None
    min_pixels: int | None = None


def prepare_images(refs: list[Any], settings: ImageSettings) -> list:
    return [fit_pixels(image, settings.max_pixels, settings.min_pixels) for image in open_images(refs)]


def image_token_ids(processor: Any) -> set[int]:
    """The ids of the processor's multi-modal special tokens (image, begin/end of image): never supervised."""
    tokenizer = processor.tokenizer
    names = ("image_token", "boi_token", "eoi_token", "image_start_token", "image_end_token", "vision_start_token",
             "vision_end_token", "fake_image_token", "global_image_token")
    tokens = {getattr(holder, name, None) for holder in (processor, tokenizer) for name in names}
    ids = {tokenizer.convert_tokens_to_ids(t) for t in tokens if isinstance(t, str) and t}
    return {i for i in ids if i is not None and i != tokenizer.unk_token_id}


def expansions(processor: Any, images: list) -> list[str]:
    """The text each image stands for in the prompt, from the processor itself (its public call)."""
    if not images:
        return []
    out = processor(images=images, text=[processor.image_token * len(images)], return_text_replacement_offsets=True)
    return [entry["replacement"] for entry in out["text_replacement_offsets"][0]]


@dataclass(frozen=True)
class VisionEncoder:
    """Encodes canonical rows with images (datasets.map function, like SupervisedEncoder, which it wraps)."""

    encoder: SupervisedEncoder
    processor: Any
    settings: ImageSettings = ImageSettings()
    _mm_ids: frozenset = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_mm_ids", frozenset(image_token_ids(self.processor)))

    @property
    def cutoff_len(self) -> int:
        return self.encoder.cutoff_len

    @property
    def features(self) -> datasets.Features:
        """The encoded columns' types (given to datasets.map: a batch of text-only rows has no image type)."""
        ints = datasets.List(datasets.Value("int64"))
        columns = {"input_ids": ints, "labels": ints, "images": IMAGES_FEATURE}
        columns.update({c: datasets.Value("bool" if c == "truncated" else "int64") for c in COUNTER_COLUMNS})
        columns.update({c: datasets.Value("int64") for c in IMAGE_COUNTERS})
        return datasets.Features(columns)

    def messages(self, row: dict) -> tuple[list[dict], list[int]]:
        """The row's template messages with each <image> replaced by its expansion (each message marked with the
        images it holds), and the number of multi-modal tokens of each image."""
        refs = list(row.get("images") or [])
        messages = template_messages(row, self.encoder.template)
        if not refs:
            return messages, []
        images = prepare_images(refs, self.settings)
        texts = expansions(self.processor, images)
        tokenizer = self.encoder.tokenizer
        sizes = [sum(i in self._mm_ids for i in ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        out, used = [], 0
        for message in messages:
            content = message.get("content")
            count = content.count(IMAGE_PLACEHOLDER) if isinstance(content, str) else 0
            if count:
                pieces = content.split(IMAGE_PLACEHOLDER)
                content = pieces[0] + "".join(texts[used + k] + piece for k, piece in enumerate(pieces[1:]))
                message = {**message, "content": content}
            out.append({**message, _RANGE_KEY: (used, used + count)})
            used += count
        if used != len(refs):  # formats.py checks this for dataset rows; rows built in code land here
            raise DataError(f"{used} {IMAGE_PLACEHOLDER} placeholders for {len(refs)} images; write one per image")
        return out, sizes

    def encode_rows(self, rows: list[dict]) -> list[list[dict[str, Any]]]:
        """Each row's kept examples (SupervisedEncoder.encode_rows plus `images` and the IMAGE_COUNTERS)."""
        prepared = [self.messages(row) for row in rows]
        conversations = [(messages, self.encoder.options(row)) for row, (messages, _) in zip(rows, prepared)]
        out = []
        for row, (_, sizes), examples in zip(rows, prepared, self.encoder.encode_conversations(conversations)):
            out.append(self._with_images(row, sizes, examples))
        return out

    def _with_images(self, row: dict, sizes: list[int], examples: list[dict]) -> list[dict]:
        refs = list(row.get("images") or [])
        kept = []
        dropped = 0
        for example in examples:
            ranges = [m.get(_RANGE_KEY, (0, 0)) for m in example["_messages"]]
            held = [i for start, end in ranges for i in range(start, end)]
            tokens = sum(token in self._mm_ids for token in example["input_ids"])
            if tokens != sum(sizes[i] for i in held):  # an image (partly) cut off: never train on half an image
                dropped += 1
                continue
            example["labels"] = [IGNORE_INDEX if token in self._mm_ids else label
                                 for token, label in zip(example["input_ids"], example["labels"])]
            example["images"] = [refs[i] for i in held]
            example["num_images"], example["num_image_tokens"], example["images_dont_fit"] = len(held), tokens, 0
            kept.append(example)
        if not dropped:
            return kept
        # What the row's dropped examples carried for the counts (encode_conversations puts it on the first) moves
        # to the first kept one, or to an empty marker the pipeline counts and removes (EMPTY_MARKER).
        first = kept[0] if kept else {"input_ids": [], "labels": [], "images": [], "num_images": 0,
                                      "num_image_tokens": 0, "truncated": False, "num_supervised": 0}
        for key in ("expanded", "answers_dropped", "split_at_seams", "texts_cut", "rows_shortened"):
            first[key] = sum(int(e.get(key, 0)) for e in examples)
        first["images_dont_fit"] = dropped
        return kept or [first]

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        columns = list(batch)
        rows = [dict(zip(columns, values)) for values in zip(*(batch[c] for c in columns))]
        keys = list(self.features)
        out: dict[str, list] = {key: [] for key in keys}
        for kept in self.encode_rows(rows):
            for example in kept:
                for key in keys:
                    out[key].append(example.get(key, 0))
        return out


# ---- batches --------------------------------------------------------------------------------------------------


@dataclass
class VisionCollator:
    """Batches of examples with images: the text collator's batch (padded or padding-free, unchanged) plus the
    processor's image tensors for the images of the batch, in the order their tokens appear in it (each model
    family places image features at its image tokens in that order, so padding-free rows keep each image with
    its sample), and the multi-modal token types where the model takes them (Gemma 3's token_type_ids)."""

    inner: Any  # SupervisedCollator | PaddingFreeCollator (data/collate.py)
    processor: Any
    settings: ImageSettings = field(default_factory=ImageSettings)
    token_type_key: str | None = None

    def images_in_order(self, examples: list[dict]) -> list:
        """The batch's image references in the order of their tokens in the batch: examples (or, for pairs,
        every row's first sequence, then every row's second: PairedCollator's order, both with the row's
        images) laid out as the inner collator lays them out."""

        if isinstance(self.inner, PairedCollator):
            first, second = self.inner.first, self.inner.second
            lengths = [len(e[f"{p}input_ids"]) for p in (first, second) for e in examples]
            images = [e.get("images") or [] for e in examples] * 2
            padding_free = self.inner.padding_free is not None
        else:
            lengths = [len(e["input_ids"]) for e in examples]
            images = [e.get("images") or [] for e in examples]
            padding_free = isinstance(self.inner, PaddingFreeCollator)
        order = [i for row in padding_free_layout(lengths) for i in row] if padding_free else range(len(lengths))
        return [ref for i in order for ref in images[i]]

    def __call__(self, examples: list[dict], **kwargs) -> dict:
        refs = self.images_in_order(examples)
        batch = self.inner([{k: v for k, v in e.items() if k != "images"} for e in examples], **kwargs)
        if refs:
            batch.update(image_inputs(self.processor, prepare_images(refs, self.settings)))
        if self.token_type_key is not None:
            types = self.processor.create_mm_token_type_ids(batch["input_ids"].tolist())
            batch[self.token_type_key] = torch.as_tensor(types, dtype=torch.long)
        return batch


# Batch keys the image inputs may add (besides pixel_values), passed to the model by stages that pick inputs.
IMAGE_INPUT_KEYS = ("pixel_values", "image_sizes", "image_grid_thw", "pixel_attention_mask", "token_type_ids",
                    "mm_token_type_ids", "image_attention_mask")


def image_inputs(processor: Any, images: list) -> dict:
    """The model inputs of `images` exactly as the processor's own call makes them (pixel_values, image_sizes,
    image_grid_thw, ...: what its image processor returns), without the text ones."""
    out = processor(images=images, text=[processor.image_token * len(images)], return_tensors="pt")
    return {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")}


def token_type_key(model: Any, processor: Any) -> str | None:
    """The name under which this model takes multi-modal token types, when its processor makes them."""
    if not getattr(processor, "return_mm_token_type_ids", False):
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parameters = inspect.signature(base.forward).parameters
    return next((key for key in ("mm_token_type_ids", "token_type_ids") if key in parameters), None)


# ---- what a stage needs -----------------------------------------------------------------------------------------


def vision_inputs(processor: Any, model_args: Any) -> tuple[Any, ImageSettings] | None:
    """(processor, image settings) of a vision-language run, None for a text-only model (no processor)."""
    if processor is None:
        return None
    return processor, ImageSettings(model_args.image_max_pixels, model_args.image_min_pixels)


def vision_fingerprint(vision: tuple[Any, ImageSettings] | None) -> str:
    """What of the processor and settings decides the encoded examples, for the tokenized cache's key."""
    if vision is None:
        return ""
    processor, settings = vision
    return f"\n#vision {type(processor).__name__} {processor.image_processor.to_json_string()} {settings}"


def vision_collator(inner: Any, model: Any, vision: tuple[Any, ImageSettings], padding_free: bool | None = None
                    ) -> VisionCollator:
    """The run's collator with images. A family whose processor marks image tokens with token types (Gemma 3:
    image tokens attend to each other both ways) is not isolated by packed rows (measured: packed != padded loss
    in tests/train/test_vision_train.py): packing is refused and padding-free batches fall back to padding."""

    processor, settings = vision
    key = token_type_key(model, processor)
    if key is not None and isinstance(inner, (PackedCollator, PaddingFreeCollator)):
        family = type(model.get_base_model() if hasattr(model, "get_base_model") else model).__name__
        why = f"{family} lets image tokens attend both ways ({key}), which packed rows do not isolate yet"
        if isinstance(inner, PackedCollator):
            raise ConfigError(f"packing: {why}; set packing: false")
        if padding_free:
            raise ConfigError(f"padding_free: {why}; set padding_free: false (or leave it unset)")
        logger.info("padding-free batches off (%s): examples are padded to the longest of each batch", why)
        inner = SupervisedCollator(inner.packed.pad_token_id)
    return VisionCollator(inner, processor, settings, key)


def save_processor_files(processor: Any, out: str) -> list[str]:
    """Write the processor's own files (processor_config.json / preprocessor_config.json) beside a trained model,
    so that AutoProcessor loads from the output folder; the tokenizer files the run saved stay as they are."""
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        processor.save_pretrained(tmp)
        for path in sorted(Path(tmp).iterdir()):
            if path.name.startswith(("tokenizer", "special_tokens_map", "chat_template", "added_tokens", "vocab", "merges")):
                continue
            shutil.copy(path, Path(out) / path.name)
            written.append(path.name)
    return written
