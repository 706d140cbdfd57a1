"""report_to: the trackers tunelab tests (tensorboard, wandb offline, mlflow's sqlite store, swanlab offline, trackio)
get tunelab's own log lines. One tiny SFT run reports to all five at once; each tracker is read back from its own
files and compared with trainer_log.jsonl: loss, tokens seen (all and supervised), memory, the eval metrics and
generate_at_eval's scores, value for value at the same steps. The run is a `tunelab train` process with none of the
trackers' variables set (tunelab's local defaults apply) and, where this machine can make one, no network at all, so
a log-in or an upload would fail it. A grpo run shows that the RL loop's lines reach the trackers the same way."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import sqlite3
import struct
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import yaml
from transformers.integrations.integration_utils import rewrite_logs

from tunelab.cli import main
from tunelab.errors import ConfigError
from tunelab.preflight import plan_run
from tunelab.run_folder import read_log
from tunelab.train.trackers import check_trackers

from .reliability_helpers import cli_env

TRACKERS = ("tensorboard", "wandb", "mlflow", "swanlab", "trackio")
INSTALLED = [name for name in TRACKERS if importlib.util.find_spec(name) is not None]
TRACKER_VARIABLES = ("WANDB_", "SWANLAB_", "MLFLOW_", "TRACKIO_", "TENSORBOARD_", "DO_NOT_TRACK")
# The fields compared: tunelab's own (tokens, memory, generation scores) and the Trainer's.
FIELDS = (
    "loss", "grad_norm", "learning_rate", "tokens_seen", "supervised_tokens_seen", "tokens_per_second",
    "supervised_tokens_per_second", "memory_rss_mib", "memory_peak_rss_mib", "eval_loss", "eval_perplexity",
    "eval_exact_match", "eval_bleu", "eval_rouge_l",
)
SFT = {
    "model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_reverse", "eval_dataset": "demo_sort_test",
    "max_samples": 16, "cutoff_len": 64, "per_device_train_batch_size": 8, "per_device_eval_batch_size": 8,
    "learning_rate": 5e-3, "max_steps": 2, "logging_steps": 1, "eval_strategy": "steps", "eval_steps": 2,
    "generate_at_eval": True, "eval_generation_samples": 2, "max_new_tokens": 4, "seed": 0, "disable_tqdm": True,
    "plot_loss": False,
}
LENGTH_REWARD = "def length(prompts, completions, references):\n    return [0.1 * len(c) for c in completions]\n"


def no_network_prefix() -> list[str]:
    """`unshare -n` (a network namespace with no interface up) where this machine allows it."""
    if shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"], capture_output=True, check=False).returncode == 0:
        return ["unshare", "-n"]
    print("unshare -n is not allowed here: the tracker run keeps this machine's network")
    return []


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> tuple[Path, Path]:
    """(output_dir, TRACKIO_DIR) of one `tunelab train` reporting to every installed tracker."""
    for name in TRACKERS:
        if name not in INSTALLED:
            print(f"report_to: {name} is not installed (pip install tunelab[{name}]): not checked")
    if not INSTALLED:
        pytest.skip("no tracker installed (pip install tunelab[trackers])")
    folder = tmp_path_factory.mktemp("trackers")
    out, trackio_dir = folder / "out", folder / "trackio"
    config = folder / "cfg.yaml"
    config.write_text(yaml.safe_dump({**SFT, "output_dir": str(out), "report_to": INSTALLED}))
    env = {k: v for k, v in cli_env(TUNELAB_CPU_BF16="0").items() if not k.startswith(TRACKER_VARIABLES)}
    env["TRACKIO_DIR"] = str(trackio_dir)  # trackio's store lives in the user's cache otherwise
    command = [*no_network_prefix(), sys.executable, "-m", "tunelab.cli", "train", str(config)]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, trackio_dir


def expected_series(log: list[dict], name_of) -> dict[str, list[tuple[int, float]]]:
    """FIELDS of trainer_log.jsonl as (step, value) per line, under the tracker's name for each (`name_of`)."""
    series = defaultdict(list)
    for record in log:
        for field in FIELDS:
            if field in record:
                series[name_of(field)].append((record["step"], record[field]))
    return dict(series)


