"""Shared fixtures: tiny random models saved as local Hugging Face folders (built once per session, in seconds).

Dimensions are small but keep bitsandbytes' 4-bit constraints (rows a multiple of 32, 64-element blocks).
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.precisions import PRECISION_ENV, PRECISIONS, precision_env
from tunelab.config.precision import CPU_BF16_ENV

# What bf16 / fp16 auto choose is pinned for the whole suite, whatever this CPU has (config/precision.py): the fp32
# path, in this process and the `tunelab` processes tests start. A test that takes the `precision` fixture runs
# once per path, so both run on every machine (tests/precisions.py).
os.environ.update(precision_env("fp32"))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest workers on the machine's cores: one torch thread each (and in the processes they
    # start), instead of two threads per worker fighting over two cores.
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
# DeepSpeed JIT-compiles its CPU shared-memory op (tests/train/test_deepspeed.py; about 80 s on 2 cores) into
# torch's extensions folder, keyed by name only: two checkouts with their own venvs rebuilt each other's copy on
# every run. One folder per venv keeps each built once.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


@pytest.fixture(params=PRECISIONS)
def precision(request, monkeypatch) -> str:
    """'fp32' or 'bf16': what bf16 auto chooses in this test (and the processes it starts), as on a CPU without or
    with native bf16. On a CPU without it the bf16 variant runs slower, not differently."""
    monkeypatch.setenv(CPU_BF16_ENV, PRECISION_ENV[request.param])
    return request.param


def _save_tiny_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    # Word-level vocabulary "<unk> <s> </s> w0 w1 ...": text "w5 w17" tokenises to ids we can predict in tests.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i + 3 for i in range(vocab_size - 3)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """LlamaForCausalLM: vocab 256, hidden 64, intermediate 128, 2 layers, 4 heads / 2 KV heads, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    _save_tiny_tokenizer(folder, config.vocab_size)
    return folder


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """Qwen2ForCausalLM: like tiny_llama_dir but 3 layers, q/k/v biases and the head tied to the embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: PLC0415

    folder = tmp_path_factory.mktemp("tiny-qwen2")
    config = Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    _save_tiny_tokenizer(folder, config.vocab_size)
    return folder


@pytest.fixture(autouse=True, scope="session")
def isolated_tokenized_cache(tmp_path_factory):
    """Runs in tests write their tokenized cache into a fresh folder, never the user's ~/.cache."""
    import os  # noqa: PLC0415

    folder = tmp_path_factory.mktemp("tokenized-cache")
    previous = os.environ.get("TUNELAB_CACHE")
    os.environ["TUNELAB_CACHE"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("TUNELAB_CACHE", None)
    else:
        os.environ["TUNELAB_CACHE"] = previous


@pytest.hookimpl(trylast=True)  # after `-m` has deselected
def pytest_collection_modifyitems(config, items):
    """Files holding an end-to-end (`slow`) test run first, the files of quick tests after them. `make test`'s
    workers take whole files in this order (--no-loadscope-reorder; xdist's own order, most tests first, puts the
    long files of few tests last, where one worker runs them alone while the other has finished): the many short
    files at the end even the workers out."""
    long_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in long_files)  # stable: each group keeps its collection order


def pytest_collection_finish(session):
    """Every test module is imported: what exists now (torch, transformers, the tests' own objects) lives until the
    end. gc.freeze() keeps the collector from walking it again: each Trainer.train runs a full gc.collect (accelerate's
    free_memory), and the heap of half a million objects made each such walk cost ~0.4 s. Measured on three files of
    short training runs (2-core AVX2 EPYC, one process): gen-2 collections 17.6 s -> 5.3 s, the files 74.7 -> 69.0 s."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    """scripts/record_golden_renders.py: write the official renders this session recorded (tests/official.py)."""
    from tests import official  # noqa: PLC0415

    if official.RECORDING and exitstatus == 0:
        official.write_recording()


@pytest.fixture(scope="session")
def tiny_vlm_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny random vision-language model folders (model + processor) by family: llava, gemma3 (tests/vision_models.py)."""
    from tests.vision_models import build_gemma3, build_llava  # noqa: PLC0415

    return {name: build(tmp_path_factory.mktemp(name)) for name, build in (("llava", build_llava), ("gemma3", build_gemma3))}
