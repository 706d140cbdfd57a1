"""The command line's log format and levels, shared by every command (in its own module: `tunelab data`
sets it up without importing the training stack)."""

from __future__ import annotations

import logging


def setup_logging(is_main_process: bool = True) -> None:
    level = logging.INFO if is_main_process else logging.WARNING
    logging.basicConfig(format="[%(asctime)s %(levelname)s %(name)s] %(message)s", datefmt="%H:%M:%S", level=level)
    logging.getLogger("tunelab").setLevel(level)
    import transformers  # lazy: transformers (11 s bare), for the commands that set up logging only

    transformers.logging.set_verbosity_warning()
