"""Log-probs of the preference stages: batched pairs equal a direct per-sequence computation, the LoRA
reference (adapter disabled) equals the base model, precomputed reference log-probs equal on-the-fly ones,
and padding-free pair batches give the padded batches' log-probs, losses and gradients.

On the embedded tiny Llama (untrained for these tasks, which does not matter for equalities).
"""

from __future__ import annotations

import datasets
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from tunelab.assets import TINY_MODEL_DIR
from tunelab.config.args import DataArguments, FinetuningArguments, ModelArguments
from tunelab.config.training_args import TrainingArguments
from tunelab.data.collate import PackedCollator, PaddingFreeCollator, PairedCollator, build_paired_collator
from tunelab.data.encode import IGNORE_INDEX
from tunelab.data.formats import to_canonical
from tunelab.data.pairwise import PAIR_COLUMNS, preference_encoder
from tunelab.data.dataset_files import load_rows
from tunelab.data.registry import load_registry
from tunelab.data.templates import get_template
from tunelab.model.tokenizer import load_tokenizer
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


def base_model(attn: str = "sdpa"):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32, attn_implementation=attn)
    model.config.use_cache = False  # as load_model sets it for training
    return model.eval()


def lora_policy(attn: str = "sdpa"):
    """The tiny model with a LoRA adapter whose B matrices are non-zero, so the adapter changes outputs."""
    model = get_peft_model(base_model(attn), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
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


@pytest.mark.parametrize("cutoff_len, examples, dropped", [(64, 12, 0), (18, 4, 8), (16, 2, 10)])
def test_kto_counts_two_examples_per_pair_and_every_drop(tokenizer, cutoff_len, examples, dropped):
    """A pair gives a desirable and an undesirable example: examples + dropped = 2 per pair, exactly."""
    from tunelab.data.pipeline import encode_dataset  # noqa: PLC0415

    spec = load_registry()["demo_preference"]
    rows, _ = to_canonical(load_rows(spec).select(range(6)), spec)
    encoder = preference_encoder("kto", tokenizer, get_template("chatml", tokenizer), DataArguments(cutoff_len=cutoff_len))
    encoded, stats = encode_dataset(rows, encoder, "train", None)
    assert (stats.examples, stats.dropped_no_supervised) == (examples, dropped)
    assert encoded["kto_tag"][:2] == [True, False]


PADDING_FREE = PaddingFreeCollator(PackedCollator(0))


def test_padding_free_pair_layout():
    """The 2B sequences side by side (best-fit decreasing into rows of the longest); sequence_ids says
    which sequence (chosen 0..B-1, rejected B..2B-1) owns each position, -1 at padding."""
    rows = [
        {"chosen_input_ids": [5, 6, 7, 8], "chosen_labels": [-100, -100, 7, 8],
         "rejected_input_ids": [5, 9], "rejected_labels": [-100, 9], "ref_chosen_logps": -1.5},
        {"chosen_input_ids": [3, 4], "chosen_labels": [-100, 4],
         "rejected_input_ids": [3, 2, 1], "rejected_labels": [-100, 2, 1], "ref_chosen_logps": -2.5},
    ]
    batch = PairedCollator(0, padding_free=PADDING_FREE)(rows)  # lengths 4, 2 (chosen), 2, 3 (rejected); rows of 4
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [3, 2, 1, 0], [3, 4, 5, 9]]
    assert batch["labels"].tolist() == [[-100, -100, 7, 8], [-100, 2, 1, -100], [-100, 4, -100, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 1]]
    assert batch["sequence_ids"].tolist() == [[0, 0, 0, 0], [3, 3, 3, -1], [1, 1, 2, 2]]
    assert batch["ref_chosen_logps"].tolist() == [-1.5, -2.5]
    assert set(batch) == {"input_ids", "labels", "position_ids", "sequence_ids", "ref_chosen_logps"}
    varlen = PairedCollator(0, padding_free=PaddingFreeCollator(PackedCollator(0, "varlen")))(rows)
    assert varlen["sequence_ids"].tolist() == [[0, 0, 0, 0, 3, 3, 3, 1, 1, 2, 2]]
    assert varlen["cu_seq_lens_q"].tolist() == [0, 4, 7, 9, 11]

