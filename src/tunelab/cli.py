"""The `tunelab` command: train | data | template | eval | export | estimate | chat | api | webui | env.

train, data, eval, export and estimate take a YAML file and/or key=value / --key value options (options
alone work too, TRL-style); chat and api take a model or adapter folder, or a YAML file naming
model_name_or_path, adapter_name_or_path and template (LlamaFactory's inference configs).
Every option of every command reads in three spellings, anywhere on the line: key=value (LlamaFactory's),
--key_name value / --key_name=value, and --key-name value (_CommandParser); an unknown one is one line that
names the closest known spelling.
Errors that the user can fix (tunelab.errors.TunelabError) print as one line and exit 2;
anything else is a bug and keeps its traceback. `data verify` exits 1 when a batch fails a check.
A training run stopped by SIGTERM / SIGINT saves a checkpoint, prints the command that resumes it
and exits 128 + the signal number (143 / 130); resuming a run that already reached its last step says so
and exits 0 without changing anything.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import enum
import logging
import os
import re
import sys
import types
import typing
import warnings

from tunelab.errors import ConfigError, TemplateError, TrainingError, TunelabError
from tunelab.infer.sampling import SamplingOptions

# Each command imports its own modules when it runs (the `# lazy: command dispatch` blocks below), down to json and
# pathlib: `tunelab --help` imports nothing it does not print. Importing them here would make it pay for preflight's
# torch, datasets and transformers and the training stack (docs/benchmarks.md, "Start-up: imports at the top").


def _choices(annotation, metadata) -> list[str]:
    """The values an option takes, when it is a choice: Literal members, an enum's values, or transformers'
    own `choices` metadata."""
    if metadata.get("choices"):
        return [str(c) for c in metadata["choices"]]
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
    for member in members:
        if typing.get_origin(member) is typing.Literal:
            return [str(value) for value in typing.get_args(member)]
        if isinstance(member, type) and issubclass(member, enum.Enum):
            return [str(item.value) for item in member]
    return []


def _options_help() -> str:
    """Every option with its default (tunelab's where it changes transformers') and, for choices, the values."""
    # lazy: only `train --help` builds this text; TrainingArguments imports peft (and bitsandbytes)
    from tunelab.config.args import option_groups
    from tunelab.config.training_options import TRAINING_DEFAULTS, TRAINING_NOTES, TrainingOptions
    from tunelab.config.training_args import TrainingArguments
    from tunelab.config.loader import ALIASES, PRECISION_KEYS

    lines = ["options (in the YAML file, or as key=value / --key value; later wins):"]
    for group in option_groups("train"):
        hints = typing.get_type_hints(group)
        ours = {f.name for f in dataclasses.fields(TrainingOptions)}
        theirs = {f.name for f in dataclasses.fields(group)} - ours if group is TrainingArguments else set()
        lines.append(f"\n  {group.__name__}:")
        if group is TrainingArguments:
            lines.append("    transformers.TrainingArguments (first sentence of its help; defaults tunelab changes are "
                         f"marked), plus tunelab's own. Also accepted: {', '.join(f'{a} (= {b})' for a, b in ALIASES.items())}")
        for f in dataclasses.fields(group):
            if not f.init or f.name.startswith("_"):
                continue
            if f.name in TRAINING_DEFAULTS and group is TrainingArguments:
                default = f"tunelab default {TRAINING_DEFAULTS[f.name]!r}"
            elif f.name in PRECISION_KEYS and group is TrainingArguments:
                default = "tunelab default 'auto'"
            else:
                value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                default = f"default {getattr(value, 'value', value)!r}"
            text = " ".join(str(f.metadata.get("help", "")).split())
            if f.name in theirs:  # transformers' help runs to paragraphs
                text = text.split(". ")[0].rstrip(".") + "." if text else ""
                text = f"{text} {TRAINING_NOTES[f.name]}" if f.name in TRAINING_NOTES else text
            choices = _choices(hints.get(f.name), f.metadata)
            choice_text = f"; one of {', '.join(choices)}" if choices else ""
            lines.append(f"    {f.name} ({default}{choice_text}): {text}")
    return "\n".join(lines)


def _cmd_train(ns: argparse.Namespace) -> int:
    # lazy: command dispatch
    from tunelab.train import launch

    launch.check_node_shares()  # a torchrun worker whose nodes brought unequal shares: stop before the heavy imports
    # lazy: command dispatch, after the check above (a worker that stops there imports no torch)
    from tunelab.log import setup_logging
    from tunelab.preflight import plan_run
    from tunelab.train.recipe import recipe_for
    from tunelab.train.run import run
    from tunelab.train.checkpoints import NothingToTrain
    from tunelab.train.oom import is_out_of_memory, out_of_memory_message
    from tunelab.train.signals import TrainingInterrupted

    path, overrides = _config_and_overrides(ns)
    # nproc_per_node > 1: check the config once here, then run the same command under torchrun.
    parent = launch.wants_launch(path, overrides)
    with launch.one_thread() if parent else contextlib.nullcontext():  # the workers are forked from here
        with launch.devices_untouched() if parent else contextlib.nullcontext():
            plan = plan_run(path, overrides, warn=not parent)  # the workers warn, once
        config = plan.config
        if launch.needs_launch(config.training):
            return launch.launch(config.training, ["train", *([path] if path else []), *overrides])
    setup_logging(config.training.process_index == 0)
    out_of_memory = None
    try:
        metrics = run(plan)
    except TrainingInterrupted as stop:  # SIGTERM / SIGINT: a checkpoint was saved (train/signals.py)
        launch.end_process_group()  # every rank saved the same step and stops there
        if config.training.process_index == 0:
            print(f"tunelab: {stop}; resume with: {resume_command(path, overrides)}", file=sys.stderr)
        return stop.exit_code
    except NothingToTrain as done:  # resuming a finished run: nothing changed, and that is not a failure
        if config.training.process_index == 0:
            print(f"tunelab: {done}", file=sys.stderr)
        return 0
    except Exception as exc:
        lost = launch.lost_peer_message(exc, config.training)
        if lost is not None:
            raise TrainingError(lost) from None
        if not is_out_of_memory(exc):
            raise
        out_of_memory = str(exc)
    else:
        launch.end_process_group()
    if out_of_memory is not None:  # outside the handler: the failed step's tensors are released by now
        raise TrainingError(out_of_memory_message(config, out_of_memory))
    if config.training.process_index == 0:
        print("\n".join(recipe_for(plan).summary(metrics)))
    return 0


def resume_command(config_path: str | None, overrides: list[str]) -> str:
    """The command line that resumes this run: the same config and overrides, resume_from_checkpoint=true."""
    # lazy: command dispatch (train's)
    import shlex

    from tunelab.config.loader import parse_overrides

    kept = [f"{k}={v}" for k, v in parse_overrides(list(overrides)).items() if k != "resume_from_checkpoint"]
    return shlex.join(["tunelab", "train", *([config_path] if config_path else []), *kept, "resume_from_checkpoint=true"])


def _cmd_data(ns: argparse.Namespace) -> int:
    # lazy: command dispatch
    from pathlib import Path

    from tunelab.data import coverage, stats, verify
    from tunelab.log import setup_logging
    from tunelab.preflight import plan_run
    from tunelab.train.recipe import recipe_for

    path, overrides = _config_and_overrides(ns)
    out, max_batches = ns.out, ns.max_batches
    plan = plan_run(path, overrides, purpose="data")
    setup_logging(is_main_process=False)  # warnings only: the report below is the output
    data = recipe_for(plan).inspection()
    if ns.action == "stats":
        lines = stats.stats_report(data, Path(out) if out else stats.default_stats_dir(plan.config.training.output_dir))
    elif ns.action == "verify":
        problem, lines = verify.verify_report(data, max_batches)
        if problem:
            print(f"tunelab: verify failed: {problem}", file=sys.stderr)
            return 1
    else:
        lines = coverage.coverage_report(data)
    print("\n".join(lines))
    return 0


def _cmd_template(ns: argparse.Namespace) -> int:
    # lazy: command dispatch
    import json

    from tunelab.data.templates import TEMPLATE_ALIASES, TEMPLATE_NAMES, get_template, resolve_template_name

    if ns.action == "list" or not ns.name:
        print("\n".join(TEMPLATE_NAMES))
        # LlamaFactory's names, on stderr so that stdout stays one built-in name per line
        for alias, (builtin, variables, what) in TEMPLATE_ALIASES.items():
            implied = f" with template_kwargs {json.dumps(variables)}" if variables else ""
            print(f"alias {alias} = {builtin}{implied}: {what}", file=sys.stderr)
        return 0
    name, variables = resolve_template_name(ns.name)
    template = get_template(name)
    system = {"role": "system", "content": "You are a helpful assistant."}
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    tokens = {"bos_token": "<s>", "eos_token": "</s>", **(variables or {})}
    try:
        examples = template.training_examples([system, *messages], **tokens)
    except TemplateError:  # e.g. Gemma-2 refuses a system turn: show the rest
        examples = template.training_examples(messages, **tokens)
        print(f"note: '{ns.name}' refuses a system message, so the example has none", file=sys.stderr)
    if len(examples) > 1:
        print(f"'{ns.name}' renders earlier turns differently once later ones follow, so each answer trains "
              "in its own example: the conversation up to that answer")
    for number, (text, spans) in enumerate(examples, 1):
        if len(examples) > 1:
            print(f"--- example {number} of {len(examples)} ---")
        out, last = [], 0
        for start, end in spans:  # supervised spans shown between ⟦ ⟧
            out += [text[last:start], "⟦", text[start:end], "⟧"]
            last = end
        out.append(text[last:])
        print("".join(out))
    return 0


# ---- eval | export | estimate: a trained (or base) model without training it ------------------------------


def _config_and_overrides(ns: argparse.Namespace) -> tuple[str | None, list[str]]:
    """A config file and/or options (train, data, eval, export, estimate): a first argument with '=' or '--' is an
    option, so `tunelab train model_name_or_path=tiny dataset=demo_sort ...` needs no YAML file."""
    if ns.config is not None and ("=" in ns.config or ns.config.startswith("--")):
        return None, [ns.config, *ns.overrides]
    return ns.config, list(ns.overrides)


def _cmd_eval(ns: argparse.Namespace) -> int:
    # lazy: command dispatch
    from tunelab.preflight import load_config
    from tunelab.infer.predict import run_predict
    from tunelab.run_folder import PREDICTIONS
    from tunelab.log import setup_logging

    path, overrides = _config_and_overrides(ns)
    config = load_config(path, overrides, purpose="eval")
    setup_logging()
    metrics = run_predict(config)
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    print(f"predictions: {config.training.output_dir}/{PREDICTIONS}")
    return 0


def _cmd_export(ns: argparse.Namespace) -> int:
    # lazy: command dispatch
    from tunelab.preflight import load_config
    from tunelab.export.merge import export_model
    from tunelab.export.parity import ParityError
    from tunelab.log import setup_logging

    path, overrides = _config_and_overrides(ns)
    if ns.check_only:  # the flag is the option export_check_only
        overrides = [*overrides, "export_check_only=true"]
    config = load_config(path, overrides, purpose="export")
    setup_logging()
    try:
        exported = export_model(config)
    except ParityError as exc:  # the measurements first, then the one line naming what differs (exit 2)
        print("\n".join(exc.report.lines() if exc.report else []))
        raise
    print(f"checked {exported.path}" if config.export.export_check_only else f"exported to {exported.path}")
    print("\n".join(exported.report.lines()) if exported.report else f"export check: skipped ({exported.unchecked})")
    return 0


def _cmd_estimate(ns: argparse.Namespace) -> int:
    # lazy: command dispatch
    from tunelab.preflight import load_config
    from tunelab.train.estimate import estimate, format_estimate
    from tunelab.log import setup_logging

    path, overrides = _config_and_overrides(ns)
    config = load_config(path, overrides, purpose="estimate")
    setup_logging(is_main_process=False)  # warnings only: the table below is the output
    print(format_estimate(estimate(config, probe_steps=ns.probe_steps)))
    return 0


def _add_model_commands(sub) -> None:
    evaluate = sub.add_parser(
        "eval", help="generate answers for an eval set with the training template and score them",
        description="Greedy generation on eval_dataset (or the val split) with the chat template the model trained "
        "with; writes predictions.jsonl and predict_results.json (exact match, BLEU, ROUGE-L) to output_dir. "
        "Point model_name_or_path at a trained model, or adapter_name_or_path at a trained adapter.",
    )
    evaluate.add_argument("config", nargs="?", help="the run's YAML file (optional: key=value options alone work too)")
    evaluate.add_argument("overrides", nargs=argparse.REMAINDER, help="key=value or --key value overrides")
    evaluate.set_defaults(func=_cmd_eval)
    export = sub.add_parser(
        "export", help="merge a LoRA adapter into its base and save a plain Hugging Face model or a GGUF, then check it",
        description="Needs model_name_or_path, export_dir and optionally adapter_name_or_path, export_format (hf or "
        "gguf), export_dtype, export_size, export_quantization (hf), export_gguf_type (gguf), export_parity, "
        "export_check_dataset, export_check_samples, export_check_max_drop (in a YAML file and/or as key=value). "
        "The export is read back (a GGUF also by llama.cpp, with the llamacpp extra) and compared with the model as "
        "trained, on held-out rows too when the run has them (export_report.json); it fails when they differ.",
    )
    export.add_argument("config", nargs="?", help="YAML file (optional: key=value options alone work too)")
    export.add_argument("--check-only", action="store_true",
                        help="write nothing: run the check on what an earlier export with these options wrote")
    export.add_argument("overrides", nargs=argparse.REMAINDER, help="key=value or --key value overrides")
    export.set_defaults(func=_cmd_export)
    estimate = sub.add_parser(
        "estimate", help="predict a run's peak memory and time per step (a few measured probe steps)",
        description="The whole process's peak memory (a measured baseline of libraries and data, plus weights, "
        "gradients, optimizer states and activations for the configured model, finetuning_type, dtype, batch size, "
        "longest row and gradient checkpointing), and the time per optimizer step measured over a few real steps "
        "on the run's first batches (random cutoff_len rows when the data is not read).",
    )
    estimate.add_argument("config", nargs="?", help="the run's YAML file (optional: key=value options alone work too)")
    estimate.add_argument("--probe-steps", type=int, default=3, help="measured optimizer steps (0: skip the probe)")
    estimate.add_argument("overrides", nargs=argparse.REMAINDER, help="key=value or --key value overrides")
    estimate.set_defaults(func=_cmd_estimate)


# ---- chat | api: talk to a trained model ----------------------------------------------------------------------


def _serving_choice(ns: argparse.Namespace) -> dict:
    """load_engine's arguments: from the folder and flags, or from a YAML file (model_name_or_path,
    adapter_name_or_path, template, template_kwargs, trust_remote_code) under the flags, which win."""
    # lazy: command dispatch (chat's and api's)
    import json
    from pathlib import Path

    from tunelab.preflight import load_config
    from tunelab.data.templates import resolve_template_name

    kwargs = None
    if ns.template_kwargs is not None:
        try:
            kwargs = json.loads(ns.template_kwargs)
        except json.JSONDecodeError:
            kwargs = None
        if not isinstance(kwargs, dict):
            raise ConfigError(
                f"--template-kwargs: expected a JSON object such as '{{\"enable_thinking\": false}}', got {ns.template_kwargs!r}"
            )
    choice = {"path": ns.path, "base_model": ns.model, "template": ns.template, "template_kwargs": kwargs,
              "trust_remote_code": ns.trust_remote_code}
    if Path(ns.path).is_file() and not ns.path.lower().endswith(".gguf"):  # a YAML naming model, adapter, template
        config = load_config(ns.path, purpose="serve")
        model, adapter = config.model.model_name_or_path, config.model.adapter_name_or_path
        choice["path"] = adapter or model
        choice["base_model"] = ns.model or (model if adapter else None)
        choice["template"] = ns.template or config.data.template
        choice["template_kwargs"] = kwargs if kwargs is not None else config.data.template_kwargs
        choice["trust_remote_code"] = ns.trust_remote_code or config.model.trust_remote_code
        if config.model.rope_scaling:  # (its rope_factor resolved by tunelab/preflight.py)
            choice["rope_scaling"] = (config.model.rope_scaling, config.model.rope_factor)
    choice["template"], choice["template_kwargs"] = resolve_template_name(choice["template"], choice["template_kwargs"])
    return choice


def _load_engine(ns: argparse.Namespace):
    # lazy: command dispatch (chat's and api's)
    import transformers

    from tunelab.infer.engine import load_engine
    from tunelab.log import setup_logging

    setup_logging(is_main_process=False)  # warnings only
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)  # peft, harmless
    return load_engine(dtype=ns.dtype, **_serving_choice(ns))


def _cmd_chat(ns: argparse.Namespace) -> int:
    from tunelab.infer.chat import chat_loop  # lazy: command dispatch

    options = SamplingOptions(**{f.name: getattr(ns, f.name) for f in _chat_sampling_fields()})
    engine = _load_engine(ns)
    if sys.stdin.isatty():
        import readline  # noqa: F401  # lazy: line editing and history for input(), at a terminal only
    return chat_loop(engine, options, system=ns.system)


def _cmd_api(ns: argparse.Namespace) -> int:
    try:
        from tunelab.infer.api import serve  # lazy: command dispatch; the serve extra
    except ImportError as exc:
        raise ConfigError(f"tunelab api needs FastAPI and uvicorn ({exc}); pip install 'tunelab[serve]'") from None

    api_key = ns.api_key or os.environ.get("TUNELAB_API_KEY") or None
    if ns.max_batch_size < 1:
        raise ConfigError(f"--max-batch-size: expected an integer >= 1, got {ns.max_batch_size}")
    if ns.max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes: expected an integer >= 1, got {ns.max_request_bytes}")
    engine = _load_engine(ns)
    key_note = "an API key is required" if api_key else "no API key"
    print(f"tunelab api: serving '{engine.name}' (template {engine.template.name}, {key_note}, "
          f"up to {ns.max_batch_size} requests per batch)", file=sys.stderr)
    serve(engine, host=ns.host, port=ns.port, api_key=api_key, max_batch_size=ns.max_batch_size,
          max_request_bytes=ns.max_request_bytes)
    return 0


# Where chat's default differs from SamplingOptions': an answer in the terminal stops after 1024 tokens, not at
# the end of the model's context.
_CHAT_DEFAULTS = {"max_new_tokens": 1024}


def _chat_sampling_fields() -> list[dataclasses.Field]:
    """The SamplingOptions fields chat takes as flags: those with a help text (stop strings are the API's)."""
    return [f for f in dataclasses.fields(SamplingOptions) if "help" in f.metadata]


def _add_serving_commands(sub) -> None:
    def model_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("path", help="a trained output folder (model or LoRA adapter), any local Hugging Face "
                            "model folder, a GGUF file (.gguf), 'tiny' (the embedded tiny Llama), 'tiny-vision' (the embedded tiny LLaVA), or a YAML file with model_name_or_path, "
                            "adapter_name_or_path and template (the flags below win over it)")
        parser.add_argument("--model", help="base model folder (or GGUF file) for an adapter (default: base_model_name_or_path "
                            "in its adapter_config.json)")
        parser.add_argument("--template", help="a built-in chat template instead of the folder's own chat_template "
                            "(see `tunelab template list`)")
        parser.add_argument("--template-kwargs", metavar="JSON", help="variables of the chat template, e.g. "
                            "'{\"enable_thinking\": false}' (default: those the trained folder recorded in its "
                            "tunelab_config.yaml)")
        parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                            help="weights dtype (auto: bfloat16 on a GPU that supports it, float16 on other GPUs, "
                            "float32 on CPU)")
        parser.add_argument("--trust-remote-code", action="store_true", help="run modelling code shipped in the folder")

    chat = sub.add_parser(
        "chat", help="chat with a model or adapter in the terminal (answers stream as they are generated)",
        description="One line per turn; a line ending in \\ continues on the next, and a line starting with \"\"\" "
        "opens a block of lines that the next line ending with \"\"\" closes (as in ollama run). /clear resets the "
        "history (the system prompt stays), /exit or Ctrl-D quits, Ctrl-C stops an answer. Reads stdin, so a script "
        "can drive it.",
    )
    model_arguments(chat)
    chat.add_argument("--system", help="system prompt for the whole conversation")
    for field in _chat_sampling_fields():  # type, default and help as SamplingOptions declares them
        hint = typing.get_type_hints(SamplingOptions)[field.name]
        kind = next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))  # int | None: int
        default = _CHAT_DEFAULTS.get(field.name, field.default)
        shown = "" if default is None else f"; default {default}"
        chat.add_argument(f"--{field.name.replace('_', '-')}", type=kind, default=default,
                          help=field.metadata["help"] + shown)
    chat.set_defaults(func=_cmd_chat)
    api = sub.add_parser(
        "api", help="serve a model or adapter over an OpenAI-compatible HTTP API",
        description="GET /v1/models, POST /v1/chat/completions (streaming with stream: true, tools). Concurrent "
        "requests are batched. See docs/serving.md.",
    )
    model_arguments(api)
    api.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    api.add_argument("--port", type=int, default=8000, help="port (0: any free port, printed at start)")
    api.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $TUNELAB_API_KEY; "
                     "none: no key)")
    api.add_argument("--max-batch-size", type=int, default=8, help="concurrent requests that share one forward "
                     "pass (1: one request at a time)")
    api.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024, help="larger request bodies are "
                     "refused with 413 before they are read (default 8 MiB)")
    api.set_defaults(func=_cmd_api)


