"""Rewrite tests/data/golden_renders.json from the official chat templates in ../shared (see tests/official.py).

The suite's token-level tests compare our encodings with what the official templates render for the suite's
own conversations. Those renders are recorded here, so the tests run in a clone without ../shared; where the
templates are present (CI), every test checks its recorded render is still what the template renders.

    python scripts/record_golden_renders.py      # after changing a conversation a test renders

Runs the data tests once with recording on; the file is written only when that run passes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixture_paths import CHAT_TEMPLATE_FIXTURES  # noqa: E402
from tests.official import GOLDEN_FILE, RECORD_ENV  # noqa: E402


def main() -> int:
    if not CHAT_TEMPLATE_FIXTURES.is_dir():
        print(f"record_golden_renders: the official templates are not at {CHAT_TEMPLATE_FIXTURES}", file=sys.stderr)
        return 2
    env = {**os.environ, RECORD_ENV: "1"}
    command = [sys.executable, "-m", "pytest", "tests/data", "-q", "-p", "no:cacheprovider", "-x"]
    result = subprocess.run(command, cwd=REPO, env=env, check=False)
    if result.returncode != 0:
        print("record_golden_renders: the data tests failed; nothing written", file=sys.stderr)
        return result.returncode
    print(f"wrote {GOLDEN_FILE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
