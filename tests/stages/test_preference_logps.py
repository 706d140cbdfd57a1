"""Log-probs of the preference stages: batched pairs equal a direct per-sequence computation, the LoRA
reference (adapter disabled) equals the base model, precomputed reference log-probs equal on-the-fly ones.

On the embedded tiny Llama (untrained for these tasks, which does not matter for equalities).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from tunelab.assets import TINY_MODEL_DIR
from tunelab.config.args import DataArguments, FinetuningArguments, ModelArguments, TrainingArguments
from tunelab.data.collate import PairedCollator
from tunelab.data.encode import IGNORE_INDEX
from tunelab.data.formats import to_canonical
from tunelab.data.pairwise import PAIR_COLUMNS, preference_encoder
from tunelab.data.registry import load_registry, load_rows
from tunelab.data.templates import get_template
from tunelab.model.load import load_tokenizer
from tunelab.train.preference_trainer import (
    PAIR_REFERENCE_COLUMNS, PreferenceTrainer, batch_log_probs, precompute_reference_log_probs, reference_view,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelArguments(model_name_or_path="tiny"))


@pytest.fixture(scope="module")
def pairs(tokenizer):
    """Six encoded demo_preference pairs (chatml, cutoff 64)."""
    spec = load_registry()["demo_preference"]
    rows, _ = to_canonical(load_rows(spec).select(range(6)), spec)
    encoder = preference_encoder("dpo", tokenizer, get_template("chatml", tokenizer), DataArguments(cutoff_len=64))
    encoded = rows.map(encoder, batched=True, remove_columns=rows.column_names)
    assert len(encoded) == len(rows)  # nothing truncated away
    return encoded.add_column("chosen", list(rows["chosen"])).add_column("rejected", list(rows["rejected"]))


def batch_of(pairs):
    return PairedCollator(0)(list(pairs.select_columns(list(PAIR_COLUMNS))))


def base_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()


def lora_policy():
    """The tiny model with a LoRA adapter whose B matrices are non-zero, so the adapter changes outputs."""
    model = get_peft_model(base_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.5)
    return model.eval()


def direct_log_prob(model, input_ids: list[int], labels: list[int]) -> float:
    """Sum of log p(label t | tokens < t) over supervised t, one unpadded sequence at a time."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([input_ids])).logits[0].double()
    logps = logits.log_softmax(-1)
    return sum(logps[t - 1, labels[t]].item() for t in range(1, len(labels)) if labels[t] != IGNORE_INDEX)


def test_pair_encoding_supervises_only_the_answer(pairs, tokenizer):
    row = pairs[0]
    for side in ("chosen", "rejected"):
        ids, labels = row[f"{side}_input_ids"], row[f"{side}_labels"]
        supervised = [i for i, label in zip(ids, labels) if label != IGNORE_INDEX]
        assert tokenizer.decode(supervised) == f"{row[side]}<|im_end|>"
    # the prompts are identical token for token; only the answers differ
    chosen_prompt = [i for i, l in zip(row["chosen_input_ids"], row["chosen_labels"]) if l == IGNORE_INDEX]
    assert chosen_prompt[: len(chosen_prompt) - 1] == row["rejected_input_ids"][: len(chosen_prompt) - 1]


def test_batched_pair_log_probs_equal_per_sequence(pairs, tokenizer):
    model = base_model()
    batch = batch_of(pairs)
    assert batch["input_ids"].shape[0] == 2 * len(pairs)
    with torch.no_grad():
        logps, counts = batch_log_probs(model, batch)
    expected = [direct_log_prob(model, r[f"{s}_input_ids"], r[f"{s}_labels"]) for s in ("chosen", "rejected") for r in pairs]
    assert logps.tolist() == pytest.approx(expected, abs=1e-4)  # float32 logits summed over ~10 tokens
    assert counts.tolist() == [sum(1 for l in r[f"{s}_labels"][1:] if l != IGNORE_INDEX) for s in ("chosen", "rejected") for r in pairs]


def test_lora_reference_is_the_base_model(pairs, tokenizer):
    batch = batch_of(pairs)
    policy, base = lora_policy(), base_model()
    with torch.no_grad():
        with reference_view(policy, None) as reference:
            disabled, _ = batch_log_probs(reference, batch)
        base_logps, _ = batch_log_probs(base, batch)
        enabled, _ = batch_log_probs(policy, batch)
    assert torch.equal(disabled, base_logps)
    assert (enabled - base_logps).abs().max() > 0.1  # the adapter is active outside the context


def test_precomputed_reference_equals_on_the_fly(pairs, tokenizer, tmp_path):
    collator = PairedCollator(tokenizer.pad_token_id)
    policy = lora_policy()
    pairs = pairs.select_columns(list(PAIR_COLUMNS))
    precomputed = precompute_reference_log_probs(
        pairs, policy, None, collator, PAIR_REFERENCE_COLUMNS, batch_size=4, device=torch.device("cpu")
    )
    on_the_fly = PairedCollator(tokenizer.pad_token_id)(list(pairs))
    with torch.no_grad(), reference_view(policy, None) as reference:
        expected, _ = batch_log_probs(reference, on_the_fly)
    stored = list(precomputed[PAIR_REFERENCE_COLUMNS[0]]) + list(precomputed[PAIR_REFERENCE_COLUMNS[1]])
    assert stored == pytest.approx(expected.tolist(), abs=1e-5)

    # the trainer's loss is the same with the stored columns as with a reference forward pass
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, remove_unused_columns=False)
    trainer = PreferenceTrainer(
        stage="dpo", finetuning=FinetuningArguments(stage="dpo"), model=policy, args=args, data_collator=collator,
        processing_class=tokenizer,
    )
    policy.eval()
    with torch.no_grad():
        loss_fly = trainer.compute_loss(policy, on_the_fly)
        loss_stored = trainer.compute_loss(policy, collator(list(precomputed)))
    assert loss_stored.item() == pytest.approx(loss_fly.item(), abs=1e-6)
    assert loss_fly.item() != pytest.approx(0.6931471805599453, abs=1e-3)  # the policy differs from its reference


@pytest.mark.parametrize("cutoff_len, examples, dropped", [(64, 12, 0), (24, 8, 4), (20, 2, 10)])
def test_kto_counts_two_examples_per_pair_and_every_drop(tokenizer, cutoff_len, examples, dropped):
    """A pair gives a desirable and an undesirable example: examples + dropped = 2 per pair, exactly."""
    from tunelab.data.pipeline import encode_dataset  # noqa: PLC0415

    spec = load_registry()["demo_preference"]
    rows, _ = to_canonical(load_rows(spec).select(range(6)), spec)
    encoder = preference_encoder("kto", tokenizer, get_template("chatml", tokenizer), DataArguments(cutoff_len=cutoff_len))
    encoded, stats = encode_dataset(rows, encoder, "train", None)
    assert (stats.examples, stats.dropped_no_supervised) == (examples, dropped)
    assert encoded["kto_tag"][:2] == [True, False]
