"""The model and adapter folders a config names, resolved and checked before any weights load.

A Hub id becomes its folder in the Hugging Face cache (tunelab/hub.py: everything but the weights now, the weights
when the model loads), so every later step reads a local folder. The folder must be a Hugging Face model folder
(config.json) or a GGUF file (model/gguf.py); a model whose architecture is only Python code shipped beside it runs only with
trust_remote_code; an adapter folder needs its adapter_config.json, and its weights (megabytes) come now.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from tunelab import hub
from tunelab.config.args import ModelArguments
from tunelab.errors import ConfigError
from tunelab.model import gguf
from tunelab.run_folder import TrainedFolder


def resolve_model_folders(model: ModelArguments) -> tuple[str, str | None]:
    """(model folder or GGUF file, adapter folder or None) of the options, every Hub id resolved; ConfigError naming
    the key."""
    if model.gguf_file or gguf.is_gguf(model.model_name_or_path):
        model_folder = resolve_gguf_file(model)
    else:
        model_folder = hub.resolve_model(
            model.model_name_or_path, "model_name_or_path", model.model_revision,
            trust_remote_code=model.trust_remote_code, allow_pickle=model.allow_pickle_weights,
        )
        path = Path(model_folder)
        if not path.is_dir():
            raise ConfigError(
                f"model_name_or_path: {path} is not a folder; point it at a local Hugging Face model folder"
            )
        if not (path / "config.json").is_file():
            raise ConfigError(f"model_name_or_path: {path} has no config.json; is it a complete Hugging Face model folder?")
        check_remote_code(path / "config.json", model.trust_remote_code)
    adapter = None
    if model.adapter_name_or_path:
        adapter = hub.resolve_model(model.adapter_name_or_path, "adapter_name_or_path", allow_pickle=model.allow_pickle_weights)
    if adapter and not (Path(adapter) / "adapter_config.json").is_file():
        raise ConfigError(f"adapter_name_or_path: {adapter} has no adapter_config.json")
    if adapter:
        hub.fetch_weights(adapter, model.allow_pickle_weights, "adapter_name_or_path")  # megabytes: now, not later
        base, _ = TrainedFolder(Path(adapter)).base
        if gguf.is_gguf(base) and not gguf.is_gguf(model_folder):  # e.g. the default 'tiny' left in place
            raise ConfigError(f"model_name_or_path: the adapter {adapter} was trained on the GGUF file {base}; set "
                              f"model_name_or_path to that file (now {model.model_name_or_path})")
    return model_folder, adapter


def resolve_gguf_file(model: ModelArguments) -> str:
    """The GGUF file the options name: model_name_or_path itself, or gguf_file inside its folder or Hub repo (fetched
    into the Hugging Face cache now: its tokenizer is needed before any weights are); checked readable."""
    source, name = model.model_name_or_path, model.gguf_file
    if name is None:
        file = Path(source).expanduser()
    elif Path(source).expanduser().is_dir():
        file = Path(source).expanduser() / name
    elif hub.is_repo_id(source):
        file = hub.fetch_file(source, name, model.model_revision, f"model_name_or_path: {source} (gguf_file: {name})")
    else:
        raise ConfigError(f"model_name_or_path: {source} is neither a folder nor a Hub id (org/name) holding gguf_file "
                          f"{name}")
    if not file.is_file():
        others = sorted(p.name for p in file.parent.glob("*.gguf")) if file.parent.is_dir() else []
        found = f"; the folder holds {', '.join(others)}" if others else ""
        raise ConfigError(f"{'gguf_file' if name else 'model_name_or_path'}: {file} is not a file{found}")
    gguf.check_readable(file)
    return str(file)


def check_remote_code(config_json: Path, trust_remote_code: bool) -> None:
    """A folder whose architecture exists only as Python files shipped beside its weights (config.json
    auto_map, a model_type transformers does not know) runs that code when loaded: only when asked."""
    try:
        model_config = json.loads(config_json.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"model_name_or_path: {config_json} is not valid JSON ({exc}); the folder is damaged") from None
    auto_map = model_config.get("auto_map") if isinstance(model_config, dict) else None
    if auto_map and not trust_remote_code and model_config.get("model_type") not in CONFIG_MAPPING_NAMES:
        code = sorted({str(v).split("--")[-1].split(".")[0] + ".py" for v in auto_map.values() if isinstance(v, str)})
        raise ConfigError(
            f"model_name_or_path: {config_json.parent} needs its own modelling code ({', '.join(code)}), which tunelab "
            "runs only with trust_remote_code: true; read that code first, then set trust_remote_code: true"
        )


def resolve_reward_model(path: str | None, allow_pickle: bool) -> str:
    """Stage ppo's reward model folder (a Hub id resolved to its cache folder, weights fetched when ppo loads it)."""
    if not path:
        raise ConfigError(
            "reward_model: stage ppo needs a reward model; train one with stage: rm and set reward_model to its output_dir"
        )
    path = hub.resolve_model(path, "reward_model", allow_pickle=allow_pickle)
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"reward_model: {folder} is not a folder; set it to the output_dir of a stage rm run")
    if not (folder / "config.json").is_file() and not (folder / "adapter_config.json").is_file():
        raise ConfigError(
            f"reward_model: {folder} has neither config.json nor adapter_config.json; set it to the output_dir of a stage rm run"
        )
    return path


def is_sequence_classification(model_args: ModelArguments) -> bool:
    """A reward model: the adapter says task_type SEQ_CLS, or the base model is a *ForSequenceClassification."""
    adapter = model_args.adapter_name_or_path
    if adapter:
        adapter_config = json.loads((Path(adapter) / "adapter_config.json").read_text(encoding="utf-8"))
        if adapter_config.get("task_type") == "SEQ_CLS":
            return True
    if gguf.is_gguf(model_args.model_name_or_path):
        return False  # a GGUF holds a causal LM
    config = json.loads((Path(model_args.model_name_or_path) / "config.json").read_text(encoding="utf-8"))
    return any(name.endswith("ForSequenceClassification") for name in config.get("architectures") or [])
