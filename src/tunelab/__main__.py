"""`python -m tunelab ...`, and the script each torchrun worker of `tunelab train ... nproc_per_node=N` runs
(train/launch.py: torchrun --run-path, in a process forked from the launcher)."""

from __future__ import annotations

import sys

from tunelab.cli import main
from tunelab.train import launch

if launch.under_launcher():
    launch.prepare_worker()
sys.exit(main())
