"""The official chat templates (test data beside the repo) and the golden renders recorded from them.

``../shared/fixtures/chat_templates`` holds the official Jinja texts of each family. CI has that folder; a
user's clone does not. Two kinds of test use it:

* tests that compare our built-in templates with the official ones directly (test_template_official.py) are
  marked ``needs_official``: skipped, with the reason shown, where the folder is absent;
* tests that only need what an official template renders for one of *our* conversations call
  ``official_render``. With the folder present it renders with the official template and checks that the
  recorded render in ``tests/data/golden_renders.json`` is still the same; without it, it replays the recording.
  So the masking, expansion and tool tests run in every clone.

``python scripts/record_golden_renders.py`` rewrites golden_renders.json (it needs ../shared): the renders of
the suite's own conversations plus each family's bos/eos and literal special tokens — outputs, never templates.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import cache
from typing import Any

import pytest

from tests.fixture_paths import CHAT_TEMPLATE_FIXTURES, REPO_ROOT
from tunelab.data.templates import TEMPLATE_NAMES, Template
from tunelab.errors import TemplateError

GOLDEN_FILE = REPO_ROOT / "tests" / "data" / "golden_renders.json"
RECORD_ENV = "TUNELAB_RECORD_GOLDEN"  # set by scripts/record_golden_renders.py
HAVE_OFFICIAL = CHAT_TEMPLATE_FIXTURES.is_dir()
RECORDING = os.environ.get(RECORD_ENV) == "1"

needs_official = pytest.mark.skipif(
    not HAVE_OFFICIAL,
    reason=f"official chat templates not found at {CHAT_TEMPLATE_FIXTURES} (check out ../shared beside the repo "
    "to compare the built-in templates with them)",
)

# built-in name -> official family (default is our own format and has no official counterpart)
FAMILY = {name: name for name in TEMPLATE_NAMES if name != "default"} | {"llama2": "llama2_chat"}

# What a recording session collected: {"families": {...}, "renders": {...}}; written at session end (conftest).
recorded: dict[str, dict[str, Any]] = {"families": {}, "renders": {}}


@cache
def _golden() -> dict[str, dict[str, Any]]:
    if not GOLDEN_FILE.is_file():
        return {"families": {}, "renders": {}}
    return json.loads(GOLDEN_FILE.read_text(encoding="utf-8"))


@cache
def _index() -> dict[str, dict[str, Any]]:
    entries = json.loads((CHAT_TEMPLATE_FIXTURES / "INDEX.json").read_text(encoding="utf-8"))["families"]
    return {entry["family"]: entry for entry in entries}


def family_facts(name: str) -> dict[str, Any]:
    """bos_token, eos_token ("" when none) and literal_special_tokens of a built-in's official family."""
    family = FAMILY[name]
    if HAVE_OFFICIAL:
        entry = _index()[family]
        facts = {
            "bos_token": entry["bos_token"] or "",
            "eos_token": entry["eos_token"] or "",
            "literal_special_tokens": list(entry["literal_special_tokens"]),
        }
        if RECORDING:
            recorded["families"][family] = facts
        return facts
    return _golden()["families"][family]


def special_tokens(name: str) -> dict[str, str]:
    """The family's bos/eos as template variables; our own `default` format uses <s> / </s>."""
    if name == "default":
        return {"bos_token": "<s>", "eos_token": "</s>"}
    facts = family_facts(name)
    return {"bos_token": facts["bos_token"], "eos_token": facts["eos_token"]}


def official_template(name: str) -> Template:
    """The official template itself, for tests marked ``needs_official``."""
    if not HAVE_OFFICIAL:
        pytest.skip(f"official chat templates not found at {CHAT_TEMPLATE_FIXTURES}")
    family = FAMILY[name]
    return Template(name=f"official:{family}", jinja=(CHAT_TEMPLATE_FIXTURES / f"{family}.jinja").read_text(encoding="utf-8"))


def official_render(name: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """What the official template of ``name`` renders (raises TemplateError where it refuses), live or recorded."""
    key = render_key(FAMILY[name], messages, kwargs)
    if HAVE_OFFICIAL:
        try:
            result: dict[str, Any] = {"output": official_template(name).render(messages, **kwargs)}
        except TemplateError as exc:
            result = {"error": str(exc)}
        if RECORDING:
            recorded["renders"][key] = {"family": FAMILY[name], **result}
        else:
            stored = _golden()["renders"].get(key)
            assert stored is not None, (
                f"no golden render of this {FAMILY[name]} conversation in {GOLDEN_FILE.name}: "
                "run python scripts/record_golden_renders.py"
            )
            assert {k: v for k, v in stored.items() if k != "family"} == result, (
                f"{GOLDEN_FILE.name} is stale for {FAMILY[name]}: run python scripts/record_golden_renders.py"
            )
    else:
        stored = _golden()["renders"].get(key)
        if stored is None:
            pytest.skip(f"no golden render of this {FAMILY[name]} conversation, and the official templates are not "
                        f"at {CHAT_TEMPLATE_FIXTURES}")
        result = stored
    if "error" in result:
        raise TemplateError(result["error"])
    return result["output"]


def render_key(family: str, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    text = json.dumps([family, messages, kwargs], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


def write_recording() -> None:
    """Write what this session recorded (called once at the end of a recording session)."""
    data = {
        "about": "Renders of tunelab's own test conversations by the official chat templates, and each family's "
        "bos/eos/literal special tokens; written by scripts/record_golden_renders.py (see tests/official.py).",
        "families": dict(sorted(recorded["families"].items())),
        "renders": dict(sorted(recorded["renders"].items())),
    }
    GOLDEN_FILE.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
