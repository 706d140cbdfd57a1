"""tunelab's own private names stay in their module: a name another module of src/ imports or reads is an API
between modules, so it is public (no leading underscore), or it moves to the module that uses it.

The scan reads src/tunelab with `ast` and fails on `from tunelab.x import _name` (relative imports too) and on
`name._attr` where `name` was imported from tunelab (a module, class or function of another module). A private
name used inside its own module, `self._x`, and dunder names are not crossings. (Other libraries' private names:
tests/test_private_names.py.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import tunelab

SRC = Path(tunelab.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def crossings(source: str, where: str) -> list[str]:
    """Each use in `source` of a private name of another tunelab module, as `where:line what`."""
    tree = ast.parse(source)
    imported: set[str] = set()  # local names bound to something of another tunelab module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").split(".")[0] == "tunelab"):
            for alias in node.names:
                if _private(alias.name):
                    module = "." * node.level + (node.module or "")
                    found.append(f"{where}:{node.lineno} from {module} import {alias.name}")
                imported.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            imported.update(alias.asname or alias.name.split(".")[0] for alias in node.names
                            if alias.name.split(".")[0] == "tunelab")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in imported):
            found.append(f"{where}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_no_module_of_src_uses_another_ones_private_name() -> None:
    found = [hit for path in sorted(SRC.rglob("*.py"))
             for hit in crossings(path.read_text(encoding="utf-8"), str(path.relative_to(SRC.parent)))]
    assert found == [], "private names used across modules (make them public, or move them):\n" + "\n".join(found)


def test_the_scan_sees_each_kind_of_crossing() -> None:
    source = (
        "from tunelab.data.encode import _parse, public\n"
        "from . import _sibling\n"
        "import tunelab.data.pipeline as pipeline\n"
        "from tunelab.data import formats\n"
        "formats._Converter(); pipeline._mix(); public._cache\n"
        "def _own(): return _own\n"
        "class A:\n    def f(self): return self._x, __name__\n"
    )
    assert sorted(crossings(source, "m.py")) == [
        "m.py:1 from tunelab.data.encode import _parse", "m.py:2 from . import _sibling",
        "m.py:5 formats._Converter", "m.py:5 pipeline._mix", "m.py:5 public._cache",
    ]
