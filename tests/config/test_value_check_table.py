"""config/checks.py's VALUE_CHECKS names the option groups each value check reads; check_config passes exactly those.
The names are the check's parameters, so the table and the functions cannot drift apart."""

from __future__ import annotations

import dataclasses
import inspect

from tunelab.config.args import RunConfig
from tunelab.config.checks import LOOP_CHECKS, VALUE_CHECKS

GROUPS = {field.name for field in dataclasses.fields(RunConfig)}


def test_each_check_takes_the_groups_its_row_names() -> None:
    for check, groups in VALUE_CHECKS:
        assert tuple(inspect.signature(check).parameters) == groups, check.__name__
        assert set(groups) <= GROUPS, check.__name__


def test_the_table_holds_each_check_once_and_every_loop_check() -> None:
    checks = [check for check, _ in VALUE_CHECKS]
    assert len(checks) == len(set(checks))
    assert set(LOOP_CHECKS) <= set(checks)
