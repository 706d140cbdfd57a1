"""The `tunelab` command: train | data | template | env.

Errors that the user can fix (tunelab.errors.TunelabError) print as one line and exit 2;
anything else is a bug and keeps its traceback. `data verify` exits 1 when a batch fails a check.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from tunelab.errors import TunelabError


def _options_help() -> str:
    from tunelab.config.args import ARGUMENT_GROUPS, TrainingArguments  # noqa: PLC0415

    lines = ["options (in the YAML file, or as key=value / --key value; later wins):"]
    for group in ARGUMENT_GROUPS:
        lines.append(f"\n  {group.__name__}:")
        if group is TrainingArguments:
            lines.append("    every transformers.TrainingArguments option, plus:")
            fields = [f for f in dataclasses.fields(group) if f.name in ("overwrite_output_dir", "plot_loss")]
        else:
            fields = dataclasses.fields(group)
        for f in fields:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"    {f.name} (default {default!r}): {f.metadata.get('help', '')}")
    return "\n".join(lines)


def _cmd_train(ns: argparse.Namespace) -> int:
    from tunelab.config.loader import load_config  # noqa: PLC0415
    from tunelab.train.run import run, setup_logging  # noqa: PLC0415

    config = load_config(ns.config, ns.overrides)
    setup_logging(config.training.process_index == 0)
    metrics = run(config)
    if config.training.process_index == 0:
        before, after = metrics.get("exact_match_before"), metrics.get("exact_match_after")
        if before is not None and after is not None:
            print(f"exact match (held-out): before {100 * before:.1f}% → after {100 * after:.1f}%")
        if "eval_loss" in metrics:
            print(f"eval loss: {metrics['eval_loss']:.4f}")
        print(f"saved to {config.training.output_dir}")
    return 0


def _take_option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """Remove `name value` / `name=value` from argv (options after the config land among the overrides)."""
    value, rest, i = None, [], 0
    while i < len(argv):
        if argv[i] == name and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith(name + "="):
            value = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    return value, rest


def _cmd_data(ns: argparse.Namespace) -> int:
    from pathlib import Path  # noqa: PLC0415

    from tunelab.config.loader import load_config  # noqa: PLC0415
    from tunelab.data import inspect as data_inspect  # noqa: PLC0415
    from tunelab.errors import ConfigError  # noqa: PLC0415
    from tunelab.train.run import setup_logging  # noqa: PLC0415

    out, overrides = _take_option(list(ns.overrides), "--out")
    max_batches, overrides = _take_option(overrides, "--max-batches")
    out = out or ns.out
    try:
        max_batches = int(max_batches) if max_batches is not None else ns.max_batches
    except ValueError:
        raise ConfigError(f"--max-batches: expected a number, got {max_batches!r}") from None
    config = load_config(ns.config, overrides, purpose="data")
    setup_logging(is_main_process=False)  # warnings only: the report below is the output
    data = data_inspect.load_run_data(config)
    if ns.action == "stats":
        lines = data_inspect.stats_report(data, Path(out) if out else data_inspect.default_stats_dir(config))
    elif ns.action == "verify":
        problem, lines = data_inspect.verify_report(data, max_batches)
        if problem:
            print(f"tunelab: verify failed: {problem}", file=sys.stderr)
            return 1
    else:
        lines = data_inspect.coverage_report(data)
    print("\n".join(lines))
    return 0


def _cmd_template(ns: argparse.Namespace) -> int:
    from tunelab.data.templates import TEMPLATE_NAMES, get_template  # noqa: PLC0415
    from tunelab.errors import TemplateError  # noqa: PLC0415

    if ns.action == "list" or not ns.name:
        print("\n".join(TEMPLATE_NAMES))
        return 0
    template = get_template(ns.name)
    system = {"role": "system", "content": "You are a helpful assistant."}
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
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


def _cmd_env(_: argparse.Namespace) -> int:
    from tunelab.train.outputs import versions  # noqa: PLC0415

    for key, value in versions().items():
        print(f"{key}: {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tunelab", description="Fine-tune causal language models end to end.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="train a model from a YAML config", epilog=_options_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("config", help="YAML file with the run's options")
    train.add_argument("overrides", nargs=argparse.REMAINDER, help="key=value or --key value overrides")
    train.set_defaults(func=_cmd_train)
    data = sub.add_parser(
        "data", help="a config's data before training: stats | verify | coverage (tokenizer only, no weights)",
        description="stats: lengths, padding waste, supervised share, histogram, drops. verify: batches through "
        "the stage's collator, checked (exit 1 on the first problem). coverage: unk, out-of-vocabulary ids, "
        "characters split into byte pieces.",
    )
    data.add_argument("action", choices=["stats", "verify", "coverage"])
    data.add_argument("config", help="the run's YAML file")
    data.add_argument("--out", help="stats: folder for length_histogram.png and stats.json (default output_dir/data_stats)")
    data.add_argument("--max-batches", type=int, default=50, help="verify: batches per split at most (0: all)")
    data.add_argument("overrides", nargs=argparse.REMAINDER, help="key=value or --key value overrides")
    data.set_defaults(func=_cmd_data)
    template = sub.add_parser("template", help="list built-in chat templates or show one with its trained spans")
    template.add_argument("action", choices=["list", "show"])
    template.add_argument("name", nargs="?")
    template.set_defaults(func=_cmd_template)
    env = sub.add_parser("env", help="print versions of tunelab and the libraries it runs on")
    env.set_defaults(func=_cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns)
    except TunelabError as exc:
        print(f"tunelab: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        from tunelab.train.run import explain_os_error  # noqa: PLC0415

        message = explain_os_error(exc)
        if message is None:
            raise
        print(f"tunelab: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
