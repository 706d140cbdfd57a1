"""Fixtures of the serving tests (tunelab chat / api and their engine); the helpers are in chat_helpers.py."""

from __future__ import annotations

import pytest
import torch

from tests.infer.chat_helpers import ChatModel, Reference, build_chat_model


@pytest.fixture
def one_torch_thread():
    """One intra-op thread, as the server and chat subprocesses get (OMP_NUM_THREADS=1): identical kernels,
    so greedy and seeded decodes compare exactly; and far faster than two threads on shared, busy cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> ChatModel:
    return build_chat_model(tmp_path_factory.mktemp("chat-model"))


@pytest.fixture(scope="session")
def reference(chat_model) -> Reference:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return Reference(chat_model.adapter)
    finally:
        torch.set_num_threads(threads)
