"""Build DeepSpeed's CPU shared-memory collective (deepspeed_shm_comm) once, into $TORCH_EXTENSIONS_DIR, by
default the running venv's torch_extensions folder, the one tests/conftest.py names.

DeepSpeed JIT-compiles it in the first distributed run on a CPU (docs/distributed.md): about 2 min of both
cores. `make setup` builds it here, so the suite's first DeepSpeed test does not pay it and a fresh clone's
`make test` times the tests themselves.
Nothing is built where DeepSpeed is absent or the op does not apply (no C++ compiler, not Linux).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def main() -> int:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))  # as the tests set it
    if importlib.util.find_spec("deepspeed") is None:
        print("deepspeed is not installed: no op to build")
        return 0
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415  (only where deepspeed is installed)

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not builder.is_compatible():
        print("deepspeed_shm_comm does not apply on this machine: DeepSpeed falls back to gloo")
        return 0
    builder.load(verbose=False)
    print(f"deepspeed_shm_comm built in {os.environ['TORCH_EXTENSIONS_DIR']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