def _cmd_webui(ns: argparse.Namespace) -> int:
    # lazy: command dispatch
    from pathlib import Path

    from tunelab.webui.security import Access, Roots, check_listen

    access = Access(user_password=ns.auth, token=ns.token or None)
    check_listen(ns.host, access)  # before anything heavy is imported
    roots = Roots.of(Path.cwd(), ns.root)
    try:
        from tunelab.webui.app import serve  # lazy: command dispatch; the webui extra
    except ImportError as exc:
        raise ConfigError(f"tunelab webui needs FastAPI and uvicorn ({exc}); pip install 'tunelab[webui]'") from None
    serve(ns.host, ns.port, roots, access)
    return 0


def _add_webui_command(sub) -> None:
    webui = sub.add_parser(
        "webui", help="a web UI to configure, launch, watch and try runs (binds 127.0.0.1; see docs/webui.md)",
        description="Serves a page on which to fill a run's config (checked as tunelab train checks it), preview "
        "its data, start and stop `tunelab train` processes, watch their curves and chat with, evaluate or export "
        "the result. Paths must lie in the current folder or a --root. Ctrl-C stops the UI, not the runs.",
    )
    webui.add_argument("--host", default="127.0.0.1", help="address to listen on; any but loopback needs --auth "
                       "or --token")
    webui.add_argument("--port", type=int, default=7860, help="port (0: any free port, printed at start)")
    webui.add_argument("--root", action="append", default=[], metavar="FOLDER", help="another folder whose models, "
                       "datasets and runs the UI may read and write (repeatable; the current folder always is one)")
    webui.add_argument("--auth", metavar="USER:PASSWORD", help="require HTTP Basic credentials")
    webui.add_argument("--token", help="require this token (Authorization: Bearer TOKEN, or ?token=TOKEN once)")
    webui.set_defaults(func=_cmd_webui)


