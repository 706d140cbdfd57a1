"""Files shipped inside the package: the tiny tokenizer and base model (see scripts/build_assets.py)."""

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
TINY_MODEL_DIR = ASSETS_DIR / "tiny-llama"
