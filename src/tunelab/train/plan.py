"""A run resolved once by tunelab/preflight.py, as every later step takes it: the config with its folders resolved,
and what the layers resolved while checking it (the datasets' registry, the reward functions and tools, the
user's callbacks), so that nothing is looked up, imported or downloaded twice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunelab.config.args import RunConfig
from tunelab.data.registry import Registry
from tunelab.train.rl.rewards import RewardFunction
from tunelab.train.rl.tools import Tool


@dataclass(frozen=True)
class RunPlan:
    config: RunConfig
    purpose: str
    registry: Registry | None = None  # the datasets' registry (None: a command that reads no dataset)
    reward_functions: tuple[RewardFunction, ...] = ()  # grpo
    user_callbacks: tuple[tuple[type, dict[str, Any]], ...] = ()  # (class, kwargs) of each `callbacks` entry
    tools: tuple[Tool, ...] = ()  # grpo with tools: the tools a rollout may call
