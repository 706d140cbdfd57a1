"""Batched generation with the training template, and exact-match scoring of the answers.

Prompts are rendered by the same Template that training used (with the generation prompt) and
generation stops at the template's end-of-turn token(s), so what is measured is what a user serving
the model sees. Rows with images (a vision-language model: `vision` = (processor, image settings)) are expanded
and turned into image tensors by data/vision.py's helpers, exactly as training encodes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tunelab.config.args import GenerationArguments
from tunelab.data.formats import IMAGE_PLACEHOLDER, prompt_and_reference
from tunelab.data.templates import Template
from tunelab.data.vision import expansions, image_inputs, prepare_images


@dataclass
class Prediction:
    prompt: str
    reference: str
    prediction: str

    @property
    def exact_match(self) -> bool:
        return self.prediction.strip() == self.reference.strip()


def stop_token_ids(tokenizer, template: Template) -> list[int]:
    """Token ids generation stops at: the template's end-of-turn strings that are single tokens, and eos."""
    ids = []
    for word in template.stop_words:
        encoded = tokenizer(word, add_special_tokens=False)["input_ids"]
        if len(encoded) == 1:
            ids.append(encoded[0])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


@torch.no_grad()
def generate_predictions(
    model, tokenizer, template: Template, rows, max_new_tokens: int = 64, batch_size: int = 32,
    template_vars: dict[str, Any] | None = None, vision: tuple[Any, Any] | None = None,
) -> list[Prediction]:
    """Greedy answers for canonical rows (the reference: a ranking row's chosen answer, else the last assistant turn).
    `template_vars`: the template variables the model trained with (template_kwargs); `vision`: a vision-language
    model's (processor, ImageSettings) (data/vision.py's vision_inputs), None for a text-only model."""
    was_training = model.training
    model.eval()
    stops = stop_token_ids(tokenizer, template)
    tokens = {"bos_token": tokenizer.bos_token or "", "eos_token": tokenizer.eos_token or ""}
    items = [prompt_and_reference(row, template) for row in rows]
    prompts = [template.prompt(messages, **tokens, **(template_vars or {})) for messages, _ in items]
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    predictions = []
    for start in range(0, len(prompts), batch_size):
        texts, image_inputs = prompts[start : start + batch_size], {}
        if vision is not None:
            texts, image_inputs = _with_images(texts, [rows[i] for i in range(start, start + len(texts))], vision)
            dtype = next(model.parameters()).dtype
            image_inputs = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device)
                            for k, v in image_inputs.items()}
        chunk = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in texts]
        width = max(len(ids) for ids in chunk)
        # Left padding so every prompt ends where generation begins.
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in chunk], device=device)
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in chunk], device=device)
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, **image_inputs,
            do_sample=False, eos_token_id=stops, pad_token_id=pad_id,
        )
        for row_index, generated in enumerate(output[:, width:].tolist()):
            cut = next((i for i, t in enumerate(generated) if t in stops), len(generated))
            text = tokenizer.decode(generated[:cut], skip_special_tokens=True)
            prompt_index = start + row_index
            predictions.append(Prediction(prompts[prompt_index], items[prompt_index][1], text))
    if was_training:
        model.train()
    return predictions


def _with_images(prompts: list[str], rows: list, vision: tuple[Any, Any]) -> tuple[list[str], dict[str, Any]]:
    """The prompts with each `<image>` replaced by the processor's expansion of its row's image, and the image
    tensors of the chunk (its rows' images in order: the order the model meets their image tokens)."""

    processor, settings = vision
    texts, images = [], []
    for prompt, row in zip(prompts, rows, strict=True):
        row_images = prepare_images(list(row.get("images") or []), settings)
        pieces = prompt.split(IMAGE_PLACEHOLDER)
        if len(pieces) - 1 != len(row_images):  # the dataset checks ran on these rows: a broken invariant
            raise ValueError(f"{len(pieces) - 1} {IMAGE_PLACEHOLDER} placeholders for {len(row_images)} images")
        expanded = expansions(processor, row_images)
        texts.append(pieces[0] + "".join(e + piece for e, piece in zip(expanded, pieces[1:], strict=True)))
        images += row_images
    return texts, (image_inputs(processor, images) if images else {})


def exact_match(predictions: list[Prediction]) -> float:
    return sum(p.exact_match for p in predictions) / max(len(predictions), 1)


def held_out_rows(eval_rows: dict, generation: GenerationArguments):
    """The canonical rows the stages' before/after exact match is measured on: the first
    eval_generation_samples rows of the first eval set (None without eval_generation or an eval set)."""
    if not generation.eval_generation or not eval_rows:
        return None
    rows = next(iter(eval_rows.values()))
    return rows.select(range(min(generation.eval_generation_samples, len(rows))))


def held_out_predictions(model, tokenizer, template: Template, rows, generation, data_args, args,
                         vision=None) -> list[Prediction]:
    """Greedy answers to `rows` with the run's generation settings: GenerationArguments, DataArguments (the
    template variables), TrainingArguments (the batch size)."""
    return generate_predictions(
        model, tokenizer, template, rows, max_new_tokens=generation.max_new_tokens,
        batch_size=args.per_device_eval_batch_size * 4, template_vars=data_args.template_kwargs, vision=vision,
    )


def held_out_exact_match(model, tokenizer, template: Template, rows, generation, data_args, args,
                         vision=None) -> float:
    """Greedy exact match on `rows` with the run's generation settings (held_out_predictions)."""
    return exact_match(held_out_predictions(model, tokenizer, template, rows, generation, data_args, args, vision))
