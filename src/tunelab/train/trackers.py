"""Experiment trackers: the `report_to` names transformers' integrations log to, checked before anything loads, and
the environment that keeps them on this machine unless the user chose otherwise.

The trackers themselves are transformers' callbacks (transformers.integrations); they receive every log line the
Trainer logs (train/trainer.py `TunelabTrainer.log`, which adds tunelab's own fields first) and, for grpo / ppo,
every line of train/rl/loop.py through the same callback handler.

`check_trackers` (tunelab/preflight.py, a training run only): each name is one transformers knows and its package
imports, else one line with the pip command. `keep_trackers_local` (train/run.py, at the start of the run): for
each tracker named, the environment variables the user left unset that would otherwise log in, upload or write into
the current folder:

    wandb      WANDB_MODE=offline (unless WANDB_MODE or WANDB_API_KEY is set); WANDB_DIR=output_dir
    swanlab    SWANLAB_MODE=offline (unless SWANLAB_MODE or SWANLAB_API_KEY is set); SWANLAB_LOG_DIR=output_dir/swanlog
    mlflow     MLFLOW_TRACKING_URI=sqlite:///output_dir/mlflow.db; MLFLOW_DISABLE_TELEMETRY=true (unless DO_NOT_TRACK)
    tensorboard, trackio: local already (output_dir/runs; trackio's TRACKIO_DIR, without a Space unless
               trackio_space_id is set)

A variable the user set is never changed. docs/training.md ("Experiment trackers") says the same for people.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from tunelab.config.training_options import tracker_names
from tunelab.errors import ConfigError

logger = logging.getLogger(__name__)

# report_to name → (the module it imports, what installs it). tunelab's extras for the five it tests; the package
# for transformers' other integrations.
TRACKER_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tunelab[tensorboard]"),
    "wandb": ("wandb", "tunelab[wandb]"),
    "mlflow": ("mlflow", "tunelab[mlflow]"),
    "swanlab": ("swanlab", "tunelab[swanlab]"),
    "trackio": ("trackio", "tunelab[trackio]"),
    "comet_ml": ("comet_ml", "comet-ml"),
    "clearml": ("clearml", "clearml"),
    "neptune": ("neptune", "neptune"),
    "dvclive": ("dvclive", "dvclive"),
    "codecarbon": ("codecarbon", "codecarbon"),
    "azure_ml": ("azureml", "azureml-core"),
    "dagshub": ("dagshub", "dagshub"),
    "flyte": ("flytekit", "flytekit"),
}


def check_trackers(report_to: str | Sequence[str] | None) -> list[str]:
    """The tracker names of `report_to`, each one transformers knows, installed and usable; ConfigError otherwise."""
    # lazy: transformers' tracker integrations; preflight imports this module for `tunelab data`
    from transformers.integrations import INTEGRATION_TO_CALLBACK

    names = tracker_names(report_to)
    for name in names:
        if name not in INTEGRATION_TO_CALLBACK:
            raise ConfigError(
                f"report_to: '{name}' is not a tracker transformers knows; use none or some of "
                f"{', '.join(sorted(INTEGRATION_TO_CALLBACK))}", key="report_to",
            )
        module, install = TRACKER_PACKAGES.get(name, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"report_to: {name} is not installed: pip install {install}", key="report_to",
                              fix=f"pip install {install}")
    if "swanlab" in names:
        check_swanlab_api()
    return names


def check_swanlab_api() -> None:
    """transformers' SwanLab callback asks swanlab.get_run() whether a run is open and expects None when not; swanlab
    0.8 and later raise instead, so the run would fail once the model is loaded."""
    import swanlab  # lazy: the swanlab extra, which may be missing

    try:
        swanlab.get_run()
    except RuntimeError:
        raise ConfigError(
            f"report_to: swanlab {swanlab.__version__} does not work with transformers' SwanLab integration (its "
            "get_run() raises without an open run): pip install 'swanlab<0.8' (tunelab[swanlab])", key="report_to",
        ) from None


def keep_trackers_local(report_to: str | Sequence[str] | None, output_dir: str | Path) -> None:
    """Set, for each tracker named, the environment variables of the module docstring that the user left unset, and
    say so in one line each."""
    out = Path(output_dir).resolve()
    names = tracker_names(report_to)
    if "wandb" in names:
        offline = _set_default("WANDB_MODE", "offline", unless="WANDB_API_KEY")
        _set_default("WANDB_DIR", str(out))
        if offline:
            logger.info("report_to: wandb logs offline under %s/wandb (WANDB_MODE=offline; `wandb sync` uploads "
                        "the run later, WANDB_MODE=online logs it live)", os.environ["WANDB_DIR"])
    if "swanlab" in names:
        offline = _set_default("SWANLAB_MODE", "offline", unless="SWANLAB_API_KEY")
        _set_default("SWANLAB_LOG_DIR", str(out / "swanlog"))
        if offline:
            logger.info("report_to: swanlab logs offline under %s (SWANLAB_MODE=offline; `swanlab sync` uploads the "
                        "run later, SWANLAB_MODE=cloud logs it live)", os.environ["SWANLAB_LOG_DIR"])
    if "mlflow" in names:
        if _set_default("MLFLOW_TRACKING_URI", f"sqlite:///{out / 'mlflow.db'}"):
            logger.info("report_to: mlflow logs to %s (MLFLOW_TRACKING_URI; `mlflow ui --backend-store-uri %s` "
                        "shows it)", os.environ["MLFLOW_TRACKING_URI"], os.environ["MLFLOW_TRACKING_URI"])
        _set_default("MLFLOW_DISABLE_TELEMETRY", "true", unless="DO_NOT_TRACK")


def _set_default(variable: str, value: str, unless: str | None = None) -> bool:
    """Set `variable` to `value` when neither it nor `unless` is set; whether it did."""
    if os.environ.get(variable) or (unless and os.environ.get(unless)):
        return False
    os.environ[variable] = value
    return True
