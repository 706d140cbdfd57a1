"""The layers point down (docs/architecture.md): the import-linter contracts in pyproject.toml hold with no
exceptions listed, and every import inside a function says why it is not at the top (`# lazy: why`)."""

from __future__ import annotations

import ast
import functools
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
    """(file, line, source line) of each import statement inside a function, of any module."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [(str(path.relative_to(SRC)), sub.lineno, lines[sub.lineno - 1]) for inner in node.body
                          for sub in ast.walk(inner) if isinstance(sub, (ast.Import, ast.ImportFrom))]
    return sorted(set(found))


def test_function_level_imports_are_counted_and_say_why():
    """An import belongs at the top of its module unless importing it there measurably slows a command that does
    not need it (cli.py's command dispatch: `tunelab --help` imports no torch; `tunelab data` no Trainer,
    peft or bitsandbytes) or it is an optional extra that may be missing. Each import inside a function
    says which: `# lazy: why` on its line, or on a comment line just above its block of imports. The start-up
    figures behind them: docs/benchmarks.md, "Start-up: imports at the top"."""
    found = function_level_imports()
    unexplained = [f"{file}:{line}: {source.strip()}" for file, line, source in found
                   if "# lazy:" not in source and not _reason_above(file, line)]
    assert unexplained == []
    assert len(found) == EXPECTED_FUNCTION_LEVEL_IMPORTS, "update the count (and say why) when adding or removing one"


def _reason_above(file: str, line: int) -> bool:
    """A `# lazy:` comment line above the block of imports (blank lines between them allowed) that holds this one."""
    lines, in_import = _import_lines(file)
    at = line - 1
    while at >= 1 and (at in in_import or not lines[at - 1].strip()):
        at -= 1
    return at >= 1 and lines[at - 1].strip().startswith("# lazy:")


@functools.cache
def _import_lines(file: str) -> tuple[list[str], set[int]]:
    """The file's lines, and the numbers of those that belong to an import statement."""
    text = (SRC / file).read_text(encoding="utf-8")
    imports = [node for node in ast.walk(ast.parse(text)) if isinstance(node, (ast.Import, ast.ImportFrom))]
    return text.splitlines(), {at for node in imports for at in range(node.lineno, node.end_lineno + 1)}


# 201 before issue 54 moved to the top every import whose start-up cost no command avoids by it. 142 now: 47 in cli.py
# (each command's modules, json and pathlib included: `tunelab --help` imports none of them), 95 elsewhere: peft,
# bitsandbytes and the Trainer off `tunelab data`, torch off a launcher's check, matplotlib, Pillow, the web UI's
# stacks, and the optional extras (gguf, torchao, deepspeed, eval metrics, optimizers, trackers, llama.cpp).
# 148 with stage kd (the teacher's loading, its Trainer, the generation metrics: 5) and grpo's tool rollout (1).
# 144 with train/plots.py's three figures taking matplotlib from one helper (the reward figure added a third).
EXPECTED_FUNCTION_LEVEL_IMPORTS = 147