def _cmd_env(_: argparse.Namespace) -> int:
    from tunelab.versions import versions  # lazy: command dispatch

    for key, value in versions().items():
        print(f"{key}: {value}")
    return 0


class _Parser(argparse.ArgumentParser):
    """An epilog given as a function is built only when the help is shown: train's lists every option, which
    imports transformers' TrainingArguments (and through it peft and bitsandbytes) — seconds that `tunelab
    template list` or `tunelab data --help` should not pay."""

    def format_help(self) -> str:
        if callable(self.epilog):
            self.epilog = self.epilog()
        return super().format_help()


# ---- the three spellings of an option ---------------------------------------------------------------------------

# `--key`, `-key`, `key=value`, `--key=value`: a name that could be an option's (a path or a value is not one).
_OPTION_WORD = re.compile(r"(--?)?([A-Za-z_][A-Za-z0-9_-]*)")
_TRUTH = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}
SPELLINGS_NOTE = ("Each option also reads as key=value (LlamaFactory's spelling) or --key_name value:\n"
                  "max_new_tokens=40, --max_new_tokens 40 and --max-new-tokens 40 are the same.")


def _option_word(word: str) -> tuple[str, str, str | None] | None:
    """(the name as typed, its key, the value after '=' or None) when `word` is spelled as an option:
    `--max-new-tokens` → ('--max-new-tokens', 'max_new_tokens', None), `max_new_tokens=40` → (.., .., '40')."""
    typed, equals, value = word.partition("=")
    match = _OPTION_WORD.fullmatch(typed)
    if match is None or not (match[1] or equals):  # a bare word is a path or a value
        return None
    return typed, match[2].replace("-", "_"), value if equals else None


