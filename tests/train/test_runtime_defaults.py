"""Start-up defaults that avoid the classic DataLoader and OS traps (seed 000 §5.1)."""

from __future__ import annotations

import errno
import resource

import pytest
import yaml

from tunelab.cli import main
from tunelab.preflight import load_config
from tunelab.train.open_files import raise_open_file_limit
from tunelab.train.run import explain_os_error


def config(tmp_path, **extra):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"dataset": "demo_sort", "template": "chatml", "output_dir": str(tmp_path / "o"), **extra}))
    return load_config(path)


def test_dataloader_defaults(tmp_path):
    plain = config(tmp_path).training
    assert plain.dataloader_persistent_workers is False and plain.dataloader_pin_memory is False  # no CUDA here
    assert plain.prediction_loss_only is True  # eval never hoards logits
    workers = config(tmp_path, dataloader_num_workers=2).training
    assert workers.dataloader_persistent_workers is True
    explicit = config(tmp_path, dataloader_num_workers=2, dataloader_persistent_workers=False).training
    assert explicit.dataloader_persistent_workers is False


def test_open_file_limit_is_raised_to_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        lowered = min(256, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
        old, new = raise_open_file_limit()
        assert old == lowered
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == new == (hard if hard != resource.RLIM_INFINITY else new)
        assert new > lowered
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_os_errors_become_one_line_fixes(monkeypatch, capsys):
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert explain_os_error(OSError(errno.EMFILE, "Too many open files")) == (
        f"too many open files (limit {soft}): raise it with `ulimit -n 65536` before the run, "
        "or lower dataloader_num_workers (0 passes batches without descriptors) / preprocessing_num_workers"
    )
    assert explain_os_error(OSError(errno.EACCES, "denied")) is None

    def exhausted(ns):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr("tunelab.cli._cmd_env", exhausted)
    assert main(["env"]) == 2
    assert capsys.readouterr().err.startswith("tunelab: error: too many open files (limit ")


@pytest.mark.slow
def test_eval_sets_are_not_shuffled(tmp_path):
    from tunelab.data.collate import SupervisedCollator
    from tunelab.train.trainer import TunelabTrainer
    import datasets
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    rows = datasets.Dataset.from_list([{"input_ids": [i + 1, i + 2], "labels": [-100, i + 2]} for i in range(10)])
    args = config(tmp_path).training
    trainer = TunelabTrainer(model=model, args=args, train_dataset=rows, eval_dataset=rows, data_collator=SupervisedCollator(0))
    order = [int(x) for batch in trainer.get_eval_dataloader() for x in batch["input_ids"][:, 0]]
    assert order == list(range(1, 11))
