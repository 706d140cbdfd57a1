"""The stage table: one row per training stage, holding every property the layers branch on.

A stage's name is spelled here and in its own module under train/stages/ (tests/config/test_stage_table.py holds
the rest of src/ to that); every other module asks the row: `stage_row(name).reads == "text"`, `row.rl`. A leaf
module: the recipe is named by a dotted path that train/recipe.py imports when a command needs it.

Adding a stage: a row here, its recipe module under train/stages/ (a subclass of one of train/recipe.py's bases),
its losses, its tests and its docs (docs/architecture.md, "Adding a stage").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tunelab.config.applicability import Applies

# What a stage's rows are (data/): conversations with an answer, raw documents, chosen/rejected pairs, single
# examples tagged desirable or not (each with a mismatched KL example), prompts whose answers are sampled.
Reads = Literal["supervised", "text", "pairwise", "unpaired", "prompts"]
# When the stage compares with a reference model: never, always, unless pref_loss is reference-free, while kl_coef > 0.
Reference = Literal["never", "always", "pref_loss", "kl_coef"]
# The preference losses that need no reference model (train/preference_losses.py).
REFERENCE_FREE_LOSSES = ("orpo", "simpo")


@dataclass(frozen=True)
class Stage:
    name: str
    recipe: str  # "module:Class" under tunelab.train.stages, imported by train/recipe.py's recipe_for
    reads: Reads
    # Trains the token cross-entropy in transformers' Trainer (label smoothing, token accuracy, qat); `tunelab
    # estimate` reads its rows. The other stages are counted as single sequences of cutoff_len.
    token_loss: bool
    eval_metrics: tuple[str, ...]  # the eval metric names it logs (after the eval[_<name>] prefix)
    reference: Reference = "never"
    # Samples answers and trains in its own loop (train/rl/): no Trainer, so no checkpoints, callbacks, evaluations.
    rl: bool = False
    scorer: Literal["", "reward_functions", "reward_model"] = ""  # what scores an RL stage's samples
    head: Literal["", "reward", "value"] = ""  # a scalar head beside (value) or instead of (reward) the lm head
    teacher: bool = False  # learns a frozen teacher model's next-token distributions (teacher_model_name_or_path)
    cpu_fsdp: bool = False  # its Trainer runs a model sharded at load on CPU (model/sharding.py)
    vision: bool = False  # trains vision-language models
    neftune: str = ""  # why neftune_noise_alpha does not act in it ("": it acts)

    @property
    def pairs(self) -> bool:
        """Trains on two sequences per row (chosen / rejected; unpaired: the example and its KL example)."""
        return self.reads in ("pairwise", "unpaired")

    @property
    def recipe_module(self) -> str:
        return f"tunelab.train.stages.{self.recipe.partition(':')[0]}"

    @property
    def recipe_class(self) -> str:
        return self.recipe.partition(":")[2]


_PAIR_METRICS = ("loss", "rewards/chosen", "rewards/rejected")
_REFERENCE_NOISE = "would noise its reference pass too (LoRA: the reference is the policy with the adapter off)"
_OWN_LOOP = "trains in its own loop, which adds no noise"

STAGES: tuple[Stage, ...] = (
    Stage("pt", "pt:PretrainRecipe", "text", token_loss=True, eval_metrics=("loss", "perplexity"), cpu_fsdp=True),
    Stage("sft", "sft:SFTRecipe", "supervised", token_loss=True, eval_metrics=("loss", "perplexity"), cpu_fsdp=True,
          vision=True),
    Stage("rm", "rm:RewardModelRecipe", "pairwise", token_loss=False, head="reward",
          eval_metrics=("loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected"),
          neftune="trains a reward head, not generation"),
    Stage("dpo", "dpo:DPORecipe", "pairwise", token_loss=False, reference="pref_loss", vision=True,
          eval_metrics=(*_PAIR_METRICS, "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected",
                        "logps/accuracies"),
          neftune=_REFERENCE_NOISE),
    Stage("kto", "kto:KTORecipe", "unpaired", token_loss=False, reference="always", eval_metrics=(*_PAIR_METRICS, "kl"),
          neftune=_REFERENCE_NOISE),
    Stage("grpo", "grpo:GRPORecipe", "prompts", token_loss=False, reference="kl_coef", rl=True,
          scorer="reward_functions", eval_metrics=("loss",), neftune=_OWN_LOOP),
    Stage("ppo", "ppo:PPORecipe", "prompts", token_loss=False, reference="kl_coef", rl=True, scorer="reward_model",
          head="value", eval_metrics=("loss",), neftune=_OWN_LOOP),
    Stage("kd", "kd:DistillationRecipe", "supervised", token_loss=False, teacher=True, eval_metrics=("loss",)),
)
STAGE_NAMES = tuple(row.name for row in STAGES)
DEFAULT_STAGE = "sft"


def stage_row(name: str) -> Stage:
    """The row of stage `name` (a name the config loader has already checked against STAGE_NAMES). Read from STAGES
    on each call, as names_where is: a row added to the table (tests/train/test_adding_a_stage.py) needs no index."""
    return next(row for row in STAGES if row.name == name)


def names_where(test: Callable[[Stage], bool]) -> tuple[str, ...]:
    return tuple(row.name for row in STAGES if test(row))


def applies_where(test: Callable[[Stage], bool], grouped: bool = False) -> Applies:
    """An option's `applies` rule (config/applicability.py): it acts in the stages whose row passes `test`."""
    return Applies("stage", names_where(test), grouped=grouped)


def uses_reference(finetuning) -> bool:
    """Whether the run's stage compares with a reference model under its options (FinetuningArguments)."""
    rule = stage_row(finetuning.stage).reference
    return (rule == "always" or (rule == "pref_loss" and finetuning.pref_loss not in REFERENCE_FREE_LOSSES)
            or (rule == "kl_coef" and bool(finetuning.kl_coef)))
