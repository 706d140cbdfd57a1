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


# The same rule for any task whose answer is a number (examples/real/grpo_tools.yaml): the bare right number pays 1,
# the right number among other words 0.5.
number_reward = sum_reward