def mixed_lengths(pairs) -> list[dict]:
    """The pairs (25 to 37 tokens, prompts of 19 to 27), four with the start of their prompt cut off:
    sequences of 7 to 33 tokens, so that several share a padding-free row."""
    rows = list(pairs.select_columns(list(PAIR_COLUMNS)))
    for i, cut in ((1, 18), (2, 22), (3, 24), (5, 20)):
        rows[i] = {key: values[cut:] for key, values in rows[i].items()}
    return rows


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padding_free_pair_log_probs_equal_padded(pairs, attn):
    model = base_model(attn)
    rows = mixed_lengths(pairs)
    padded = PairedCollator(0)(rows)
    free = PairedCollator(0, padding_free=PADDING_FREE)(rows)
    assert free["input_ids"].shape[0] < padded["input_ids"].shape[0]
    with torch.no_grad():
        logps_p, counts_p = batch_log_probs(model, padded)
        logps_f, counts_f = batch_log_probs(model, free)
    assert counts_f.tolist() == counts_p.tolist()
    assert (logps_f - logps_p).abs().max() < 1e-4  # sums of ~10 float32 token log-probs


@pytest.mark.parametrize("stage, loss", [("dpo", "sigmoid"), ("dpo", "ipo"), ("dpo", "simpo"), ("kto", "kto")])
def test_padding_free_preference_step_equals_padded(pairs, tokenizer, tmp_path, stage, loss):
    """The trainer's loss (reference = the policy with its adapter disabled) and the LoRA gradients."""
    from tunelab.data.pairwise import KTO_COLUMNS  # noqa: PLC0415

    if stage == "kto":  # each pair as a desirable example (chosen) with its KL example (rejected)
        rows = [{"input_ids": r["chosen_input_ids"], "labels": r["chosen_labels"],
                 "kl_input_ids": r["rejected_input_ids"], "kl_labels": r["rejected_labels"], "kto_tag": i % 2 == 0}
                for i, r in enumerate(mixed_lengths(pairs))]
        assert set(rows[0]) == set(KTO_COLUMNS)
        prefixes = ("", "kl_")
    else:
        rows, prefixes = mixed_lengths(pairs), ("chosen_", "rejected_")
    finetuning = FinetuningArguments(stage=stage, **({} if stage == "kto" else {"pref_loss": loss}))
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, remove_unused_columns=False)

    def step(collator):
        policy = lora_policy()
        policy.train()
        trainer = PreferenceTrainer(stage=stage, finetuning=finetuning, model=policy, args=args,
                                    data_collator=collator, processing_class=tokenizer)
        loss_value = trainer.compute_loss(policy, collator(rows))
        loss_value.backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        return loss_value.item(), grads

    loss_p, grads_p = step(PairedCollator(0, *prefixes))
    loss_f, grads_f = step(PairedCollator(0, *prefixes, padding_free=PADDING_FREE))
    assert PairedCollator(0, *prefixes, padding_free=PADDING_FREE)(rows)["input_ids"].shape == (7, 33)  # padded: (12, 33)
    assert len(grads_f) == len(grads_p) == 16  # lora_A and lora_B of q_proj and v_proj in 4 layers
    assert loss_f == pytest.approx(loss_p, abs=1e-5)
    assert max((grads_f[n] - grads_p[n]).abs().max().item() for n in grads_p) < 1e-5


def test_pair_stages_pick_padding_free_where_the_model_supports_it():
    model = base_model()
    picked = build_paired_collator(model, 0, "chosen_", "rejected_", padding_free=None)
    assert picked == PairedCollator(0, "chosen_", "rejected_", padding_free=PADDING_FREE)
    assert build_paired_collator(model, 0, "", "kl_", padding_free=False) == PairedCollator(0, "", "kl_")


def test_precompute_on_flattened_varlen_pairs_equals_padded(pairs):
    """The flash-attention layout (every sequence in one row, with cu_seq_lens and int max lengths) through
    precompute: on CPU sdpa isolates the sequences of the one row from its restarting position ids."""
    rows = datasets.Dataset.from_list(mixed_lengths(pairs))
    policy = lora_policy()
    varlen = PairedCollator(0, padding_free=PaddingFreeCollator(PackedCollator(0, "varlen")))
    assert varlen(list(rows))["input_ids"].shape[0] == 1 and isinstance(varlen(list(rows))["max_length_q"], int)
    columns, cpu = PAIR_REFERENCE_COLUMNS, torch.device("cpu")
    flattened = precompute_reference_log_probs(rows, policy, None, varlen, columns, batch_size=3, device=cpu)
    padded = precompute_reference_log_probs(rows, policy, None, PairedCollator(0), columns, batch_size=3, device=cpu)
    for column in columns:
        assert flattened[column] == pytest.approx(padded[column], abs=1e-4)
