"""data/vision.py: rows with images encode through the model's own processor.

Processor equivalence: tunelab's ids equal the processor's own call on the rendered conversation, and the
collator's pixel values equal the processor's; masks are exact (image and prompt tokens never supervised); an
image that does not fit cutoff_len drops its example (counted), never half of it.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer

from tunelab.data.collate import SupervisedCollator
from tunelab.data.encode import IGNORE_INDEX, SupervisedEncoder
from tunelab.data.formats import template_messages
from tunelab.data.templates import get_template
from tunelab.data.vision import ImageSettings, VisionCollator, VisionEncoder, image_token_ids

FAMILIES = ["llava", "gemma3"]


def _png(tmp_path, name, color, size=(40, 30)):
    path = tmp_path / name
    Image.new("RGB", size, color).save(path)
    return {"bytes": None, "path": str(path)}


def _row(messages, images=(), system=""):
    return {"messages": [{"role": r, "content": c, "tool_calls": "", "tool_call_id": "", "reasoning": ""}
                         for r, c in messages], "system": system, "tools": "", "chosen": "", "rejected": "",
            "images": list(images)}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_vlm_dirs):
    folder = tiny_vlm_dirs[request.param]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = AutoProcessor.from_pretrained(folder)
    template = get_template("model", tokenizer)
    return request.param, tokenizer, processor, template


def _encoder(family, cutoff_len=256):
    _, tokenizer, processor, template = family
    return VisionEncoder(SupervisedEncoder(tokenizer=tokenizer, template=template, cutoff_len=cutoff_len), processor)


def _processor_call(family, row, images):
    """The processor's own encoding of the conversation: rendered whole, <image> as its image token."""
    _, tokenizer, processor, template = family
    messages = [{**m, "content": m["content"].replace("<image>", processor.image_token)}
                for m in template_messages(row, template)]
    text = template.render(messages, bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "")
    return processor(text=[text], images=images or None, add_special_tokens=False, return_tensors="pt")


def test_ids_and_pixels_equal_the_processors_own_call(family, tmp_path):
    red, blue = _png(tmp_path, "red.png", (255, 0, 0)), _png(tmp_path, "blue.png", (0, 0, 255), (20, 50))
    rows = [
        _row([("user", "<image>What colour is it?"), ("assistant", "Red.")], [red]),
        _row([("user", "Compare <image> and <image> please"), ("assistant", "They differ."),
              ("user", "Sure?"), ("assistant", "Yes.")], [red, blue]),
        _row([("user", "No picture here."), ("assistant", "Fine.")]),
    ]
    encoder = _encoder(family)
    _, _, processor, _ = family
    examples = [e for kept in encoder.encode_rows(rows) for e in kept]
    assert [e["num_images"] for e in examples] == [1, 2, 0]
    for row, example in zip(rows, examples):
        images = [Image.open(ref["path"]).convert("RGB") for ref in row["images"]]
        expected = _processor_call(family, row, images)
        assert example["input_ids"] == expected["input_ids"][0].tolist()
        batch = VisionCollator(SupervisedCollator(0), processor)([example])
        if images:
            assert torch.equal(batch["pixel_values"], expected["pixel_values"])
        else:
            assert "pixel_values" not in batch


def test_masks_exact_image_and_prompt_tokens_never_trained(family, tmp_path):
    _, tokenizer, processor, template = family
    red = _png(tmp_path, "red.png", (255, 0, 0))
    row = _row([("user", "<image>Colour?"), ("assistant", "Red."), ("user", "Again <image>"), ("assistant", "Red.")],
               [red, red])
    (example,) = _encoder(family).encode_rows([row])[0]
    ids, labels = example["input_ids"], example["labels"]
    mm = image_token_ids(processor)
    assert sum(i in mm for i in ids) == example["num_image_tokens"] > 0
    # Exactly the two answers (with their end-of-turn) train: the text encoder's masks for the same text.
    answer = tokenizer("Red.<|im_end|>", add_special_tokens=False)["input_ids"]
    supervised = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
    assert [ids[i] for i in supervised] == answer + answer
    assert all(labels[i] == ids[i] for i in supervised)
    assert not any(labels[i] != IGNORE_INDEX for i, token in enumerate(ids) if token in mm)


def test_an_image_that_does_not_fit_is_dropped_whole_and_counted(family, tmp_path):
    _, _, processor, _ = family
    red = _png(tmp_path, "red.png", (255, 0, 0))
    rows = [_row([("user", "<image>"), ("assistant", "Red.")], [red]), _row([("user", "Short."), ("assistant", "Ok.")])]
    full = _encoder(family).encode_rows(rows[:1])[0][0]
    mm = image_token_ids(processor)
    last_image_token = max(i for i, token in enumerate(full["input_ids"]) if token in mm)
    answer_start = next(i for i, label in enumerate(full["labels"]) if label != IGNORE_INDEX)
    # Short by one more than the prompt's text after the image: fitting would cut the image's last token. The
    # example goes, counted; the other row stays.
    short = answer_start - last_image_token
    first, second = _encoder(family, cutoff_len=len(full["input_ids"]) - short).encode_rows(rows)
    assert [(e["input_ids"], e["images_dont_fit"]) for e in first] == [([], 1)]
    assert second[0]["num_images"] == 0 and second[0]["input_ids"]
    # An image whose exchange is dropped whole (earliest turns first) leaves with it: the example has no image.
    long_row = _row([("user", "<image>Colour?"), ("assistant", "Red."), ("user", "w " * 40), ("assistant", "Ok.")], [red])
    (only,) = _encoder(family, cutoff_len=60).encode_rows([long_row])[0]
    assert (only["images"], only["num_image_tokens"], only["answers_dropped"]) == ([], 0, 1)
    assert not set(only["input_ids"]) & image_token_ids(processor)


def test_image_settings_resize_before_the_processor(family, tmp_path):
    _, _, processor, _ = family
    big = _png(tmp_path, "big.png", (0, 255, 0), (400, 300))
    row = _row([("user", "<image>?"), ("assistant", "Green.")], [big])
    encoder = VisionEncoder(_encoder(family).encoder, processor, ImageSettings(max_pixels=40 * 30))
    (example,) = encoder.encode_rows([row])[0]
    assert example["num_images"] == 1
