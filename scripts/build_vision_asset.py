"""Build the embedded tiny vision-language model: src/tunelab/assets/tiny-llava/.

This script is the committed recipe for those files; nothing else writes them. It
  1. loads the embedded tokenizer (src/tunelab/assets/tiny-llama, built by build_assets.py) and adds
     one special token, `<image>`, the placeholder the processor expands to one token per patch;
  2. initialises a LlavaForConditionalGeneration from a fixed seed: a small SigLIP vision tower
     (64x64 RGB, 16x16 patches -> 16 image tokens), LLaVA's two-layer projector and a Llama
     language model of the same shape as tiny-llama (tied embeddings drawn at 1/sqrt(hidden), as
     build_assets.py does, for the same reason);
  3. pretrains the whole model on captions of shapes scenes (LLaVA's first stage: align the image features with
     the language model), see `pretrain_captions`: without it the quickstart's SFT learns only the answer prior
     (held-out exact match = the blind baseline, vision tower frozen or not; docs/multimodal.md has the figures);
  4. saves model (fp32 safetensors), tokenizer and a LlavaProcessor whose image processor is
     SiglipImageProcessorPil (runs on PIL + numpy: no torchvision needed).

The chat template is ChatML that also accepts content-part lists: an {"type": "image"} part renders
as `<image>`, a text part as its text, so both `"content": "<image>What..."` and the processor's
list form give the same string.

Reproducible output: every random source is seeded, torch runs single-threaded with deterministic
algorithms and AVX2 kernels (torch's own kernels, MKL and oneDNN are told not to pick their AVX-512
paths, whose float sums round differently; the committed files were built that way), and JSON files are
written with sorted keys, so two runs on one machine give byte-identical files on the same library
versions. Across CPUs the weights may still differ: an AMX Xeon rounds some sums differently under the
same AVX2 caps (MKL's own CNR mode, MKL_CBWR=AVX2, did not change that), and 300 steps amplify it;
there the trained model scores the same caption loss to about 1% (`--caption-loss FOLDER...`), and the
other files are byte-identical. Check with:
    python scripts/build_vision_asset.py && (cd src/tunelab/assets/tiny-llava && sha256sum *) > /tmp/a
    python scripts/build_vision_asset.py && (cd src/tunelab/assets/tiny-llava && sha256sum *) > /tmp/b
    diff /tmp/a /tmp/b && echo identical
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

# Read by torch, MKL and oneDNN when they load: set before torch is imported. An AVX-512 CPU would otherwise take
# other kernels than the AVX2 one that built the committed files (the same values, rounded in another order).
os.environ.update(ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2", ONEDNN_MAX_CPU_ISA="AVX2")

import torch  # noqa: E402
from PIL import Image
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    SiglipVisionConfig,
)
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from build_assets import EMBED_STD, MODEL_SHAPE, empty_folder, sort_json  # scripts/, beside this file

from tunelab.assets import TINY_MODEL_DIR
from tunelab.data import synthetic

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "src" / "tunelab" / "assets" / "tiny-llava"

SEED = 0
IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 64
PATCH_SIZE = 16
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2

VISION_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=IMAGE_SIZE,
    patch_size=PATCH_SIZE,
    num_channels=3,
    vision_use_head=False,  # LLaVA takes the patch features; the pooling head would be dead weight
)
TEXT_SHAPE = MODEL_SHAPE  # the language model has tiny-llama's shape (and its embedding scale, EMBED_STD)
PRETRAIN = dict(steps=300, batch_size=32, lr=2e-3, warmup=15)
CELL_NAMES = ("top left", "top right", "bottom left", "bottom right")

CHAT_TEMPLATE = """{#- ChatML; content is a string or a list of parts, an image part renders as <image>. #}
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' }}
    {%- if message['content'] is string %}
        {{- message['content'] }}
    {%- else %}
        {%- for part in message['content'] %}
            {%- if part['type'] in ['image', 'image_url'] %}
                {{- '<image>' }}
            {%- elif part['type'] == 'text' %}
                {{- part['text'] }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def build_tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    tokenizer.add_special_tokens({"extra_special_tokens": [*tokenizer.extra_special_tokens, IMAGE_TOKEN]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_processor(tokenizer) -> LlavaProcessor:
    image_processor = SiglipImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        resample=Image.Resampling.BICUBIC,
        do_resize=True,
        do_rescale=True,
        do_normalize=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="full",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=0,
        chat_template=CHAT_TEMPLATE,
    )


def build_model(tokenizer, seed: int) -> LlavaForConditionalGeneration:
    text_config = LlamaConfig(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
        **TEXT_SHAPE,
    )
    config = LlavaConfig(
        vision_config=SiglipVisionConfig(**VISION_SHAPE),
        text_config=text_config,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=NUM_IMAGE_TOKENS,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="full",  # SigLIP has no CLS token to drop
        vision_feature_layer=-1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, EMBED_STD)
    model.tie_weights()
    return model


def caption(shapes: tuple[synthetic.Shape, ...]) -> str:
    """What the picture shows, cell by cell: 'top left red circle, bottom right blue square.' ('nothing.' if empty).
    Names and colours only: never a count or a question of the SFT task."""
    parts = [f"{CELL_NAMES[s.cell]} {s.colour} {s.kind}" for s in sorted(shapes, key=lambda s: s.cell)]
    return (", ".join(parts) or "nothing") + "."


def caption_scenes(num_samples: int, seed: int) -> list[tuple[Image.Image, str]]:
    """Pictures of train-split scenes only (synthetic.split_of), so the held-out test pictures stay unseen."""
    rng = random.Random(seed)
    out = []
    while len(out) < num_samples:
        shapes = synthetic._shapes_scene(rng)
        if synthetic.split_of("shapes", synthetic.shapes_scene_key(shapes)) == "train":
            out.append((synthetic.draw_shapes(shapes, rng), caption(shapes)))
    return out


def caption_loss_of(model, processor, chunk: list[tuple[Image.Image, str]]) -> torch.Tensor:
    """The mean loss on the captions of `chunk` (`<image>` + caption + eos, the image tokens and padding unscored)."""
    texts = [IMAGE_TOKEN + text + processor.tokenizer.eos_token for _, text in chunk]
    batch = processor(images=[image for image, _ in chunk], text=texts, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    labels = labels.masked_fill(labels == model.config.image_token_id, -100)
    return model(**batch, labels=labels).loss


@torch.no_grad()
def scored_caption_loss(folder: Path) -> float:
    """A built folder's caption loss on 64 scenes the recipe does not train on (another seed, train split)."""
    model = LlavaForConditionalGeneration.from_pretrained(folder).eval()
    processor = LlavaProcessor.from_pretrained(folder)
    return caption_loss_of(model, processor, caption_scenes(64, SEED + 2)).item()


def pretrain_captions(model: LlavaForConditionalGeneration, processor: LlavaProcessor, seed: int, steps: int) -> None:
    """Plain captioning (`<image>` + caption + eos, loss on the caption), fixed data order, all weights training."""
    if steps <= 0:
        return
    cfg = PRETRAIN
    scenes = caption_scenes(steps * cfg["batch_size"], seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / cfg["warmup"]) * max(0.0, 1 - s / steps)
    )
    model.train()
    for step in range(steps):
        chunk = scenes[step * cfg["batch_size"] : (step + 1) * cfg["batch_size"]]
        loss = caption_loss_of(model, processor, chunk)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            print(f"pretrain step {step:4d} loss {loss.item():.3f}", flush=True)
    model.eval()


def save(model: LlavaForConditionalGeneration, processor: LlavaProcessor, out_dir: Path) -> None:
    empty_folder(out_dir)
    tokenizer = processor.tokenizer
    processor.save_pretrained(out_dir)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    # Loading the embedded tokenizer leaves where-it-came-from keys behind; they describe nothing here.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    config_path.write_text(json.dumps(config), encoding="utf-8")
    for path in sorted(out_dir.glob("*.json")):
        if path.name != "tokenizer.json":
            sort_json(path)
    for path in out_dir.iterdir():
        path.chmod(0o644)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--pretrain-steps", type=int, default=PRETRAIN["steps"])
    parser.add_argument("--caption-loss", type=Path, nargs="+", metavar="FOLDER",
                        help="print each FOLDER's caption loss on 64 unseen scenes instead of building")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if args.caption_loss:
        for folder in args.caption_loss:
            print(f"caption loss {scored_caption_loss(folder):.6f}")
        return
    start = time.time()
    tokenizer = build_tokenizer()
    processor = build_processor(tokenizer)
    model = build_model(tokenizer, SEED)
    pretrain_captions(model, processor, SEED, args.pretrain_steps)
    save(model, processor, args.out)
    params = sum(p.numel() for p in model.parameters())
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1e6:.2f} MB, vocab {len(tokenizer)}, {params:,} params) in {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
