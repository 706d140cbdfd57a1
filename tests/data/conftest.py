"""Data-test fixtures: the embedded tiny tokenizer."""

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from transformers import AutoTokenizer

    from tunelab.assets import TINY_MODEL_DIR

    return AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
