"""Reward models as stage rm saves them, and loading them back for scoring (ppo, evaluation).

Format (what `tunelab train` with stage: rm writes to output_dir):
- full / freeze: a transformers sequence-classification model with one label (e.g.
  LlamaForSequenceClassification, head `score`, `pad_token_id` in its config), loadable with
  `AutoModelForSequenceClassification.from_pretrained(output_dir)`;
- lora: a peft adapter (task_type SEQ_CLS) whose `modules_to_save` holds the head; its
  adapter_config.json names the base in `base_model_name_or_path` (a folder, or a Hub id with its
  commit in `revision`).
Both folders hold the tokenizer with the chat template the reward model was trained with.

The reward of a sequence is the head's score at its last non-pad token (transformers' own pooling
for sequence classification): score the full template render of the conversation, answer included
(what `tokenizer.apply_chat_template(messages, tokenize=False)` gives for the saved template),
right-padded with the tokenizer's pad token.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tunelab.errors import ModelError, first_line
from tunelab import hub


def load_reward_model(
    path_or_dir: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device | None = None,
    merge_adapter: bool = True, allow_pickle_weights: bool = False,
) -> nn.Module:
    """A stage-rm reward model from its output folder, frozen and in eval mode.

    path_or_dir: a full reward model folder (config.json + weights), or a LoRA adapter folder
    (adapter_config.json; its base_model_name_or_path is loaded as the backbone and the adapter, head
    included, on top). merge_adapter folds the adapter into the weights, so a plain
    `...ForSequenceClassification` comes back either way (False keeps the PeftModel). dtype: e.g.
    torch.bfloat16 (default: the saved dtype); device: where to put it (default: CPU). A Hub id (or a base
    named by one) comes from the Hugging Face cache (tunelab/hub.py); pickle weights only with allow_pickle_weights.

        model = load_reward_model("saves/tiny-rm")
        rewards = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)   # (batch,)
    """
    path = Path(hub.resolve_model(str(path_or_dir), "reward_model", allow_pickle=allow_pickle_weights))
    hub.fetch_weights(path, allow_pickle_weights, "reward_model")
    # use_kernels=False: no Hub kernels fetched behind the caller's back (model/load.py says why)
    kwargs = {"num_labels": 1, "use_kernels": False} | ({"dtype": dtype} if dtype is not None else {})
    try:
        if (path / "adapter_config.json").is_file():
            from peft import PeftModel  # lazy: peft (7.8 s): stage ppo's recipe imports this module for `tunelab data`

            adapter_config = json.loads((path / "adapter_config.json").read_text())
            base = hub.resolve_model(
                adapter_config["base_model_name_or_path"], f"{path}/adapter_config.json: base_model_name_or_path",
                adapter_config.get("revision") or "main", allow_pickle=allow_pickle_weights,
                revision_key=f"{path}/adapter_config.json: revision",
            )
            hub.fetch_weights(base, allow_pickle_weights, f"{path}: base_model_name_or_path")
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForSequenceClassification.from_pretrained(base, pad_token_id=tokenizer.pad_token_id, **kwargs)
            model = PeftModel.from_pretrained(model, str(path))
            if merge_adapter:
                model = model.merge_and_unload()
        elif (path / "config.json").is_file():
            model = AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
        else:
            raise ModelError(f"{path}: neither a reward model (config.json) nor an adapter (adapter_config.json)")
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001  (missing files, unknown architecture, a base that moved)
        raise ModelError(f"{path}: cannot load the reward model: {first_line(exc)}") from exc
    if model.config.pad_token_id is None:
        raise ModelError(f"{path}: the reward model's config has no pad_token_id; set it to the tokenizer's pad id")
    if device is not None:
        model = model.to(device)
    model.requires_grad_(False)
    return model.eval()


def sequence_rewards(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(batch,) rewards: the reward head's score at each row's last non-pad token."""
    return model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1).float()
