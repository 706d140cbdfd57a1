"""Data-test fixtures: the embedded tiny tokenizer, and a word-level one whose ids tests can predict
("w5" is id 8; <pad> 0, <unk> 1, </s> 2)."""

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from transformers import AutoTokenizer

    from tunelab.assets import TINY_MODEL_DIR

    return AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))


@pytest.fixture(scope="module")
def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2} | {f"w{i}": i + 3 for i in range(200)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>", pad_token="<pad>")
