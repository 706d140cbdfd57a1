"""GRPO scores a batch's completions in the background while the next batch of the round generates
(train/rl/grpo.py): the order is proved by events, and the results equal those of scoring in the foreground."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tunelab.cli import main
from tunelab.run_folder import read_log
from tunelab.train.rl import grpo as grpo_module
from tunelab.train.rl import rewards as rewards_module

WAIT_S = 10.0  # far longer than one generation of the tiny model; reached only when the order is wrong

USER_REWARDS = """
def spread(prompts, completions, references):  # scores that differ within each group: advantages are not 0
    return [(i % 3 + sum(map(ord, c)) % 5) / 7 for i, c in enumerate(completions)]
"""


def _config(tmp_path, name: str, reward_funcs: str, **overrides) -> str:
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({
        "model_name_or_path": "tiny", "stage": "grpo", "finetuning_type": "full", "template": "chatml",
        "dataset": "demo_sort", "max_samples": 8, "cutoff_len": 64, "max_new_tokens": 6,
        "reward_funcs": reward_funcs, "num_generations": 2, "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2, "max_steps": 2, "logging_steps": 1, "learning_rate": 1e-3, "seed": 0,
        "disable_tqdm": True, "plot_loss": False, "output_dir": str(tmp_path / name), **overrides,
    }))
    return str(config)


@pytest.mark.slow  # a GRPO run: over 2 s on the 2-core AVX2 reference
def test_a_batch_is_scored_while_the_next_batch_of_the_round_generates(tmp_path, monkeypatch):
    """The first batch's reward waits for the second batch's generation to begin: scoring after generation (the
    sequential order) would never see it begin and fails after WAIT_S."""
    events: list[str] = []
    second_generation = threading.Event()
    generate = grpo_module.generate_rollout

    def counted_generate(*args, **kwargs):
        events.append("generate")
        if events.count("generate") % 2 == 0:  # the second batch of a round (gradient_accumulation_steps 2)
            second_generation.set()
        return generate(*args, **kwargs)

    def waits_for_the_next_batch(prompts, completions, references):
        events.append("score")
        if events.count("score") == 1:
            assert second_generation.wait(WAIT_S), "the first batch was scored before the second one generated"
            events.append("first batch scored")
        return [float(len(c) % 2) for c in completions]

    monkeypatch.setattr(grpo_module, "generate_rollout", counted_generate)
    monkeypatch.setitem(rewards_module.BUILTIN_REWARDS, "waits_for_the_next_batch", waits_for_the_next_batch)
    assert main(["train", _config(tmp_path, "overlap", "waits_for_the_next_batch", max_steps=1)]) == 0
    assert events.index("generate", 1) < events.index("first batch scored")
    assert events.count("generate") == events.count("score") == 2
    assert len(read_log(tmp_path / "overlap")) == 1


@pytest.mark.slow
def test_a_batch_is_scored_while_its_reference_log_probs_are_computed(tmp_path, monkeypatch):
    """A round of one batch: its reward waits for the batch's reference forward to begin, which the old order (the
    log-probs after the scores) never reached."""
    reference_forward = threading.Event()
    reference_log_probs = grpo_module.reference_log_probs

    def signalled_reference_log_probs(*args, **kwargs):
        reference_forward.set()
        return reference_log_probs(*args, **kwargs)

    def waits_for_the_reference_forward(prompts, completions, references):
        assert reference_forward.wait(WAIT_S), "the batch was scored before its reference log-probs began"
        return [0.0] * len(completions)

    monkeypatch.setattr(grpo_module, "reference_log_probs", signalled_reference_log_probs)
    monkeypatch.setitem(rewards_module.BUILTIN_REWARDS, "waits_for_the_reference_forward",
                        waits_for_the_reference_forward)
    config = _config(tmp_path, "one_batch", "waits_for_the_reference_forward", gradient_accumulation_steps=1,
                     kl_coef=0.05, max_steps=1)
    assert main(["train", config]) == 0
    assert len(read_log(tmp_path / "one_batch")) == 1


def _log_and_weights(out) -> tuple[list[dict], dict]:
    records = [{k: v for k, v in record.items() if "second" not in k and "memory" not in k}  # times and memory differ
               for record in read_log(out)]
    return records, load_file(out / "model.safetensors")


@pytest.mark.slow
def test_scoring_in_the_background_changes_no_reward_loss_or_weight(sft_model_dir, tmp_path, monkeypatch):
    """The same run with each batch's scoring forced to end before the next batch generates (the sequential
    order): every logged value, executed-code counts included, and every final weight are equal."""
    # The SFT'd tiny model (conftest.py): the untrained one samples the same tokens in every row, and equal rows
    # of one group cancel each other's gradients.
    overrides = {"model_name_or_path": str(sft_model_dir), "dataset": "demo_code", "max_samples": 16,
                 "cutoff_len": 128, "kl_coef": 0.05, "num_iterations": 2, "max_steps": 4,
                 "mask_truncated_completions": False}  # answers cut at max_new_tokens train too
    reward_funcs = "code_tests,user_rewards.py:spread"
    assert main(["train", _config(tmp_path, "background", reward_funcs, **overrides)]) == 0
    start = grpo_module.GRPO.start_rollout

    def scored_before_the_next_generation(self, rows):
        started = start(self, rows)
        started.scores.result()
        return started

    monkeypatch.setattr(grpo_module.GRPO, "start_rollout", scored_before_the_next_generation)
    assert main(["train", _config(tmp_path, "foreground", reward_funcs, **overrides)]) == 0
    (background, background_weights), (foreground, foreground_weights) = (
        _log_and_weights(tmp_path / "background"), _log_and_weights(tmp_path / "foreground"))
    assert [r["step"] for r in background] == [1, 2, 3, 4]
    rollouts = background[0::2]  # num_iterations 2: each round of rollouts is logged at its first step
    assert all(r["reward/code_tests/runs"] == 4.0 for r in rollouts)  # per batch: 2 prompts × 2 completions
    assert all(r["reward_std"] > 0 and r["grad_norm"] > 0 for r in rollouts)  # the rewards vary: a real comparison
    assert background == foreground
    assert background_weights.keys() == foreground_weights.keys()
    assert all(torch.equal(background_weights[k], foreground_weights[k]) for k in background_weights)


@pytest.mark.slow  # a GRPO run: over 2 s on the 2-core AVX2 reference
def test_a_reward_function_that_raises_ends_the_run_with_its_one_line_error(tmp_path, capsys):
    (tmp_path / "strict_rewards.py").write_text(
        "from tunelab.errors import DataError\n\n"
        "def strict(prompts, completions, references):\n"
        "    raise DataError('strict: a reference answer is empty; give every row an answer')\n"
    )
    config = _config(tmp_path, "raises", "strict_rewards.py:strict")
    capsys.readouterr()
    assert main(["train", config]) == 2
    assert capsys.readouterr().err.splitlines()[-1:] == [
        "tunelab: error: strict: a reference answer is empty; give every row an answer"]
    assert not (tmp_path / "raises" / "model.safetensors").exists()


@pytest.mark.slow  # a GRPO run: over 2 s on the 2-core AVX2 reference
def test_a_reward_with_a_signal_timeout_is_one_line_naming_it_and_the_fix(tmp_path, capsys):
    """Rewards are scored off the main thread, where Python refuses signal.signal: math_verify's default timeout
    (signal.alarm) raised a bare ValueError from deep in the scoring thread; it is one line naming the function."""
    (tmp_path / "alarm_rewards.py").write_text(
        "import signal\n\n"
        "def timed(prompts, completions, references):\n"
        "    signal.signal(signal.SIGALRM, lambda *_: None)\n"
        "    return [0.0] * len(completions)\n"
    )
    capsys.readouterr()
    assert main(["train", _config(tmp_path, "alarm", "alarm_rewards.py:timed", max_steps=1)]) == 2
    (line,) = capsys.readouterr().err.splitlines()[-1:]
    assert line.startswith("tunelab: error: reward_funcs: 'alarm_rewards.py:timed' sets a signal handler"), line
    assert "parsing_timeout=None" in line and "timeout_seconds=None" in line


def _scoring_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("reward-scoring")]


@pytest.mark.slow  # two GRPO runs: over 2 s on the 2-core AVX2 reference
def test_the_scoring_thread_ends_with_the_run_whether_it_finishes_or_fails(tmp_path, monkeypatch):
    """Each GRPO object starts one scoring thread. The run shuts it down: held alive by whoever keeps the object
    (here this test, as the web UI or a notebook might), an idle thread per run would pile up."""
    kept: list[ThreadPoolExecutor] = []

    def kept_executor(*args, **kwargs):
        kept.append(ThreadPoolExecutor(*args, **kwargs))
        return kept[-1]

    monkeypatch.setattr(grpo_module, "ThreadPoolExecutor", kept_executor)
    before = set(_scoring_threads())
    assert main(["train", _config(tmp_path, "ends", "user_rewards.py:spread", max_steps=1)]) == 0
    (tmp_path / "failing_rewards.py").write_text("def fail(prompts, completions, references):\n"
                                                 "    raise OSError(\"a reward's own bug\")\n")
    with pytest.raises(OSError, match="a reward's own bug"):  # not a tunelab error: it reaches the caller whole
        main(["train", _config(tmp_path, "fails", "failing_rewards.py:fail", max_steps=1)])
    assert len(kept) == 2
    for thread in set(_scoring_threads()) - before:
        thread.join(timeout=WAIT_S)
    assert set(_scoring_threads()) - before == set()
