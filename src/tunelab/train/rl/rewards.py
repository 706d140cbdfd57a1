"""Reward functions for stage grpo: the built-in verifiable rewards and loading the user's own.

A reward function scores a batch of completions:

    fn(prompts: list[str], completions: list[str], references: list[str]) -> list[float]

- prompts: the rendered prompts (chat template with the generation prompt) the completions answer;
- completions: the generated answers, decoded up to (not including) the end-of-turn token;
- references: the dataset's reference answer of each prompt (the last assistant turn of its row).

A function that also names a parameter `finished` (or takes **kwargs) receives
`finished: list[bool]`: whether each completion ended at the end-of-turn token rather than at
max_new_tokens. With tools (grpo's option tools), `completions` are the rollouts' final answers, and a function
that names a parameter `completion_messages` (or takes **kwargs) receives each rollout's whole exchange after the
prompt as a list of messages: assistant turns (with their `tool_calls`), tool results (role tool) and the final
answer (train/rl/tool_rollout.py). `reward_funcs` names them: a built-in (`exact_match`, `format`, `item_match`,
`code_tests`),
`path/to/file.py:fn`
or `package.module:fn` (imported by the opt-in rule of tunelab/user_code.py); `reward_weights` weighs
them (default 1 each), and a completion's reward is the weighted sum.

A reward function may also have `pop_stats() -> dict[str, float]`: counts of what happened since the last call
(code_tests: timeouts and crashes), logged as reward/<name>/<key>.

This module owns naming, loading and calling reward functions; it knows nothing of models or tokens.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tunelab.errors import ConfigError, DataError
from tunelab.train.rl.code_sandbox import CodeRunner, extract_code, split_tests
from tunelab.user_code import import_user_module, is_user_spec, split_user_spec

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float]]


def exact_match_reward(prompts: list[str], completions: list[str], references: list[str]) -> list[float]:
    """1.0 when the answer equals the reference (surrounding whitespace ignored), else 0.0 —
    the same rule as the exact-match metric of infer/generate.py."""
    return [float(c.strip() == r.strip()) for c, r in zip(completions, references)]


def answer_shape(text: str) -> str:
    """The shape of an answer: every digit → 0, every letter → a, everything else kept.
    "3 1 2" and "1 2 3" share the shape "0 0 0"; "c,b,a" has the shape "a,a,a"."""
    return re.sub(r"[^\W\d_]", "a", re.sub(r"\d", "0", text.strip()))


def format_reward(
    prompts: list[str], completions: list[str], references: list[str], finished: list[bool]
) -> list[float]:
    """1.0 when the answer ended at the end-of-turn token and has the reference's shape, else 0.0.
    It rewards a well-formed answer whether or not it is right."""
    return [
        float(done and answer_shape(c) == answer_shape(r)) for c, r, done in zip(completions, references, finished)
    ]


def answer_items(text: str) -> list[str]:
    """The items of a list answer: split at commas and whitespace ("1 2 3", "c,b,a")."""
    return [item for item in re.split(r"[,\s]+", text.strip()) if item]


def item_match_reward(prompts: list[str], completions: list[str], references: list[str]) -> list[float]:
    """Partial credit for list answers: the share of positions whose item equals the reference's, over the
    longer of the two lists (a missing or extra item counts as wrong). A one-item answer scores as exact_match;
    a sorted list with one swapped pair scores (n - 2) / n. It gives a group of mostly wrong answers a signal."""
    scores = []
    for completion, reference in zip(completions, references):
        got, want = answer_items(completion), answer_items(reference)
        same = sum(a == b for a, b in zip(got, want))
        scores.append(same / max(len(got), len(want), 1))
    return scores


class CodeTestsReward:
    """Executed reward: the completion's code (its first ```python block, else the whole text) runs against the
    row's hidden tests, its reference answer: a Python program of assert statements (data/code_tasks.py writes
    them). The score is the share of the asserts that pass; a run that times out or crashes scores 0
    (code_sandbox.py says what a run may do). Runs go to a pool of child processes, one per CPU core."""

    def __init__(self, runner: CodeRunner | None = None):
        self._runner = runner
        self.stats = {"runs": 0, "timeouts": 0, "crashes": 0}

    @property
    def runner(self) -> CodeRunner:
        if self._runner is None:  # made when first scoring: loading a config must not start threads
            self._runner = CodeRunner()
        return self._runner

    def __call__(self, prompts: list[str], completions: list[str], references: list[str]) -> list[float]:
        jobs = [(extract_code(completion), _parsed_tests(reference))
                for completion, reference in zip(completions, references)]
        results = self.runner.run_many(jobs)
        timeouts = sum(r.status == "timeout" for r in results)
        crashes = sum(r.status == "crash" for r in results)
        self.stats["runs"] += len(results)
        self.stats["timeouts"] += timeouts
        self.stats["crashes"] += crashes
        if timeouts or crashes:
            logger.info("code_tests: %d of %d runs timed out, %d crashed (each scored 0)",
                        timeouts, len(results), crashes)
        return [r.score for r in results]

    def pop_stats(self) -> dict[str, float]:
        stats, self.stats = self.stats, {"runs": 0, "timeouts": 0, "crashes": 0}
        return {key: float(value) for key, value in stats.items()}


@functools.lru_cache(maxsize=4096)
def _parsed_tests(reference: str) -> list[tuple[str, bool]]:
    try:
        tests = split_tests(reference)
    except SyntaxError as error:
        raise DataError(
            f"code_tests: a row's reference answer is not a Python test program (line {error.lineno}: {error.msg}): "
            f"{reference[:80]!r}; code_tests reads each row's answer as the assert statements its code must pass"
        ) from None
    if not any(is_assert for _, is_assert in tests):
        raise DataError(f"code_tests: a row's reference answer has no assert statement: {reference[:80]!r}")
    return tests


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match_reward, "format": format_reward, "item_match": item_match_reward,
}
# Built-ins that keep state (a process pool, counts): one instance per run, made when resolved.
STATEFUL_REWARDS: dict[str, Callable[[], RewardFn]] = {"code_tests": CodeTestsReward}


@dataclass(frozen=True)
class RewardFunction:
    name: str  # as written in reward_funcs; also the suffix of its log key (reward/<name>)
    fn: RewardFn
    weight: float
    wants_finished: bool
    wants_messages: bool = False  # names completion_messages (tool-using rollouts)

    def __call__(self, prompts: list[str], completions: list[str], references: list[str],
                 finished: list[bool], completion_messages: list[list[dict]] | None = None) -> list[float]:
        kwargs: dict = {"finished": finished} if self.wants_finished else {}
        if self.wants_messages and completion_messages is not None:
            kwargs["completion_messages"] = completion_messages
        try:
            scores = self.fn(prompts, completions, references, **kwargs)
        except ValueError as exc:
            if threading.current_thread() is threading.main_thread() or "main thread" not in str(exc):
                raise
            # Python's own refusal of signal.signal off the main thread; GRPO scores on a background thread.
            raise ConfigError(
                f"reward_funcs: '{self.name}' sets a signal handler (a signal.alarm timeout, as math_verify's parse and "
                "verify do by default), which Python allows only on the main thread, and tunelab scores rewards on a "
                "background thread while the model generates; turn that timeout off (math_verify: "
                "parse(..., parsing_timeout=None), verify(..., timeout_seconds=None)) or bound the work another way "
                "(a thread, or a process as code_tests does)"
            ) from None
        scores = [float(s) for s in scores]
        if len(scores) != len(completions):
            raise ValueError(
                f"reward function '{self.name}' returned {len(scores)} scores for {len(completions)} completions"
            )
        return scores


def _accepts(fn: RewardFn, name: str) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins and C functions: call with the three lists only
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def resolve_reward_fn(spec: str, base_dir: str | Path | None = None) -> RewardFn:
    """The callable `spec` names: a built-in, `file.py:fn` (relative to the working directory, then
    to base_dir — the config file's folder), or `package.module:fn` (tunelab/user_code.py).
    ConfigError naming the fix otherwise."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if spec in STATEFUL_REWARDS:
        return STATEFUL_REWARDS[spec]()
    if not is_user_spec(spec):
        raise ConfigError(
            f"reward_funcs: '{spec}' is not a built-in reward ({', '.join([*BUILTIN_REWARDS, *STATEFUL_REWARDS])}); "
            "name your own as path/to/file.py:function or package.module:function"
        )
    where, name = split_user_spec(spec)
    module = import_user_module(where, "reward_funcs", base_dir, fix_name="fn")
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"reward_funcs: {where} has no function '{name}'; define {name}(prompts, completions, references)")
    return fn


