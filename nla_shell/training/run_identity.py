"""Which run a directory holds: its config.yaml, claimed before a run's first step and compared with the
config of a run that would continue there (the keys outside RESUME_MUTABLE_KEYS are the run's identity).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml

from nla_shell.io.config import ConfigError
from nla_shell.io.files import write_text_atomically
from nla_shell.training.checkpoint import CONFIG_NAME, checkpoint_step, latest_checkpoint
from nla_shell.training.config import RESUME_MUTABLE_KEYS
from nla_shell.training.runlock import LOCK_NAME

_UNSET = object()  # a config key absent from one side of a comparison


def saved_config(checkpoint: str | os.PathLike[str]) -> dict[str, Any]:
    """The config.yaml a checkpoint was saved with, as a mapping ({} when it has none that reads as one)."""
    try:
        config = yaml.safe_load((Path(checkpoint) / CONFIG_NAME).read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return config if isinstance(config, dict) else {}


def claim_save_dir(
    save_dir: str | os.PathLike[str],
    config_dict: Mapping[str, Any],
    *,
    overwrite: bool,
    resume: str,
    mutable_keys: Collection[str] = RESUME_MUTABLE_KEYS,
    defaults: Mapping[str, Any] | None = None,
    num_steps: int | None = None,
) -> None:
    """Make `save_dir` this run's directory and write `config_dict` to its config.yaml.

    A new or empty directory is claimed. A directory holding a run (its config.yaml)
    conflicts when that run's config differs from `config_dict` outside `mutable_keys`,
    or when `resume` is "never" and it holds a complete checkpoint. A conflict raises
    ConfigError, writing nothing, unless `overwrite`, which empties the directory first.
    A non-empty directory without config.yaml is refused even with `overwrite`: it was
    not made by nla, and overwrite must never delete someone's files. A key that the run's
    config.yaml lacks is no conflict where `config_dict` holds its value in `defaults`: that run
    predates the key and ran as its default does. A resumable run whose newest checkpoint is
    past `num_steps` is refused too: it would resume at that step, run nothing, and report a
    checkpoint at num_steps that does not exist.
    """
    if resume not in ("auto", "never"):
        raise ValueError(f"resume must be 'auto' or 'never', got {resume!r}")
    save_dir = Path(save_dir)
    config_path = save_dir / CONFIG_NAME
    if save_dir.exists() and not save_dir.is_dir():
        raise ConfigError(f"config key 'save_dir' = {str(save_dir)!r} is a file; give a directory")
    # The run-dir lock file is the claiming run's own (see runlock), not someone else's file.
    if save_dir.is_dir() and any(child.name != LOCK_NAME for child in save_dir.iterdir()):
        if not config_path.is_file():
            raise ConfigError(
                f"config key 'save_dir' = {str(save_dir)!r} is a non-empty directory without "
                f"{CONFIG_NAME}, so it holds no nla run; choose a new or empty directory "
                f"(overwrite never deletes a directory nla did not create)"
            )
        conflict = _run_conflict(save_dir, config_path, config_dict, resume, mutable_keys, defaults or {})
        if conflict:
            if not overwrite:
                raise ConfigError(
                    f"config key 'save_dir' = {str(save_dir)!r} {conflict}; choose another "
                    f"save_dir, or set overwrite=true (--overwrite) to delete its contents and start over"
                )
            for child in save_dir.iterdir():
                if child.name == LOCK_NAME:
                    continue
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        elif resume == "auto" and num_steps is not None and (newest := latest_checkpoint(save_dir)) is not None:
            done = checkpoint_step(newest)
            if done > num_steps:
                raise ConfigError(
                    f"config key 'num_steps' = {num_steps} is invalid: save_dir {str(save_dir)!r} already holds "
                    f"{newest.name} ({done} steps done); give num_steps >= {done} to continue this run, or another "
                    f"save_dir to start over"
                )
    save_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomically(config_path, yaml.safe_dump(dict(config_dict), sort_keys=False))


def _run_conflict(
    save_dir: Path,
    config_path: Path,
    config_dict: Mapping[str, Any],
    resume: str,
    mutable_keys: Collection[str],
    defaults: Mapping[str, Any],
) -> str | None:
    """Why this run may not continue in `save_dir`, or None when it may."""
    try:
        theirs = yaml.safe_load(config_path.read_text())
    except yaml.YAMLError:
        return f"holds an unreadable {CONFIG_NAME}"
    if not isinstance(theirs, dict):
        return f"holds a {CONFIG_NAME} that is not a mapping"
    # A YAML round trip gives ours the types theirs came back with (tuples -> lists).
    ours = yaml.safe_load(yaml.safe_dump(dict(config_dict), sort_keys=False))
    foreign = sorted(set(theirs) - set(ours))
    if len(foreign) * 4 > len(theirs):
        # Many keys this command does not know: another command's run (e.g. `nla sft`'s, with mode, model,
        # parquet), not an older version of this one (a renamed key or two). Say so instead of a long diff.
        return f"holds a run of another nla command (its {CONFIG_NAME} has keys {', '.join(foreign[:4])})"
    defaults = yaml.safe_load(yaml.safe_dump(dict(defaults), sort_keys=False))
    theirs = {**{k: v for k, v in defaults.items() if k in ours and ours[k] == v}, **theirs}
    differences = [
        f"{key}: {theirs.get(key, '<unset>')!r} there, {ours.get(key, '<unset>')!r} now"
        for key in [*ours, *(k for k in theirs if k not in ours)]
        if key not in mutable_keys and theirs.get(key, _UNSET) != ours.get(key, _UNSET)
    ]
    if differences:
        return "holds a different run (" + "; ".join(differences) + ")"
    if resume == "never" and latest_checkpoint(save_dir) is not None:
        return "holds checkpoints of this run but resume=never would start it over"
    return None

