"""Tiny random vision-language model folders (model + processor) for tests, built in about a second each.

Two families so the path is shown generic: LLaVA (CLIP tower, `<image>` repeated once per patch) and Qwen2-VL
(its own tower, `<|vision_start|><|image_pad|>...<|vision_end|>`, image_grid_thw, M-RoPE positions). Both reuse the
embedded tokenizer (tunelab/assets/tiny-llama) with the family's image tokens added, and its ChatML template.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tunelab.assets import TINY_MODEL_DIR

FAMILIES = ("llava", "qwen2_vl")
HIDDEN = 64


def _tokenizer(extra: list[str]):
    from transformers import AutoTokenizer  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    tokenizer.add_tokens(extra, special_tokens=True)
    return tokenizer


def _text_config(vocab: int) -> dict:
    return dict(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False,
    )


def build_llava(folder: Path) -> Path:
    from transformers import (  # noqa: PLC0415
        CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor,
    )

    tokenizer = _tokenizer(["<image>"])
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    vocab = (len(tokenizer) + 31) // 32 * 32
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=LlamaConfig(**_text_config(vocab)),
                         image_token_index=image_token_id, vision_feature_layer=-1,
                         vision_feature_select_strategy="default", projector_hidden_act="gelu")
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(folder)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=tokenizer.chat_template)
    processor.save_pretrained(folder)
    return folder


def build_qwen2_vl(folder: Path) -> Path:
    from transformers import (  # noqa: PLC0415
        Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor, Qwen2VLProcessor,
    )

    tokenizer = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")}
    vocab = (len(tokenizer) + 31) // 32 * 32
    text = _text_config(vocab)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=dict(depth=1, embed_dim=32, hidden_size=HIDDEN, num_heads=2, mlp_ratio=2, patch_size=8,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(folder)
    image_processor = Qwen2VLImageProcessor(patch_size=8, merge_size=2, temporal_patch_size=2,
                                            min_pixels=16 * 16, max_pixels=64 * 64)
    processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 chat_template=tokenizer.chat_template)
    processor.save_pretrained(folder)
    return folder


BUILDERS = {"llava": build_llava, "qwen2_vl": build_qwen2_vl}


def build_gemma3(folder: Path) -> Path:
    from transformers import (  # noqa: PLC0415
        AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor, Gemma3Processor,
        Gemma3TextConfig, SiglipVisionConfig,
    )

    specials = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR, extra_special_tokens=specials)
    tokenizer.add_tokens(list(specials.values()), special_tokens=True)
    vocab = (len(tokenizer) + 31) // 32 * 32
    text = _text_config(vocab)
    text.update(head_dim=16, sliding_window=64, query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"])
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    config = Gemma3Config(
        text_config=Gemma3TextConfig(**text), vision_config=vision, mm_tokens_per_image=4,
        boi_token_index=tokenizer.convert_tokens_to_ids(specials["boi_token"]),
        eoi_token_index=tokenizer.convert_tokens_to_ids(specials["eoi_token"]),
        image_token_index=tokenizer.convert_tokens_to_ids(specials["image_token"]),
    )
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(config).save_pretrained(folder)
    image_processor = Gemma3ImageProcessor(size={"height": 32, "width": 32})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4,
                                chat_template=tokenizer.chat_template)
    processor.save_pretrained(folder)
    return folder


BUILDERS["gemma3"] = build_gemma3
