"""Fixtures for the export tests: the embedded tiny model as trained, and GGUF files written from it once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tunelab.assets import TINY_MODEL_DIR
from tunelab.export.gguf_writer import write_gguf


@dataclass
class Trained:
    model: Any
    tokenizer: Any
    chat_template: str


@pytest.fixture(scope="session")
def tiny() -> Trained:
    """The embedded tiny Llama in float32 with its own (ChatML) chat template: the model as trained."""
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    return Trained(model, tokenizer, tokenizer.chat_template)


@pytest.fixture(scope="session")
def tiny_gguf(tiny, tmp_path_factory):
    """tiny_gguf(tensor_type) -> the tiny model's GGUF of that type, written once per session."""
    folder = tmp_path_factory.mktemp("tiny-gguf")
    written: dict[str, Path] = {}

    def get(tensor_type: str) -> Path:
        if tensor_type not in written:
            written[tensor_type] = write_gguf(tiny.model, tiny.tokenizer, tiny.chat_template, None,
                                              folder / f"tiny-{tensor_type}.gguf", tensor_type)
        return written[tensor_type]

    return get


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The tiny model's forward passes are too small to gain from threads; on a busy 2-core machine a second thread
    only waits (a parity check: 2 s with one thread, 14 s with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