def load_reward_functions(
    specs: Sequence[str], weights: Sequence[float] | None = None, base_dir: str | Path | None = None
) -> list[RewardFunction]:
    if weights is not None and len(weights) != len(specs):
        raise ConfigError(f"reward_weights has {len(weights)} values for {len(specs)} reward_funcs: give one weight per function")
    weights = list(weights) if weights is not None else [1.0] * len(specs)
    out = []
    for spec, weight in zip(specs, weights):
        fn = resolve_reward_fn(spec, base_dir)
        out.append(RewardFunction(name=spec, fn=fn, weight=float(weight), wants_finished=_accepts(fn, "finished"),
                                  wants_messages=_accepts(fn, "completion_messages")))
    return out


def score_completions(
    functions: Sequence[RewardFunction], prompts: list[str], completions: list[str], references: list[str],
    finished: list[bool], completion_messages: list[list[dict]] | None = None,
) -> tuple[list[float], dict[str, list[float]]]:
    """(weighted total per completion, each function's raw scores by name)."""
    per_function = {f.name: f(prompts, completions, references, finished, completion_messages) for f in functions}
    totals = [
        sum(f.weight * per_function[f.name][i] for f in functions) for i in range(len(completions))
    ]
    return totals, per_function


def reward_run_stats(functions: Sequence[RewardFunction]) -> dict[str, float]:
    """What the functions that count things (pop_stats) counted since the last call, as reward/<name>/<key>."""
    stats = {}
    for function in functions:
        pop = getattr(function.fn, "pop_stats", None)
        if pop is not None:
            stats.update({f"reward/{function.name}/{key}": value for key, value in pop().items()})
    return stats
