"""`python -m tunelab ...`, and the script each torchrun worker of `tunelab train ... nproc_per_node=N` runs
(train/launch.py: torchrun --run-path, in a process forked from the launcher)."""

from __future__ import annotations

import sys

from tunelab.cli import main
from tunelab.train import launch

# Guarded: a spawned worker (a GPU build of torch) imports its parent's main module as __mp_main__ first, and a
# parent started as `python -m tunelab` must not run again there. torchrun's --run-path runs this as __main__.
if __name__ == "__main__":
    if launch.under_launcher():
        launch.prepare_worker()
    sys.exit(main())
