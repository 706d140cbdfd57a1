"""The shortcuts encoding takes for speed give exactly what the plain way gives.

Tokenising through the fast tokenizer's backend equals ``tokenizer(texts, ...)``, and falls back to it whenever
the call would configure the backend first; the last turn's span reuses the full render; format conversion in one batched
pass equals the per-row converter followed by the empty-answer filter (the streaming path).
"""

from __future__ import annotations

import datasets
import pytest
from transformers import PreTrainedTokenizerFast

from tests.data.test_template_spans import family_tokenizer, tiny_tokenizer
from tunelab.data.encode import PieceTokenizer, _direct_backend
from tunelab.data.formats import CANONICAL_FEATURES, RowConverter, to_canonical
from tunelab.data.registry import DatasetSpec
from tunelab.data.templates import TEMPLATE_NAMES, get_template
from tunelab.data.templates.spans import assistant_spans

TEXTS = [
    "",
    "plain words w5 w7",
    "<|im_start|>user\nSay 中文 & JSON {\"a\": 1}<|im_end|>\n<|im_start|>assistant\n好的 🙂<|im_end|>\n",
    "  leading and trailing spaces, tabs\t and\n\nnewlines  ",
    "<s>[INST] digits 12345 and </s> marks [/INST]</s>",
]


def expected(tokenizer, texts):
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def tokenize(tokenizer, texts):
    return PieceTokenizer(tokenizer)._raw(texts)


@pytest.mark.parametrize("which", ["tiny", "word", *sorted(TEMPLATE_NAMES)])
def test_backend_tokenisation_equals_the_tokenizer_call(which, tiny_tokenizer, word_tokenizer):
    tokenizer = {"tiny": tiny_tokenizer, "word": word_tokenizer}.get(which) or family_tokenizer(which)
    assert _direct_backend(tokenizer) is not None  # the shortcut is what is under test
    assert tokenize(tokenizer, TEXTS) == expected(tokenizer, TEXTS)


def fresh_tokenizer():
    return tiny_tokenizer(["<|im_start|>", "<|im_end|>"], "<s>", "</s>")


def test_backend_with_truncation_or_padding_falls_back_to_the_call():
    tokenizer = fresh_tokenizer()
    reference = expected(tokenizer, TEXTS)
    tokenizer.backend_tokenizer.enable_truncation(max_length=4)
    assert _direct_backend(tokenizer) is None
    assert tokenize(tokenizer, TEXTS) == reference  # the call switched truncation off again
    tokenizer.backend_tokenizer.enable_padding(length=64)
    assert _direct_backend(tokenizer) is None
    assert tokenize(tokenizer, TEXTS) == reference


def test_a_class_with_its_own_encoding_path_keeps_it():
    class Custom(PreTrainedTokenizerFast):  # e.g. transformers' CodeLlama tokenizer overrides _encode_plus
        def _encode_plus(self, *args, **kwargs):
            return super()._encode_plus(*args, **kwargs)

    tokenizer = Custom(tokenizer_object=fresh_tokenizer().backend_tokenizer)
    assert _direct_backend(tokenizer) is None
    assert tokenize(tokenizer, TEXTS) == expected(tokenizer, TEXTS)


def test_split_special_tokens_is_honoured():
    tokenizer = fresh_tokenizer()
    tokenizer.split_special_tokens = True
    assert _direct_backend(tokenizer) is None  # the backend does not split them yet; the call will set it
    first = tokenize(tokenizer, TEXTS)
    assert _direct_backend(tokenizer) is not None
    assert tokenize(tokenizer, TEXTS) == first == expected(tokenizer, TEXTS)
    assert 3 < len(first[2])  # "<|im_start|>" was split into bytes


def test_the_last_answer_reuses_the_full_render():
    template = get_template("chatml")
    calls = []

    def render(part, add_generation_prompt, bos, eos):
        calls.append((len(part), add_generation_prompt))
        return template.render(part, None, add_generation_prompt, bos, eos)

    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    text, spans = assistant_spans(render, messages, "<s>", "<|im_end|>", "chatml")
    assert text[slice(*spans[0])] == "4<|im_end|>"
    assert calls == [(2, False), (2, False), (1, True)]  # the render, the marked render, the prompt


def test_batched_conversion_equals_per_row_conversion():
    rows = [
        {"instruction": "q1", "input": "x", "output": "a1"},
        {"instruction": "q2", "input": "", "output": "  "},  # an empty answer: kept, it trains the end-of-turn
        {"instruction": "q3", "input": "", "output": "a3", "system": "be brief"},
        {"instruction": "q4", "input": "y", "output": ""},
    ] * 3
    dataset = datasets.Dataset.from_list(rows)
    spec = DatasetSpec(name="d", columns={"system": "system"})
    converted, stats = to_canonical(dataset, spec)
    per_row = dataset.map(
        RowConverter(spec, dataset.column_names), with_indices=True, remove_columns=dataset.column_names,
        features=CANONICAL_FEATURES,
    )
    assert (stats.total_dropped, stats.empty_answers) == (0, 6)
    assert converted.features == per_row.features
    assert converted.to_list() == per_row.to_list()
