"""The layers point down (docs/architecture.md): the import-linter contracts in pyproject.toml hold with no
exceptions listed, and every function-level import of tunelab's own modules says why it is not at the top."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "tunelab"


def test_the_import_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint is None:
        pytest.skip("lint-imports is not installed: pip install -e '.[test]'")
    result = subprocess.run([lint, "--config", str(REPO / "pyproject.toml")], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "Contracts: 2 kept, 0 broken." in result.stdout
    assert "ignore_imports" not in (REPO / "pyproject.toml").read_text()  # no exceptions listed


def function_level_imports() -> list[tuple[str, int, str]]:
    """(file, line, source line) of each import of a tunelab module inside a function."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in node.body:
                for sub in ast.walk(inner):
                    if isinstance(sub, ast.ImportFrom) and (sub.module or "").startswith("tunelab"):
                        found.append((str(path.relative_to(SRC)), sub.lineno, lines[sub.lineno - 1]))
    return sorted(set(found))


def test_function_level_imports_are_counted_and_say_why():
    """There are no import circles left to dodge (the contract above): an import inside a function keeps a command
    light (`tunelab data` and `tunelab --help` import no Trainer, peft or bitsandbytes) or loads an optional part.
    cli.py imports each command's modules when that command runs; elsewhere each such import carries a reason."""
    found = function_level_imports()
    unexplained = [f"{file}:{line}: {source.strip()}" for file, line, source in found
                   if file != "cli.py" and not _reason_after(source) and not _reason_above(file, line)]
    assert unexplained == []
    assert len(found) == EXPECTED_FUNCTION_LEVEL_IMPORTS, "update the count (and say why) when adding or removing one"


def _reason_after(source: str) -> bool:
    """`# noqa: PLC0415 - why` or `# noqa: PLC0415  (why)`."""
    return len(source.split("noqa: PLC0415", 1)[-1].strip(" -()")) > 3 if "noqa: PLC0415" in source else False


def _reason_above(file: str, line: int) -> bool:
    """A comment on the line above the function's block of imports explains them."""
    lines = (SRC / file).read_text(encoding="utf-8").splitlines()
    at = line - 2
    while at >= 0 and lines[at].strip().startswith(("from ", "import ")):
        at -= 1
    return at >= 0 and lines[at].strip().startswith("#")


# 43 in cli.py (each command imports its modules when it runs), 44 elsewhere, each with its reason (126 before the
# layers were untangled, most of them dodging circles). train/outputs.py's import of model/adapters.py (peft) for
# saving a PiSSA / OLoRA / LoftQ adapter as a plain LoRA keeps `tunelab data`, which imports outputs, off peft.
# 90 since the recipes have two levels: ppo's hooks (scorer, policy, after_save) each import rl/ppo.py when training,
# and the RL recipe's score_answers imports rl/workflow.py (reward scores of held-out answers).
# 95 with stage kd: its recipe imports the teacher's loading (peft), its Trainer and the generation metrics when
# training, as sft's recipe does.
# 96: grpo's tool_use imports rl/tool_rollout.py when a run has tools.
EXPECTED_FUNCTION_LEVEL_IMPORTS = 96
