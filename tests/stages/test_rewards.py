"""GRPO reward functions: the built-ins on hand-checked completions, loading the user's own, and their errors."""

from __future__ import annotations

import textwrap

import pytest

from tunelab.errors import ConfigError
from tunelab.train.rl.rewards import (
    answer_shape,
    exact_match_reward,
    format_reward,
    item_match_reward,
    load_reward_functions,
    score_completions,
)

PROMPTS = ["p"] * 5
REFERENCES = ["1 2 3", "1 2 3", "1 2 3", "c,b,a", "42"]
COMPLETIONS = ["1 2 3", " 1 2 3\n", "3 2 1", "c,b", "41"]
FINISHED = [True, True, True, True, False]


def test_exact_match_reward_ignores_surrounding_whitespace_only():
    assert exact_match_reward(PROMPTS, COMPLETIONS, REFERENCES) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_answer_shape():
    assert answer_shape("3 1 2") == answer_shape("1 2 3") == "0 0 0"
    assert answer_shape(" c,b,a ") == "a,a,a"
    assert answer_shape("41") == "00"


def test_format_reward_needs_the_reference_shape_and_the_end_of_turn():
    # "3 2 1": right shape, wrong order → still 1; "c,b": one letter short → 0; "41": cut off → 0.
    assert format_reward(PROMPTS, COMPLETIONS, REFERENCES, FINISHED) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_item_match_reward_gives_partial_credit_per_position():
    # "3 2 1" against "1 2 3": the middle item only; "c,b" against "c,b,a": 2 of the longer 3; "41": 0 of 1.
    assert item_match_reward(PROMPTS, COMPLETIONS, REFERENCES) == [1.0, 1.0, 1 / 3, 2 / 3, 0.0]
    assert item_match_reward(["p"] * 3, ["1 3 2", "1 2 3 4", ""], ["1 2 3", "1 2 3", "1 2 3"]) == [1 / 3, 0.75, 0.0]


def test_weighted_sum_of_reward_functions():
    functions = load_reward_functions(["exact_match", "format"], [2.0, 0.5])
    totals, per_function = score_completions(functions, PROMPTS, COMPLETIONS, REFERENCES, FINISHED)
    assert per_function == {"exact_match": [1.0, 1.0, 0.0, 0.0, 0.0], "format": [1.0, 1.0, 1.0, 0.0, 0.0]}
    assert totals == [2.5, 2.5, 0.5, 0.0, 0.0]


USER_REWARDS = textwrap.dedent('''
    def length(prompts, completions, references):
        return [float(len(c)) for c in completions]

    def finished_bonus(prompts, completions, references, **info):
        return [3.0 if done else 0.0 for done in info["finished"]]

    not_a_function = 3
''')


def test_user_reward_function_from_a_file(tmp_path):
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    functions = load_reward_functions([f"{tmp_path}/my_rewards.py:length", f"{tmp_path}/my_rewards.py:finished_bonus"])
    totals, per_function = score_completions(functions, PROMPTS, COMPLETIONS, REFERENCES, FINISHED)
    assert per_function[f"{tmp_path}/my_rewards.py:length"] == [5.0, 7.0, 5.0, 3.0, 2.0]
    assert per_function[f"{tmp_path}/my_rewards.py:finished_bonus"] == [3.0, 3.0, 3.0, 3.0, 0.0]
    assert totals == [8.0, 10.0, 8.0, 6.0, 2.0]


def test_user_reward_file_relative_to_the_config_folder(tmp_path):
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    (function,) = load_reward_functions(["my_rewards.py:length"], base_dir=tmp_path)
    assert function(["p"], ["abc"], ["x"], [True]) == [3.0]


def test_user_reward_function_from_a_module(tmp_path, monkeypatch):
    package = tmp_path / "grpo_user_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scoring.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    (function,) = load_reward_functions(["grpo_user_pkg.scoring:length"])
    assert function(["p", "p"], ["ab", ""], ["x", "y"], [True, True]) == [2.0, 0.0]


def test_reward_function_errors(tmp_path):
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    cases = {
        "exact": "reward_funcs: 'exact' is not a built-in reward (exact_match, format, item_match, code_tests); "
                 "name your own as path/to/file.py:function or package.module:function",
        "missing.py:fn": "reward_funcs: file missing.py does not exist; give a path relative to the working "
                         "directory or the config file",
        f"{tmp_path}/my_rewards.py:score": f"reward_funcs: {tmp_path}/my_rewards.py has no function 'score'; "
                                           "define score(prompts, completions, references)",
        f"{tmp_path}/my_rewards.py:not_a_function": f"reward_funcs: {tmp_path}/my_rewards.py has no function "
                                                    "'not_a_function'; define not_a_function(prompts, completions, references)",
        f"{tmp_path}/broken.py:fn": f"reward_funcs: importing {tmp_path}/broken.py failed: RuntimeError: boom",
        "no_such_package_xyz.mod:fn": "reward_funcs: cannot import module 'no_such_package_xyz.mod' (No module named "
                                      "'no_such_package_xyz'); check the name or use path/to/file.py:fn",
    }
    for spec, message in cases.items():
        with pytest.raises(ConfigError) as info:
            load_reward_functions([spec])
        assert str(info.value) == message
    with pytest.raises(ConfigError) as info:
        load_reward_functions(["exact_match", "format"], [1.0])
    assert str(info.value) == "reward_weights has 1 values for 2 reward_funcs: give one weight per function"


def test_a_reward_function_returning_the_wrong_count_is_named(tmp_path):
    (tmp_path / "bad.py").write_text("def one(prompts, completions, references):\n    return [1.0]\n")
    (function,) = load_reward_functions([f"{tmp_path}/bad.py:one"])
    with pytest.raises(ValueError, match=r"returned 1 scores for 2 completions"):
        function(["p", "p"], ["a", "b"], ["a", "b"], [True, True])
