"""Where an option acts, declared on the option itself (`option_help(..., applies=...)`, `_help` in config/args.py) and
checked by one function: an option set away from its default under a stage or method it does nothing for is refused,
with one line naming it and the fix, instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tunelab.errors import ConfigError


@dataclass(frozen=True)
class Applies:
    """The option acts only while option `key` (stage, finetuning_type) has one of `values`. `grouped` rules name
    every such option in one line (a config switched from lora to full often keeps several LoRA options)."""

    key: str
    values: tuple[str, ...]
    grouped: bool = False

    def message(self, names: list[str], actual: str) -> str:
        apply, them = ("apply", "them") if len(names) > 1 else ("applies", "it")
        if self.key == "finetuning_type":
            wanted = " / ".join(self.values)
            return (f"{', '.join(names)} only {apply} to finetuning_type: {wanted} (got '{actual}'): remove {them} or "
                    f"set finetuning_type: {wanted}")
        if self.key != "stage":  # an option of an option: dpo_label_smoothing acts under pref_loss sigmoid
            return f"{names[0]} only applies to {self.key}: {' / '.join(self.values)} (got {actual}): remove it"
        stages = " / ".join(self.values)  # a rule that is not grouped is given its first option alone
        return f"{', '.join(names)} only {apply} to stage {stages} (got stage: {actual}): remove {them}"


LORA_ONLY = Applies("finetuning_type", ("lora",), grouped=True)


def default_of(option: dataclasses.Field):
    return option.default_factory() if option.default is dataclasses.MISSING else option.default


def rules_of(option: dataclasses.Field) -> tuple[Applies, ...]:
    rules = option.metadata.get("applies", ())
    return rules if isinstance(rules, tuple) else (rules,)


def check_applicability(groups: list, keys: tuple[str, ...]) -> None:
    """Refuse options set away from their default where they do not act. `groups` are the run's option groups
    (dataclass instances, which also hold the deciding options); `keys` the deciding options to check (a command
    that does not train checks fewer). The rules are checked in the order of `keys`, then of declaration."""
    value = {f.name: getattr(group, f.name) for group in groups for f in dataclasses.fields(group)}
    misplaced: dict[Applies, list[str]] = {}
    for group in groups:
        for option in dataclasses.fields(group):
            for applies in rules_of(option):
                if applies.key not in keys or value[applies.key] in applies.values:
                    continue
                if value[option.name] != default_of(option):
                    misplaced.setdefault(applies, []).append(option.name)
    for key in keys:
        for applies, names in misplaced.items():
            if applies.key == key:
                first = names if applies.grouped else names[:1]
                raise ConfigError(applies.message(first, value[key]), key=first[0], fix=f"remove {', '.join(first)}")
