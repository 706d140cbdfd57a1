"""Adding a stage is one module under train/stages/ and one row in config/stages.py's table (docs/architecture.md,
"Adding a stage"): a toy stage added that way, with no file of src/ edited, runs through the same commands as the
real ones (`tunelab data stats`, `tunelab estimate`, a 2-step `tunelab train` on the embedded tiny model).

What the toy touches, and so what a real new stage touches:
  - its recipe module, train/stages/<name>.py (here written into tmp_path, which joins the package's __path__);
  - its row in config/stages.py's STAGES (here appended for the test; STAGE_NAMES, the tuple the config's `stage`
    Literal is built from, is derived from STAGES once at import, so the test sets it too: a real row is in STAGES
    at import and needs nothing more);
  - its example config (examples/*.yaml: tests/test_cli_stages.py runs every command on it; here a yaml in
    tmp_path), its tests and its docs (docs/stages.md).
A stage whose kind needs a new loss or options adds those too (train/preference_losses.py or train/rl/losses.py,
config/args.py with applies=applies_where(...)); the toy, a supervised stage with its own held-out metric, needs none.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import yaml

import tunelab.train.stages
from tunelab.cli import main
from tunelab.config import args as config_args
from tunelab.config import stages
from tunelab.config.stages import Stage, stage_row

# The toy's recipe: sft's rows and Trainer (SupervisedRecipe); what differs is one held-out metric beside exact match.
TOY_MODULE = '''"""A toy supervised stage: sft's rows and token loss; its held-out answers also scored by length."""

from tunelab import run_folder
from tunelab.data.cache import cached_bundle
from tunelab.train import outputs
from tunelab.train.recipe import SupervisedRecipe


class ToyRecipe(SupervisedRecipe):
    stage = "toy"

    def datasets(self):
        config, args = self.config, self.config.training
        return cached_bundle(config.data, self.tokenizer, self.template.jinja, self.stage, args.seed,
                             build=lambda: self.encode(config.data), is_main_process=args.local_process_index == 0)

    def score_answers(self, predictions, when):
        return {f"answer_chars_{when}": sum(len(p.prediction) for p in predictions) / max(len(predictions), 1)}

    def run(self):
        config, args = self.config, self.config.training
        data = self.datasets()
        run_folder.write_json(args.output_dir, run_folder.DATA_REPORT, data.report)
        model = self.model()
        metrics = self.parameter_counts(model)
        trainer = self.trainer(model, data)
        rows = self.held_out_rows(data)
        self.exact_match_before(trainer.model, rows, metrics)
        metrics.update(trainer.train().metrics)
        outputs.save_model(trainer, self.tokenizer, self.template, args.output_dir)
        if data.eval:
            metrics.update(self.final_eval_metrics(trainer))
        self.exact_match_after(trainer.model, rows, metrics)
        outputs.finish(trainer, metrics, args)
        return metrics
'''
TOY_ROW = Stage("toy", "toy:ToyRecipe", "supervised", token_loss=True, eval_metrics=("loss",))
TOY_CONFIG = {
    "model_name_or_path": "tiny", "stage": "toy", "finetuning_type": "full", "template": "chatml",
    "dataset": "demo_sort", "max_samples": 24, "val_size": 4, "cutoff_len": 64, "per_device_train_batch_size": 4,
    "per_device_eval_batch_size": 4, "max_steps": 2, "logging_steps": 1, "eval_generation": True,
    "eval_generation_samples": 2, "max_new_tokens": 4, "report_to": "none", "bf16": False,
    "disable_tqdm": True, "plot_loss": False,
}


@pytest.fixture
def toy_stage(tmp_path, monkeypatch) -> Path:
    """The toy stage added the documented way for the test's duration: its module, its row. Returns its config."""
    module_dir = tmp_path / "stages"
    module_dir.mkdir()
    (module_dir / "toy.py").write_text(TOY_MODULE, encoding="utf-8")
    monkeypatch.setattr(tunelab.train.stages, "__path__", [*tunelab.train.stages.__path__, str(module_dir)])
    importlib.invalidate_caches()
    monkeypatch.setattr(stages, "STAGES", (*stages.STAGES, TOY_ROW))
    names = tuple(row.name for row in stages.STAGES)
    monkeypatch.setattr(stages, "STAGE_NAMES", names)
    monkeypatch.setattr(config_args, "STAGE_NAMES", names)  # FinetuningArguments.stage: Literal[STAGE_NAMES]
    config = tmp_path / "toy.yaml"
    config.write_text(yaml.safe_dump({**TOY_CONFIG, "output_dir": str(tmp_path / "run")}), encoding="utf-8")
    yield config
    sys.modules.pop("tunelab.train.stages.toy", None)


def run_cleanly(argv: list[str], capsys) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"tunelab {' '.join(argv[:2])}: {err or out}"
    assert "Traceback" not in out + err
    return out + err


def test_the_toy_row_names_its_recipe(toy_stage):
    recipe = getattr(importlib.import_module(stage_row("toy").recipe_module), stage_row("toy").recipe_class)
    assert recipe.stage == "toy" and recipe.__module__ == "tunelab.train.stages.toy"


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_a_toy_stage_runs_through_the_commands_of_a_real_one(toy_stage, tmp_path, capsys):
    run_cleanly(["data", "stats", str(toy_stage)], capsys)
    run_cleanly(["estimate", str(toy_stage), "--probe-steps", "0"], capsys)
    out = run_cleanly(["train", str(toy_stage)], capsys)
    results = json.loads((tmp_path / "run" / "all_results.json").read_text(encoding="utf-8"))
    # The toy's own held-out metric, logged beside the shared exact match before → after.
    assert {"exact_match_before", "exact_match_after", "answer_chars_before", "answer_chars_after"} <= set(results)
    assert "exact match (held-out)" in out


def test_the_table_is_itself_again_after_the_toy():
    assert "toy" not in stages.STAGE_NAMES and "toy" not in config_args.STAGE_NAMES
    assert all(row.name != "toy" for row in stages.STAGES) and "tunelab.train.stages.toy" not in sys.modules
