"""A verifiable reward for examples/real/grpo.yaml: the sum, and only the sum.

SmolLM2-135M-Instruct answers "Add the two numbers.\n23 + 45" in a sentence ("The sum of 23 and 45 is 68."),
so exact match alone scores almost every rollout 0 and GRPO, which learns from differences within a group,
gets nothing to learn from. This reward gives 1.0 for the bare right number, 0.5 when the right number is in
the answer among other words, and 0 otherwise: the right sum pays, and the bare one pays more.
"""
from __future__ import annotations

import re


def sum_reward(prompts: list[str], completions: list[str], references: list[str]) -> list[float]:
    scores = []
    for completion, reference in zip(completions, references):
        answer, right = completion.strip(), reference.strip()
        if answer == right:
            scores.append(1.0)
        elif right in re.findall(r"-?\d+", answer):
            scores.append(0.5)
        else:
            scores.append(0.0)
    return scores


def number_reward(prompts: list[str], completions: list[str], references: list[str]) -> list[float]:
    """sum_reward's rule for the final answer of a tool-using rollout (examples/real/grpo_tools.yaml), except that an
    answer holding a call object scores 0: in the first 4 steps measured with sum_reward's rule, every rollout that
    scored was a further call echoing the tool's result (`{"name": "python", "arguments": {"code": "7016"}}`)."""
    scores = sum_reward(prompts, completions, references)
    return [0.0 if '"name"' in completion else score for completion, score in zip(completions, scores)]
