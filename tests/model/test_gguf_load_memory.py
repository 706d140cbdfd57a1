"""Loading a GGUF costs about its weights in memory (model/gguf_weights.py): peak RSS of a fresh process that loads
the file (bench/gguf_load_rss.py), against the bytes of the weights it loaded.

On a file written here the figure is what the load adds over the process's RSS before it (the imports' share would
drown a model this small); on the real Qwen2.5-Coder-0.5B file it is the whole peak, as the goal is stated.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from tests.real_assets import real
from tunelab.assets import TINY_MODEL_DIR
from tunelab.export.gguf_writer import write_gguf

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gguf_load_rss.py"


def load_rss(path: Path, dtype: str) -> dict:
    done = subprocess.run([sys.executable, str(BENCH), str(path), "--dtypes", dtype], capture_output=True, text=True,
                          timeout=1200, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_q8_0_gguf_loads_in_bf16_with_little_more_than_its_weights(tmp_path):
    # 114M parameters, untied: a 32,768-row embedding and output matrix (dequantized in chunks) and grouped-query
    # attention (q and k reordered whole by transformers' Llama processor)
    config = LlamaConfig.from_pretrained(TINY_MODEL_DIR)
    config.update({"vocab_size": 32768, "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 8,
                   "num_key_value_heads": 4, "head_dim": 128, "tie_word_embeddings": False})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = write_gguf(model, AutoTokenizer.from_pretrained(TINY_MODEL_DIR), None, None, tmp_path / "m.gguf", "q8_0")
    del model

    measured = load_rss(path, "bfloat16")
    assert measured["weights_mib"] == 218  # 114M parameters
    assert measured["added_over_weights"] <= 1.5, measured  # transformers' own loader: 3.2


@pytest.mark.slow
def test_real_qwen2_5_coder_0_5b_loads_within_1_5x_its_weights():
    measured = load_rss(real("qwen2.5-coder-0.5b"), "bfloat16")  # the harder of the two dtypes: smaller weights
    assert measured["weights_mib"] == 1202  # 630M parameters: the file's output matrix is its own (not tied)
    assert measured["peak_over_weights"] <= 1.5, measured  # transformers' own loader: 2.49
