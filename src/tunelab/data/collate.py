"""Batches from encoded examples: the only place padding happens.

Supervised batches are padded on the right to the longest example (optionally rounded up to a
multiple of `pad_to_multiple_of`): input_ids with the pad id, labels with -100, attention_mask 0.

    input_ids       labels               attention_mask
    [a b c d e]     [-100 -100 c d e]    [1 1 1 1 1]
    [f g h P P]     [-100 g h -100 -100] [1 1 1 0 0]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tunelab.data.encode import IGNORE_INDEX


@dataclass
class SupervisedCollator:
    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(e["input_ids"]) for e in examples)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = len(examples)
        input_ids = torch.full((batch, longest), self.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, longest), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((batch, longest), dtype=torch.long)
        for row, example in enumerate(examples):
            n = len(example["input_ids"])
            input_ids[row, :n] = torch.as_tensor(example["input_ids"], dtype=torch.long)
            labels[row, :n] = torch.as_tensor(example["labels"], dtype=torch.long)
            attention_mask[row, :n] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
