"""Stage pt with packing: documents chunked at cutoff_len and packed in isolation train exactly like
each chunk on its own row (loss and gradients within 1e-5, fp32)."""

from __future__ import annotations

import datasets
import pytest
import torch
import yaml

from tunelab.preflight import load_config
from tunelab.data.collate import PackedCollator, SupervisedCollator
from tunelab.data.packing import pack_dataset
from tunelab.data.pretrain import document_chunks
from tunelab.errors import ConfigError
from tunelab.train.losses import causal_lm_loss


def test_document_chunks_cut_each_document_separately():
    docs = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5, 9], [6, 7, 9]], "num_tokens": [5, 2]})
    chunks = document_chunks(docs, cutoff_len=4)
    assert chunks["input_ids"] == [[1, 2, 3, 4], [5, 9], [6, 7, 9]]
    assert chunks["labels"] == chunks["input_ids"]


def test_packed_pretraining_equals_one_chunk_per_row(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="sdpa").float()
    model.config.use_cache = False
    g = torch.Generator().manual_seed(0)
    lengths = [9, 30, 4, 17, 25, 12]
    docs = datasets.Dataset.from_dict({
        "input_ids": [torch.randint(3, 200, (n,), generator=g).tolist() + [2] for n in lengths],
        "num_tokens": lengths,
    })
    chunks = document_chunks(docs, cutoff_len=16)
    packed, stats = pack_dataset(chunks, cutoff_len=16)
    assert stats.rows < len(chunks)

    def loss_and_grads(batch):
        model.zero_grad()
        labels = batch.pop("labels")
        loss = causal_lm_loss(model(**batch).logits, labels)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = SupervisedCollator(pad_token_id=0)([dict(r) for r in chunks])
    loss_plain, grads_plain = loss_and_grads(plain)
    rows = PackedCollator.for_model(model, pad_token_id=0)([dict(r) for r in packed])
    assert "attention_mask" not in rows
    loss_packed, grads_packed = loss_and_grads(rows)
    assert loss_packed == pytest.approx(loss_plain, abs=1e-5)
    assert max((grads_plain[n] - grads_packed[n]).abs().max().item() for n in grads_plain) < 1e-5


def test_stride_with_packing_is_refused(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"stage": "pt", "dataset": "demo_corpus", "packing": True, "stride": 8,
                                    "cutoff_len": 16, "output_dir": str(tmp_path / "o")}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        "stride and tail shape concatenated windows; with packing: true each document is cut at cutoff_len "
        "and packed in isolation: remove stride/tail or packing"
    )
