"""bench/peers/probe.py's operator count (`bench/run.py --count-ops`): what it reports as dispatched operators and
host-device syncs is what the profiled code did."""

import importlib.util
import json
import shutil

import pytest
import torch

from tests.fixture_paths import REPO_ROOT


def load_probe():
    spec = importlib.util.spec_from_file_location("bench_probe", REPO_ROOT / "bench" / "peers" / "probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # BENCH_PROBE_OUT is unset: its events go nowhere
    return module


def test_boolean_indexing_and_scalar_reads_count_as_syncs():
    probe = load_probe()
    x = torch.arange(6.0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        kept = x[x > 2]  # gt, then index with a bool mask: nonzero inside it
        total = float(kept.sum())  # sum, then _local_scalar_dense
        torch.mul(x, 2)
    counts = probe.operator_counts(profile)
    assert total == 12.0
    assert counts["sync_ops"] == {"aten::nonzero": 1, "aten::_local_scalar_dense": 1}
    assert counts["syncs"] == 2
    assert dict(counts["top"]) == {"aten::gt": 1, "aten::index": 1, "aten::sum": 1, "aten::item": 1, "aten::mul": 1}
    assert counts["operators"] == 5
    assert counts["all_operators"] > counts["operators"]  # nonzero and _local_scalar_dense run nested
    assert "kernels" not in counts  # no device events on a CPU


def test_an_index_built_on_the_host_needs_no_sync():
    probe = load_probe()
    x = torch.arange(6.0)
    index = torch.tensor([3, 4, 5])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        x.index_select(0, index).sum()
    counts = probe.operator_counts(profile)
    assert counts["syncs"] == 0 and counts["sync_ops"] == {}
    assert dict(counts["top"]) == {"aten::index_select": 1, "aten::sum": 1}


def test_heldout_scores_each_answer_from_logits_over_the_answer_only(tmp_path):
    """Row by row with `logits_to_keep` (so the probe adds little to a tool's peak RSS): the same accuracy and loss
    as full-length logits, over the answer tokens up to the end-of-turn token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tmp_path / "model"  # the embedded model, whose generation config also stops at <|im_end|>
    shutil.copytree(REPO_ROOT / "src" / "tunelab" / "assets" / "tiny-llama", model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, end_of_turn]}))
    rows = [{"prompt": [{"role": "user", "content": question}], "completion": [{"role": "assistant", "content": answer}]}
            for question, answer in [("Sort 2 0 3", "0 2 3"), ("Name a colour of the sky at noon", "blue"),
                                     ("Count to five", "1 2 3 4 5")]]
    (tmp_path / "heldout.json").write_text(json.dumps(rows))
    heldout = load_probe().HeldOut(str(tmp_path / "heldout.json"), str(model_dir), every=1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    result = heldout.evaluate(model, bf16=False)

    correct, nll, total = 0, 0.0, 0
    for (ids, answer_from), row in zip(heldout.rows, rows):
        assert ids[-1] == end_of_turn  # cut there: the template's newline after it is not scored
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
        assert answer_from == len(prompt)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
        predicted, targets = logits[answer_from - 1 : -1], torch.tensor(ids[answer_from:])
        correct += int((predicted.argmax(-1) == targets).sum())
        nll += float(torch.nn.functional.cross_entropy(predicted, targets, reduction="sum"))
        total += len(targets)
    assert result["tokens"] == total
    assert result["accuracy"] == correct / total
    assert result["loss"] == pytest.approx(nll / total, rel=1e-5)
    assert model.training is False  # the model came in eval mode and is left so


def outer_sum(x):
    return float(x[x > 2].sum())


def test_with_stacks_each_sync_is_traced_to_the_python_line_that_made_it():
    probe = load_probe()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as profile:
        outer_sum(torch.arange(6.0))
    sites = probe.operator_counts(profile, with_stack=True)["sync_sites"]
    assert sorted(sites.values()) == [1, 1]
    assert {site.split(" @ ")[0] for site in sites} == {"aten::nonzero", "aten::_local_scalar_dense"}
    assert all(" @ " in site and "test_bench_probe.py" in site.split(" @ ")[1].split(" < ")[0] for site in sites)
    assert all("outer_sum" in site for site in sites)
    # and none without stacks
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as plain:
        outer_sum(torch.arange(6.0))
    assert "sync_sites" not in probe.operator_counts(plain)
