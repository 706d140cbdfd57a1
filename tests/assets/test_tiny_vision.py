"""The embedded tiny vision-language model (src/tunelab/assets/tiny-llava): loads with plain transformers auto
classes, expands `<image>` through its own processor, stays inside the size budget and is what its recipe writes."""

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from tunelab.assets import ASSETS_DIR, TINY_MODEL_DIR, TINY_VISION_DIR
from tunelab.config.args import ModelArguments

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPE = REPO_ROOT / "scripts" / "build_vision_asset.py"


def test_tiny_vision_name_resolves_to_the_asset_folder():
    assert ModelArguments(model_name_or_path="tiny-vision").model_name_or_path == str(TINY_VISION_DIR)


def test_all_assets_fit_the_10_mb_budget():
    total = sum(p.stat().st_size for p in ASSETS_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert total <= 10_000_000, f"assets take {total / 1e6:.2f} MB"


def test_tokenizer_is_the_embedded_one_plus_the_image_token():
    text = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    vision = AutoTokenizer.from_pretrained(TINY_VISION_DIR)
    assert len(vision) == len(text) + 1
    assert vision.convert_tokens_to_ids("<image>") == len(text)
    sample = "What colour is the triangle? 12 circles"
    assert vision.encode(sample) == text.encode(sample)


def test_processor_expands_one_placeholder_to_16_image_tokens_and_the_model_runs():
    processor = AutoProcessor.from_pretrained(TINY_VISION_DIR)
    model = AutoModelForImageTextToText.from_pretrained(TINY_VISION_DIR).eval()
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many circles?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text == "<|im_start|>user\n<image>How many circles?<|im_end|>\n<|im_start|>assistant\n"
    # The string form of the same message renders identically.
    assert processor.apply_chat_template([{"role": "user", "content": "<image>How many circles?"}],
                                         add_generation_prompt=True) == text
    batch = processor(images=[Image.new("RGB", (100, 80), (255, 0, 0))], text=text, return_tensors="pt")
    image_token = model.config.image_token_id
    assert int((batch["input_ids"] == image_token).sum()) == 16
    assert tuple(batch["pixel_values"].shape) == (1, 3, 64, 64)
    # Pure red after normalising with mean = std = 0.5: channel values 1, -1, -1.
    assert torch.equal(batch["pixel_values"][0, :, 0, 0], torch.tensor([1.0, -1.0, -1.0]))
    with torch.no_grad():
        logits = model(**batch).logits
    assert tuple(logits.shape) == (1, batch["input_ids"].shape[1], len(processor.tokenizer))


def _digests(folder: Path) -> dict[str, str]:
    """Each file's sha256, a JSON file's without the `transformers_version` stamp: that names the transformers that
    wrote the file (a fresh install may be a patch release newer than the one that built the asset), not its content."""
    digests = {}
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        if path.suffix == ".json":
            data = re.sub(rb'\n\s*"transformers_version": "[^"]*",?', b"", data)
        digests[path.name] = hashlib.sha256(data).hexdigest()
    return digests


@pytest.mark.slow  # reruns the recipe with its 300 caption-pretraining steps: 85 s on 2 idle cores
@pytest.mark.skipif(os.environ.get("TUNELAB_FULL_CHECKS") != "1",
                    reason="retrains the vision asset (about 90 s): runs in CI (.ci/run sets TUNELAB_FULL_CHECKS=1); "
                    "run it here with TUNELAB_FULL_CHECKS=1 make test")
def test_recipe_rebuilds_the_committed_files(tmp_path):
    out = tmp_path / "tiny-llava"
    subprocess.run([sys.executable, str(RECIPE), "--out", str(out)],
                   check=True, capture_output=True, timeout=1200)  # 304-813 s measured on the loaded machine
    rebuilt, committed = _digests(out), _digests(TINY_VISION_DIR)
    weights = "model.safetensors"
    assert {k: v for k, v in rebuilt.items() if k != weights} == {k: v for k, v in committed.items() if k != weights}
    if rebuilt[weights] != committed[weights]:
        # Another CPU's kernels round some sums differently and 300 steps amplify it (the recipe's docstring):
        # then the rebuilt model must score the committed one's caption loss on unseen scenes.
        scored = subprocess.run([sys.executable, str(RECIPE), "--caption-loss", str(out), str(TINY_VISION_DIR)],
                                check=True, capture_output=True, text=True, timeout=300)
        losses = [float(loss) for loss in re.findall(r"^caption loss (\S+)$", scored.stdout, re.M)]
        assert len(losses) == 2 and losses[0] == pytest.approx(losses[1], rel=0.05), f"rebuilt, committed: {losses}"
