"""Training a vision-language model: padded, padding-free and packed batches give the same loss with images
(each image stays with its sample), and tunelab train runs sft / dpo end to end on tiny LLaVA / Gemma 3 folders."""

from __future__ import annotations

import datasets
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from tunelab.data.collate import PackedCollator, PaddingFreeCollator, SupervisedCollator
from tunelab.data.encode import SupervisedEncoder
from tunelab.data.packing import pack_dataset
from tunelab.data.templates import get_template
from tunelab.data.vision import ImageSettings, VisionCollator, VisionEncoder, token_type_key, vision_collator
from tunelab.errors import ConfigError

COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255)}


def _rows(tmp_path) -> list[dict]:
    """Rows with 1, 2, 0 and 1 images, distinct pictures (a leak of one sample's image into another shows)."""
    paths = {}
    for k, (name, colour) in enumerate(COLOURS.items()):
        path = tmp_path / f"{name}.png"
        Image.new("RGB", (24 + 8 * k, 32), colour).save(path)
        paths[name] = {"bytes": None, "path": str(path)}

    def row(turns, images=()):
        return {"messages": [{"role": r, "content": c, "tool_calls": "", "tool_call_id": "", "reasoning": ""}
                             for r, c in turns], "system": "", "tools": "", "chosen": "", "rejected": "",
                "images": [paths[i] for i in images]}

    return [
        row([("user", "<image>What colour?"), ("assistant", "Red.")], ["red"]),
        row([("user", "<image> then <image>: which is brighter? Think of " + "w " * 30), ("assistant", "The second, white.")],
            ["blue", "white"]),
        row([("user", "No image, just talk."), ("assistant", "Talking then.")]),
        row([("user", "Colour <image>"), ("assistant", "Green, quite green.")], ["green"]),
    ]


@pytest.fixture(params=["llava"])  # Gemma 3: refused (test_packing_refused_where_images_attend_both_ways)
def vlm(request, tiny_vlm_dirs):
    folder = tiny_vlm_dirs[request.param]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="sdpa").eval()
    model.config.use_cache = model.config.get_text_config().use_cache = False  # as load_model sets them
    return request.param, tokenizer, processor, model


def _examples(vlm, tmp_path) -> list[dict]:
    _, tokenizer, processor, _ = vlm
    encoder = VisionEncoder(SupervisedEncoder(tokenizer, get_template("model", tokenizer), cutoff_len=128), processor)
    return [e for kept in encoder.encode_rows(_rows(tmp_path)) for e in kept]


def _loss(model, batch) -> float:
    with torch.no_grad():
        return model(**batch).loss.item()


def test_padded_padding_free_and_packed_losses_agree_with_images(vlm, tmp_path):
    name, tokenizer, processor, model = vlm
    examples = _examples(vlm, tmp_path)
    assert [len(e["images"]) for e in examples] == [1, 2, 0, 1]
    key = token_type_key(model, processor)
    pad = tokenizer.pad_token_id
    padded = VisionCollator(SupervisedCollator(pad), processor, token_type_key=key)(examples)
    free_inner = PaddingFreeCollator(PackedCollator.for_model(model, pad))
    padding_free = VisionCollator(free_inner, processor, token_type_key=key)(examples)
    assert padding_free["input_ids"].shape[0] < len(examples)  # really laid side by side
    reference = _loss(model, padded)
    assert _loss(model, padding_free) == pytest.approx(reference, abs=1e-5)

    encoded = datasets.Dataset.from_list([{k: e[k] for k in ("input_ids", "labels", "images")} for e in examples])
    packed, stats = pack_dataset(encoded, cutoff_len=256)
    assert stats.rows == 1 and len(packed[0]["images"]) == 4
    batch = VisionCollator(PackedCollator.for_model(model, pad), processor, token_type_key=key)(list(packed))
    assert _loss(model, batch) == pytest.approx(reference, abs=1e-5)

    # The check can fail: the same packed row with the images of two samples swapped gives another loss.
    swapped = list(packed)
    swapped[0] = {**swapped[0], "images": [swapped[0]["images"][i] for i in (1, 0, 2, 3)]}
    wrong = VisionCollator(PackedCollator.for_model(model, pad), processor, token_type_key=key)(swapped)
    if not torch.equal(wrong["pixel_values"], batch["pixel_values"]):
        assert abs(_loss(model, wrong) - reference) > 1e-4


