"""The `nla` command line: one subcommand per pipeline stage."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import typing
from typing import Any, Callable, Mapping, Sequence

from nla_shell.io.config import ConfigError


def _train(args: argparse.Namespace) -> None:
    from nla_shell.io.config import TrainConfig, load_config
    from nla_shell.training.train import train

    cfg = load_config(args.config, args.overrides, cls=TrainConfig)
    if args.nproc > 1:
        from nla_shell.training.distributed import exec_torchrun

        # Checked here first, so a bad config fails once instead of once per rank.
        exec_torchrun(args.nproc, ["train", *(["--config", args.config] if args.config else []), *args.overrides])
    print(f"[nla train] save_dir {cfg.save_dir}", flush=True)
    train(cfg)


def _add_config_flags(parser: argparse.ArgumentParser, cls: type, *, config_file: bool = True) -> None:
    """One `--key` flag per field of the config dataclass `cls` (help = the field's docstring).

    Booleans are bare switches (`--overwrite`); every other value is parsed by the config
    loader, like a `key=value` override. Also adds `--config FILE` and positional overrides.
    """
    from nla_shell.io.config import field_docs

    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flags = dict.fromkeys(["--" + f.name.replace("_", "-"), "--" + f.name])
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        help_text = docs.get(f.name, "") + (" (required)" if required else "")
        if hints[f.name] is bool:
            parser.add_argument(*flags, dest=f"cfg_{f.name}", action="store_const", const="true", help=help_text)
        else:
            parser.add_argument(*flags, dest=f"cfg_{f.name}", metavar=f.name.upper(), help=help_text)
    if config_file:
        parser.add_argument("--config", help=f"YAML file of {cls.__name__} keys (flags and overrides win)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")


def _load_config(cls: type, args: argparse.Namespace, preset: Mapping[str, Any] | None = None) -> Any:
    """The config from (lowest to highest) a preset, --config, the flags, and key=value overrides."""
    from nla_shell.io.config import load_config

    flags = [f"{f.name}={value}" for f in dataclasses.fields(cls) if (value := getattr(args, f"cfg_{f.name}")) is not None]
    preset_items = [f"{k}={v}" for k, v in (preset or {}).items()]
    return load_config(getattr(args, "config", None), [*preset_items, *flags, *args.overrides], cls=cls)


def _datagen(args: argparse.Namespace) -> None:
    from nla_shell.pipeline.datagen import DatagenConfig, datagen

    datagen(_load_config(DatagenConfig, args))


def _sft(args: argparse.Namespace) -> None:
    from nla_shell.pipeline.sft import SFTConfig, sft

    sft(_load_config(SFTConfig, args))


def _eval(args: argparse.Namespace) -> None:
    from nla_shell.pipeline.evaluate import EvalConfig, evaluate

    cfg = _load_config(EvalConfig, args)
    result = evaluate(cfg)
    print(f"[nla eval] wrote {result.out_dir}/eval_summary.json, eval_controls.md, eval_samples.jsonl, eval_table.md",
          flush=True)


def _explain(args: argparse.Namespace) -> None:
    from nla_shell.pipeline.explain import ExplainConfig, explain

    explain(_load_config(ExplainConfig, args))


def _export(args: argparse.Namespace) -> None:
    from nla_shell.pipeline.export import ExportConfig, export

    for name, path in export(_load_config(ExportConfig, args)).items():
        print(f"[nla export] {name}: {path}", flush=True)


def _plot(args: argparse.Namespace) -> None:
    from nla_shell.pipeline.plot import plot_run

    print(f"[nla plot] {plot_run(args.run_dir, args.out)}", flush=True)


def _demo(args: argparse.Namespace) -> None:
    from nla_shell.pipeline.demo import TINY, DemoConfig, demo

    demo(_load_config(DemoConfig, args, TINY if args.tiny else None))


CONFIG_COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], None], str, str, str]] = {
    "datagen": (_datagen, "nla_shell.pipeline.datagen", "DatagenConfig",
                "capture activations at block K of a model over a corpus: rl/av_sft/ar_sft/eval parquets"),
    "sft": (_sft, "nla_shell.pipeline.sft", "SFTConfig",
            "AV (--mode av) or AR (--mode ar) warm start; checkpoints are nla train's av_ckpt / ar_ckpt"),
    "eval": (_eval, "nla_shell.pipeline.evaluate", "EvalConfig",
             "held-out FVE of an AV+AR beside its controls (shuffled vector, gold, mean), FVE by length, "
             "splice-KL (--model)"),
    "explain": (_explain, "nla_shell.pipeline.explain", "ExplainConfig",
                "explain the activations of a text at one position (--position) or all (--all)"),
    "export": (_export, "nla_shell.pipeline.export", "ExportConfig",
               "a trained AV (LoRA merged) and AR as HF dirs with upstream-layout nla_meta.yaml"),
    "demo": (_demo, "nla_shell.pipeline.demo", "DemoConfig",
             "a toy NLA from scratch on CPU in minutes: LM, datagen, SFT, RL, eval, plot"),
}
"""Subcommands configured by a dataclass: handler, module, config class (its fields become flags), help line."""


def build_parser(argv: Sequence[str] = ()) -> tuple[argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace], None]]]:
    """The parser; the config flags of the command named by argv[0] (if any) are added too."""
    parser = argparse.ArgumentParser(prog="nla", description="Natural Language Autoencoders: train and use NLAs.")
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, Callable[[argparse.Namespace], None]] = {}

    p = sub.add_parser("train", help="GRPO-train the activation verbaliser (AV) against the reconstructor (AR)")
    p.add_argument("--config", help="YAML file of TrainConfig keys")
    p.add_argument(
        "--nproc", type=int, default=1,
        help="data-parallel ranks on this machine: re-launches itself under torchrun (one GPU per rank)",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. num_steps=3 engine=hf")
    commands["train"] = _train

    for name, (handler, module, cls_name, help_text) in CONFIG_COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if argv[:1] == [name]:
            # Only the invoked command imports its module (torch, transformers) to build its flags,
            # so `nla --help` and the other commands stay fast.
            _add_config_flags(p, getattr(importlib.import_module(module), cls_name), config_file=name != "explain")
        if name == "demo":
            p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run of every stage (learns nothing)")
        commands[name] = handler

    p = sub.add_parser("plot", help="PNG of reward, FVE, KL and clip fraction against step for a run dir")
    p.add_argument("run_dir", help="an nla train save_dir (holding metrics.jsonl)")
    p.add_argument("--out", help="PNG path (default RUN_DIR/curves.png)")
    commands["plot"] = _plot
    return parser, commands


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, commands = build_parser(argv)
    args = parser.parse_args(argv)
    from nla_shell.training.distributed import rank_info
    from nla_shell.training.preemption import RunStopped

    try:
        commands[args.command](args)
    except RunStopped as stopped:
        # A signal stopped the run cleanly: say where to resume (rank 0 already did under torchrun).
        if not stopped.announced and rank_info().is_main:
            print(f"nla {args.command}: {stopped}", file=sys.stderr, flush=True)
        return stopped.exit_code
    except KeyboardInterrupt:
        print(f"nla {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130
    except (ConfigError, ValueError, OSError, ImportError) as err:
        # Bad input or a failed write (disk full, permission denied): one clear line naming
        # the path, not a stack trace from deep inside a library.
        print(f"nla {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
