"""Files shipped inside the package: the tiny tokenizer and base model (scripts/build_assets.py) and the
tiny vision-language model that shares that tokenizer (scripts/build_vision_asset.py)."""

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
TINY_MODEL_DIR = ASSETS_DIR / "tiny-llama"
TINY_VISION_DIR = ASSETS_DIR / "tiny-llava"

# The names `model_name_or_path` accepts for the embedded models.
EMBEDDED_MODELS = {"tiny": TINY_MODEL_DIR, "tiny-vision": TINY_VISION_DIR}
