"""The training options a run trains with: transformers.TrainingArguments plus tunelab's TrainingOptions.

Its own module because importing transformers' training arguments imports peft (and bitsandbytes through it): the
loader imports it only for the commands that train (config/args.py `training_group`), so `tunelab data` does not pay.
"""

from __future__ import annotations

from dataclasses import dataclass

import transformers

from tunelab.config.training_options import TrainingOptions


@dataclass
class TrainingArguments(TrainingOptions, transformers.TrainingArguments):
    """transformers.TrainingArguments with tunelab's options; where both name one (overwrite_output_dir,
    resume_from_checkpoint) tunelab's definition wins (dataclass fields: the first base overrides)."""
