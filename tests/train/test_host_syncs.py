"""What TunelabTrainer reads back from the device per training step, counted against plain transformers.Trainer.

On a GPU every scalar read (`.item()`, `int(t)`, `float(t)`, `bool(t)`) waits for the device; all of them go
through torch's `aten._local_scalar_dense`, which a dispatch mode sees on CPU as well. Per optimizer step, tunelab
may add exactly one (the non-finite guard's verdict, taken before the optimizer step: train/guards.py); token counts
and everything else are read only on logging steps.
"""

from __future__ import annotations

import collections

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from tunelab.assets import TINY_MODEL_DIR
from tunelab.train.trainer import TunelabTrainer


class ScalarReads(TorchDispatchMode, transformers.TrainerCallback):
    """Counts device→host scalar reads by optimizer step: from the step's first micro-batch to the next step's
    (so a step's logging counts in its own step)."""

    def __init__(self) -> None:
        super().__init__()
        self.step: int | None = None
        self.by_step: collections.Counter = collections.Counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and self.step is not None:
            self.by_step[self.step] += 1
        return func(*args, **(kwargs or {}))


class Rows(torch.utils.data.Dataset):
    """Fully supervised rows of random ids (pt-like), as plain tensors."""

    def __init__(self, n: int, length: int, vocab: int):
        self.ids = torch.randint(3, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone(), "attention_mask": torch.ones_like(self.ids[i])}


def reads_per_step(cls, tmp_path, steps: int = 4, logging_steps: int = 2, accumulation: int = 2) -> dict[int, int]:
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(TINY_MODEL_DIR)
    config.num_hidden_layers, config.use_cache = 1, False
    model = transformers.AutoModelForCausalLM.from_config(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / cls.__name__), max_steps=steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation, logging_steps=logging_steps, save_strategy="no", report_to="none",
        use_cpu=True, disable_tqdm=True, remove_unused_columns=False,
    )
    mode = ScalarReads()
    trainer = cls(model=model, args=args, train_dataset=Rows(2 * accumulation * steps, 16, config.vocab_size),
                  data_collator=transformers.default_data_collator, callbacks=[mode])
    with mode:
        trainer.train()
    return {step: mode.by_step[step] for step in range(1, steps + 1)}


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_a_training_step_reads_the_device_once_more_than_plain_transformers(tmp_path) -> None:
    plain = reads_per_step(transformers.Trainer, tmp_path)
    ours = reads_per_step(TunelabTrainer, tmp_path)
    logging = {2, 4}
    # Between log lines: the guard's verdict, once per optimizer step (two micro-batches each), nothing else.
    assert {s: ours[s] - plain[s] for s in plain if s not in logging} == {1: 1, 3: 1}
    # Logging steps read the counts too (and the Trainer its loss and grad norm, as it does anyway).
    assert all(ours[s] > plain[s] for s in logging)