def _respelled(key: str, typed: str) -> str:
    """`key` in the spelling of `typed`: max_new_tokens, --max_new_tokens or --max-new-tokens."""
    if not typed.startswith("-"):
        return key
    return "--" + (key if "_" in typed else key.replace("_", "-"))


def _argparse_words(action: argparse.Action, typed: str, value: str | None) -> list[str]:
    """One option as argparse reads it (`--max-new-tokens=40`), its value checked against the declared type and
    choices first, so that a wrong one is a one-line error that names the option as the user typed it."""
    flag = next(f for f in action.option_strings if f.startswith("--"))
    if action.nargs == 0:  # a switch: --trust-remote-code, or trust_remote_code=true|false
        if value is None:
            return [flag]
        if value.lower() not in _TRUTH:
            raise ConfigError(f"{typed}: expected true or false, got {value!r}")
        return [flag] if _TRUTH[value.lower()] == action.const else []
    if action.type is not None:
        try:
            checked = action.type(value)
        except ValueError:
            expected = "a number" if action.type in (int, float) else f"a {action.type.__name__}"
            raise ConfigError(f"{typed}: expected {expected}, got {value!r}") from None
    else:
        checked = value
    if action.choices is not None and checked not in action.choices:
        raise ConfigError(f"{typed}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return [f"{flag}={value}"]


class _CommandParser(_Parser):
    """A command's parser that reads each of its options in three spellings, anywhere on the line:
    `max_new_tokens=40` (LlamaFactory's), `--max_new_tokens 40` / `--max_new_tokens=40`, `--max-new-tokens 40`.

    The options are declared once, with add_argument (type, default, choices, help); before argparse reads the
    line, each option of the command is rewritten as argparse's `--max-new-tokens=40` and put in front of the
    other words. Those left are the command's own arguments: for train, data, eval, export and estimate the
    YAML file and the run's options (config/loader.py reads those, in the same spellings); for chat, api,
    webui and template an option-shaped word left over is an unknown option, refused in one line with the
    closest known spelling."""

    def __init__(self, *args, **kwargs):
        self.declared: list[argparse.Action] = []  # before argparse's __init__, which declares --help
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.declared.append(action)  # argparse keeps no public list of a parser's arguments
        return action

    def format_help(self) -> str:
        return super().format_help() + f"\n{SPELLINGS_NOTE}\n"

    def parse_known_args(self, args=None, namespace=None):  # argparse hands a command's words to it here
        words = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._argparse_spelling(words), namespace)

    def _argparse_spelling(self, words: list[str]) -> list[str]:
        actions = self.declared
        options = {flag[2:].replace("-", "_"): action for action in actions for flag in action.option_strings
                   if flag.startswith("--") and flag != "--help"}
        positionals = [action.dest for action in actions if not action.option_strings]
        takes_run_options = "overrides" in positionals  # train, data, eval, export, estimate
        front, rest, i = [], [], 0
        while i < len(words):
            word = words[i]
            i += 1
            if word == "--":  # the rest are arguments, whatever they look like
                rest += words[i - 1:]
                break
            if word in ("-h", "--help"):
                front.append(word)
                continue
            spelled = _option_word(word)
            action = options.get(spelled[1]) if spelled else None
            if action is None:
                if spelled and not takes_run_options:
                    raise ConfigError(self._unknown_option(spelled[0], options))
                rest.append(word)
                continue
            typed, _, value = spelled
            if value is None and action.nargs != 0:  # --key value
                if i == len(words):
                    raise ConfigError(f"{typed}: expected a value")
                value, i = words[i], i + 1
            elif value is None and i < len(words) and words[i].lower() in _TRUTH:  # a switch: --key true|false
                value, i = words[i], i + 1
            front += _argparse_words(action, typed, value)
        if takes_run_options:
            # `tunelab train --stage sft ...` (options without a YAML file): argparse would read a leading --stage
            # as an option of the command and refuse it, so '--' marks the rest as the command's arguments.
            at = positionals.index("config")
            if len(rest) > at and rest[at].startswith("--") and rest[at] != "--":
                rest.insert(at, "--")
        return front + rest

    def _unknown_option(self, typed: str, options: dict[str, argparse.Action]) -> str:
        known = [_respelled(key, typed) for key in options]
        close = difflib.get_close_matches(typed, known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"see `{self.prog} --help` for its options"
        return f"unknown option '{typed}' for {self.prog}; {hint}"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tunelab", description="Fine-tune causal language models end to end.",
                     epilog=SPELLINGS_NOTE)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    train = sub.add_parser(
        "train", help="train a model from a YAML config", epilog=_options_help,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("config", nargs="?", help="YAML file with the run's options (optional: key=value / --key value "
                       "options alone work too)")
    train.add_argument("overrides", nargs=argparse.REMAINDER, help="key=value or --key value overrides")
    train.set_defaults(func=_cmd_train)
    data = sub.add_parser(
        "data", help="a config's data before training: stats | verify | coverage (tokenizer only, no weights)",
        description="stats: lengths, padding waste, supervised share, histogram, drops. verify: batches through "
        "the stage's collator, checked (exit 1 on the first problem). coverage: unk, out-of-vocabulary ids, "
        "characters split into byte pieces.",
    )
    data.add_argument("action", choices=["stats", "verify", "coverage"])
    data.add_argument("config", nargs="?", help="the run's YAML file (optional: key=value options alone work too)")
    data.add_argument("--out", help="stats: folder for length_histogram.png and stats.json (default output_dir/data_stats)")
    data.add_argument("--max-batches", type=int, default=50, help="verify: batches per split at most (0: all)")
    data.add_argument("overrides", nargs=argparse.REMAINDER, help="key=value or --key value overrides")
    data.set_defaults(func=_cmd_data)
    template = sub.add_parser("template", help="list built-in chat templates or show one with its trained spans")
    template.add_argument("action", choices=["list", "show"])
    template.add_argument("name", nargs="?")
    template.set_defaults(func=_cmd_template)
    _add_model_commands(sub)
    _add_serving_commands(sub)
    _add_webui_command(sub)
    env = sub.add_parser("env", help="print versions of tunelab and the libraries it runs on")
    env.set_defaults(func=_cmd_env)
    return parser


class _DropMessage:
    """A logging filter that drops the records of one logger whose message contains `fragment`."""

    def __init__(self, fragment: str):
        self.fragment = fragment

    def filter(self, record) -> bool:
        return self.fragment not in record.getMessage()


# logger name -> the one note of it that stays off the terminal (module-level, so adding them again is a no-op).
_DROPPED_NOTES = {
    "torchao": _DropMessage("Failed to load "),
    "torchao.kernel.intmm": _DropMessage("Detected no triton"),
    "torch.utils._pytree": _DropMessage("is an Enum subclass and is now natively supported"),
    "DeepSpeed": _DropMessage("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable"),
}


def quiet_optional_kernel_notes() -> None:
    """Keep bitsandbytes' and torchao's import-time notes about optional kernels off the terminal.

    transformers' TrainingArguments imports peft, and peft imports bitsandbytes whenever it is installed, so
    every command imports it; on CPUs with AVX512-BF16 it then logs "Failed to load CPU gemm_4bit_forward from
    kernels-community" (a faster 4-bit CPU inference kernel that is not installed). It is not an error and
    concerns only quantized models, so it goes below the warning level.
    transformers' quantizers likewise import torchao (tunelab[qat]) whenever it is installed: on a CPU build of
    torch it logs "Failed to load .../torchao/_C_*.so" for each of its CUDA kernel libraries, and torch warns
    about a deprecated call inside torchao ("... is an Enum subclass and is now natively supported ..."), and
    without triton (every CPU machine) "Detected no triton, on systems without Triton certain kernels will not
    work". Only those messages are dropped; torchao's other warnings still show.
    accelerate's unwrap_model (called by every Trainer's __init__) imports deepspeed whenever it is installed
    (tunelab[deepspeed]), and deepspeed's import picks its accelerator: without a GPU it warns "Setting
    accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it." on every run, DeepSpeed
    configured or not. That one line is dropped; DeepSpeed's other warnings still show.
    """
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    for name, note in _DROPPED_NOTES.items():
        logging.getLogger(name).addFilter(note)


def main(argv: list[str] | None = None) -> int:
    # Hub ids are fetched as the user's environment says (HF_HUB_OFFLINE, HF_TOKEN, HF_HOME: tunelab/hub.py).
    quiet_optional_kernel_notes()
    parser = build_parser()
    try:
        ns = parser.parse_args(sys.argv[1:] if argv is None else argv)  # an unknown option: one line, exit 2
        return ns.func(ns)
    except TunelabError as exc:
        print(f"tunelab: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from tunelab.train.run import explain_error  # lazy: train/run imports torch; errors only

        message = explain_error(exc)  # OS errors with a known fix; anything else keeps its traceback
        if message is None:
            raise
        print(f"tunelab: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    code = main()
    if "LOCAL_RANK" in os.environ:
        # A torchrun worker (every run with more than one process) leaves without interpreter teardown: with the
        # process group already destroyed, a library thread still joinable at C++ teardown made a rank of a run
        # that had finished (or saved and stopped on SIGTERM) now and then die with SIGABRT ("terminate called
        # without an active exception"), and its launcher report the run as failed. Nothing is left to write.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