def test_packing_refused_where_images_attend_both_ways(tiny_vlm_dirs, tmp_path):
    """Gemma 3's image tokens attend to each other both ways (token_type_ids); packed rows leak across samples
    there (the loss moves by ~1e-3), so packing is refused and padding-free falls back to padding."""
    vlm = ("gemma3", AutoTokenizer.from_pretrained(tiny_vlm_dirs["gemma3"]),
           AutoProcessor.from_pretrained(tiny_vlm_dirs["gemma3"]),
           AutoModelForImageTextToText.from_pretrained(tiny_vlm_dirs["gemma3"], attn_implementation="sdpa").eval())
    _, tokenizer, processor, model = vlm
    model.config.use_cache = model.config.get_text_config().use_cache = False
    examples = _examples(vlm, tmp_path)
    key = token_type_key(model, processor)
    padded = VisionCollator(SupervisedCollator(0), processor, token_type_key=key)(examples)
    free = VisionCollator(PaddingFreeCollator(PackedCollator.for_model(model, 0)), processor, token_type_key=key)(examples)
    assert abs(_loss(model, free) - _loss(model, padded)) > 1e-4  # the leak this refusal is about
    vision = (processor, ImageSettings())
    with pytest.raises(ConfigError) as info:
        vision_collator(PackedCollator.for_model(model, 0), model, vision)
    assert str(info.value) == ("packing: Gemma3ForConditionalGeneration lets image tokens attend both ways "
                               "(token_type_ids), which packed rows do not isolate yet; set packing: false")
    fallback = vision_collator(PaddingFreeCollator(PackedCollator.for_model(model, 0)), model, vision)
    assert isinstance(fallback.inner, SupervisedCollator)
    assert _loss(model, fallback(examples)) == pytest.approx(_loss(model, padded), abs=1e-6)


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_kept_logits_give_the_plain_loss_with_images(tiny_vlm_dirs, tmp_path, family):
    """The trainer passes logits_to_keep (a mask of supervised positions): the VLM families honour it."""
    from tunelab.train.losses import CausalLMLoss, causal_lm_loss, next_token_mask  # noqa: PLC0415
    from tunelab.train.trainer import takes_logits_to_keep  # noqa: PLC0415

    folder = tiny_vlm_dirs[family]
    vlm = (family, AutoTokenizer.from_pretrained(folder), AutoProcessor.from_pretrained(folder),
           AutoModelForImageTextToText.from_pretrained(folder).eval())
    _, tokenizer, processor, model = vlm
    batch = VisionCollator(SupervisedCollator(0), processor, token_type_key=token_type_key(model, processor))(
        _examples(vlm, tmp_path))
    labels = batch.pop("labels")
    assert takes_logits_to_keep(model)
    with torch.no_grad():
        plain = causal_lm_loss(model(**batch).logits, labels)
        kept = CausalLMLoss()(model(**batch, logits_to_keep=next_token_mask(labels)), labels)
    assert kept.item() == pytest.approx(plain.item(), abs=1e-5)


def test_pair_log_probs_equal_padded_and_padding_free_with_images(tiny_vlm_dirs, tmp_path):
    """dpo on image pairs: each sequence's summed log-prob is the same padded or laid side by side."""
    from tunelab.data.collate import PairedCollator  # noqa: PLC0415
    from tunelab.data.pairwise import PairwiseEncoder  # noqa: PLC0415
    from tunelab.train.preference_trainer import batch_log_probs  # noqa: PLC0415

    folder = tiny_vlm_dirs["llava"]
    tokenizer, processor = AutoTokenizer.from_pretrained(folder), AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="sdpa").eval()
    model.config.use_cache = model.config.get_text_config().use_cache = False
    inner = SupervisedEncoder(tokenizer, get_template("model", tokenizer), cutoff_len=128, mask_history=True)
    rows = _rows(tmp_path)
    pairs = [{**row, "messages": row["messages"][:-1], "chosen": row["messages"][-1]["content"], "rejected": "No."}
             for row in rows]
    encoded = PairwiseEncoder(VisionEncoder(inner, processor))({k: [r[k] for r in pairs] for k in pairs[0]})
    examples = [dict(zip(encoded, values)) for values in zip(*encoded.values())]
    assert [len(e["images"]) for e in examples] == [1, 2, 0, 1]
    padded = VisionCollator(PairedCollator(0), processor)(examples)
    free = VisionCollator(PairedCollator(0, padding_free=PaddingFreeCollator(PackedCollator.for_model(model, 0))),
                          processor)(examples)
    assert free["input_ids"].shape[0] < 2 * len(examples)
    with torch.no_grad():
        expected, _ = batch_log_probs(model, padded)
        got, _ = batch_log_probs(model, free)
    assert torch.allclose(got, expected, atol=1e-4)
