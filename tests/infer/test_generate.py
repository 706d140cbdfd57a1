"""The reference answer exact match compares with: a ranking row's chosen answer, else the last assistant turn."""

from __future__ import annotations

import datasets
from transformers import AutoModelForCausalLM, AutoTokenizer

from tunelab.assets import TINY_MODEL_DIR
from tunelab.config.args import GenerationArguments
from tunelab.data.templates import get_template
from tunelab.infer.generate import generate_predictions, held_out_rows

QUESTION = {"role": "user", "content": "Sort the numbers:\n3 1 2"}


def _rows() -> datasets.Dataset:
    return datasets.Dataset.from_list([
        {"messages": [QUESTION, {"role": "assistant", "content": "1 2 3"}], "system": "", "chosen": "", "rejected": ""},
        {"messages": [QUESTION], "system": "", "chosen": "1 2 3", "rejected": "2 1 3"},
        {"messages": [QUESTION], "system": "", "chosen": "", "rejected": ""},
    ])


def test_ranking_rows_are_scored_against_their_chosen_answer():
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
    template = get_template("chatml", tokenizer)
    supervised, ranking, bare = generate_predictions(model, tokenizer, template, _rows(), max_new_tokens=4)
    expected_prompt = "<|im_start|>user\nSort the numbers:\n3 1 2<|im_end|>\n<|im_start|>assistant\n"
    assert [p.prompt for p in (supervised, ranking, bare)] == [expected_prompt] * 3
    assert [p.reference for p in (supervised, ranking, bare)] == ["1 2 3", "1 2 3", ""]
    assert supervised.prediction == ranking.prediction == bare.prediction


def _config(eval_generation: bool, samples: int) -> GenerationArguments:
    return GenerationArguments(eval_generation=eval_generation, eval_generation_samples=samples)


def test_held_out_rows_are_the_first_rows_of_the_first_eval_set():
    first, second = _rows(), _rows().select([2])
    assert held_out_rows({}, _config(True, 10)) is None
    assert held_out_rows({"a": first}, _config(False, 10)) is None
    assert held_out_rows({"a": first, "b": second}, _config(True, 2))["chosen"] == ["", "1 2 3"]
    assert len(held_out_rows({"a": first}, _config(True, 10))) == 3


def test_generation_during_training_adds_only_the_kv_cache_and_the_last_positions_logits():
    # as training leaves the model: a LoRA wrapper in train mode, config.use_cache off (model/load.py)
    from peft import LoraConfig, get_peft_model

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
    base.config.use_cache = False
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear")).train()
    heads, bodies = [], []
    base.lm_head.register_forward_hook(lambda module, args, out: heads.append(tuple(out.shape)))
    base.model.embed_tokens.register_forward_hook(lambda module, args, out: bodies.append(args[0].shape[1]))
    rows = datasets.Dataset.from_list([_rows()[0], {**_rows()[0], "messages": [{"role": "user", "content": "Hi"}]}])
    generate_predictions(model, tokenizer, get_template("chatml", tokenizer), rows, max_new_tokens=3)
    # full-vocabulary logits of one position per row and step (never of every prompt position), and a prompt read
    # once: each later step runs one new token through the model (the KV cache)
    assert heads == [(2, 1, len(tokenizer))] * 3
    assert bodies[1:] == [1, 1] and bodies[0] > 10
    assert model.training  # handed back as it came
