"""The `nla` command line: one subcommand per pipeline stage."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from nla_shell.config import ConfigError


def _train(args: argparse.Namespace) -> None:
    from nla_shell.config import TrainConfig, load_config
    from nla_shell.train import train

    cfg = load_config(args.config, args.overrides, cls=TrainConfig)
    if args.nproc > 1:
        from nla_shell.distributed import exec_torchrun

        # Checked here first, so a bad config fails once instead of once per rank.
        exec_torchrun(args.nproc, ["train", *(["--config", args.config] if args.config else []), *args.overrides])
    print(f"[nla train] save_dir {cfg.save_dir}", flush=True)
    train(cfg)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace], None]]]:
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
    return parser, commands


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    try:
        commands[args.command](args)
    except (ConfigError, ValueError, FileNotFoundError, ImportError) as err:
        # Bad input: one clear line, not a stack trace from deep inside a library.
        print(f"nla {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