def prefixed(field: str) -> str:
    """The name transformers' wandb, tensorboard, swanlab and trackio callbacks log a field under (train/loss)."""
    (name,) = rewrite_logs({field: 0})
    return name


# ---- each tracker's own storage, read back -------------------------------------------------------------------


def tensorboard_series(out: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    (folder,) = glob.glob(str(out / "runs" / "*"))  # the Trainer's default, output_dir/runs/<time>_<host>
    events = EventAccumulator(folder, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def wandb_records(path: Path):
    """The protobuf records of an offline run's .wandb file: wandb's LevelDB-style log (a 7-byte header, 32 KiB
    blocks of chunks: 4-byte CRC, 2-byte length, 1-byte type FULL / FIRST / MIDDLE / LAST)."""
    from wandb.proto import wandb_internal_pb2  # noqa: PLC0415

    data, block, position, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        length, kind = struct.unpack("<HB", data[position + 4 : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_series(out: Path) -> dict[str, list[tuple[int, float]]]:
    (path,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))  # offline, under output_dir
    series = defaultdict(list)
    for record in wandb_records(Path(path)):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for key, value in row.items():
                if not key.startswith("_") and key != "train/global_step":
                    series[key].append((row["train/global_step"], value))
    return dict(series)


def mlflow_series(out: Path) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient  # noqa: PLC0415

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")  # tunelab's default store
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED"  # on_train_end reached the tracker
    return {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics}


def swanlab_series(out: Path) -> dict[str, list[tuple[int, float]]]:
    from swanlab.data.porter.datastore import DataStore  # noqa: PLC0415
    from swanlab.proto.v0 import BaseModel, Scalar  # noqa: PLC0415

    (path,) = glob.glob(str(out / "swanlog" / "run-*" / "backup.swanlab"))  # offline, under output_dir
    store = DataStore()
    store.open_for_scan(path)
    series = defaultdict(list)
    for data in store:
        record = BaseModel.from_record(data) if data is not None else None
        if isinstance(record, Scalar):
            series[record.key].append((record.step, record.metric["data"]))
    return dict(series)


def trackio_series(trackio_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """trackio's project database: one row per logged line, its values as JSON (train/global_step is the step)."""
    (database,) = glob.glob(str(trackio_dir / "*.db"))
    series = defaultdict(list)
    with sqlite3.connect(database) as connection:
        for (metrics,) in connection.execute("SELECT metrics FROM metrics ORDER BY id"):
            row = json.loads(metrics)
            for key, value in row.items():
                if key != "train/global_step":
                    series[key].append((row["train/global_step"], value))
    return dict(series)


def first_per_step(series: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """swanlab keeps one value of a name per step, the first: an evaluation's memory at a step that also logged
    training is not kept."""
    kept = {}
    for name, points in series.items():
        steps: set[int] = set()
        kept[name] = [(s, v) for s, v in points if not (s in steps or steps.add(s))]
    return kept


def float32(series: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard stores scalars as float32."""
    return {name: [(s, float(np.float32(v))) for s, v in points] for name, points in series.items()}


READERS = {
    "tensorboard": lambda out, _: (tensorboard_series(out), lambda log: float32(expected_series(log, prefixed))),
    "wandb": lambda out, _: (wandb_series(out), lambda log: expected_series(log, prefixed)),
    "mlflow": lambda out, _: (mlflow_series(out), lambda log: expected_series(log, str)),
    "swanlab": lambda out, _: (swanlab_series(out), lambda log: first_per_step(expected_series(log, prefixed))),
    "trackio": lambda out, trackio_dir: (trackio_series(trackio_dir), lambda log: expected_series(log, prefixed)),
}


@pytest.mark.slow
@pytest.mark.parametrize("tracker", TRACKERS)
def test_tracker_holds_what_trainer_log_holds(sft_run, tracker):
    if tracker not in INSTALLED:
        pytest.skip(f"{tracker} is not installed (pip install tunelab[{tracker}])")
    out, trackio_dir = sft_run
    log = read_log(out)
    # the run logged what is compared: two training lines, then the evaluation with generate_at_eval's scores
    assert [r["step"] for r in log if "loss" in r] == [1, 2]
    assert [r["step"] for r in log if "eval_rouge_l" in r] == [2]
    stored, expected_of = READERS[tracker](out, trackio_dir)
    expected = expected_of(log)
    assert len(expected) == len(FIELDS)
    assert {name: stored.get(name) for name in expected} == expected


@pytest.mark.slow
def test_grpo_lines_reach_the_tracker(tmp_path, monkeypatch):
    """The RL loop hands its lines (rewards, KL, memory) to report_to's trackers as the Trainer does."""
    if "tensorboard" not in INSTALLED:
        pytest.skip("tensorboard is not installed (pip install tunelab[tensorboard])")
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    (tmp_path / "rewards.py").write_text(LENGTH_REWARD)
    out = tmp_path / "out"
    config = tmp_path / "grpo.yaml"
    config.write_text(yaml.safe_dump({
        "model_name_or_path": "tiny", "stage": "grpo", "finetuning_type": "lora", "template": "chatml",
        "dataset": "demo_sort", "max_samples": 8, "cutoff_len": 64, "max_new_tokens": 4,
        "reward_funcs": "rewards.py:length", "num_generations": 2, "per_device_train_batch_size": 2, "max_steps": 2,
        "logging_steps": 1, "learning_rate": 1e-4, "seed": 0, "disable_tqdm": True, "plot_loss": False,
        "output_dir": str(out), "report_to": "tensorboard",
    }))
    assert main(["train", str(config)]) == 0
    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2] and all(r["reward"] > 0 for r in log)
    fields = ("loss", "reward", "reward_std", "kl", "learning_rate", "epoch", "elapsed_seconds", "memory_rss_mib")
    expected = {prefixed(f): [(r["step"], float(np.float32(r[f]))) for r in log] for f in fields}
    stored = tensorboard_series(out)
    assert {name: stored.get(name) for name in expected} == expected


# ---- the checks before anything loads ------------------------------------------------------------------------


def test_report_to_names_are_checked_before_anything_loads():
    assert check_trackers("none") == [] and check_trackers([]) == []
    assert check_trackers(f"{INSTALLED[0]} , {INSTALLED[-1]}") == [INSTALLED[0], INSTALLED[-1]]  # command-line list
    with pytest.raises(ConfigError, match=r"^report_to: 'wandbx' is not a tracker transformers knows; use none or"):
        check_trackers(["wandbx"])
    assert importlib.util.find_spec("comet_ml") is None  # a tracker transformers knows, not installed here
    with pytest.raises(ConfigError) as refused:
        check_trackers(["comet_ml"])
    assert str(refused.value) == "report_to: comet_ml is not installed: pip install comet-ml"


def test_llamafactory_use_swanlab_adds_swanlab_to_report_to(tmp_path):
    if "swanlab" not in INSTALLED:
        pytest.skip("swanlab is not installed (pip install tunelab[swanlab])")
    base = {"model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_reverse",
            "output_dir": str(tmp_path / "out")}
    for options, expected in (
        ({"use_swanlab": True}, ["swanlab"]),
        ({"use_swanlab": "true", "report_to": "tensorboard"}, ["tensorboard", "swanlab"]),
        ({"use_swanlab": True, "report_to": ["swanlab"]}, ["swanlab"]),
        ({"use_swanlab": False}, []),
    ):
        assert plan_run(None, {**base, **options}, "train").config.training.report_to == expected, options


def test_local_defaults_leave_what_the_user_set(tmp_path, monkeypatch):
    from tunelab.train.trackers import keep_trackers_local  # noqa: PLC0415

    for key in ("WANDB_MODE", "WANDB_DIR", "SWANLAB_MODE", "SWANLAB_API_KEY", "SWANLAB_LOG_DIR",
                "MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK"):
        monkeypatch.setenv(key, "")  # empty is unset; monkeypatch restores each at the end
    monkeypatch.setenv("WANDB_API_KEY", "set-by-the-user")  # a user who logged in keeps wandb online
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    keep_trackers_local(["wandb", "swanlab", "mlflow"], tmp_path)
    assert os.environ["WANDB_MODE"] == "" and os.environ["WANDB_DIR"] == str(tmp_path.resolve())
    assert os.environ["SWANLAB_MODE"] == "offline"
    assert os.environ["SWANLAB_LOG_DIR"] == str(tmp_path.resolve() / "swanlog")
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5000"
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true"
