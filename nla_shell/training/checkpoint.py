"""Atomic checkpoints, exact-resume state (RNGs, optimizers, data cursor), run-dir claims.

Layout of a run directory:

    save_dir/config.yaml            the resolved config (written by claim_save_dir)
    save_dir/step_000050/COMPLETE   a checkpoint after 50 finished steps; COMPLETE is written last
    save_dir/.tmp_step_000100/      a save in progress (or killed mid-way): never counted

A checkpoint is built in the temp dir by a caller-supplied callback, fsynced, marked
COMPLETE, then renamed into place: a crash at any point leaves every earlier checkpoint
whole and `latest_checkpoint` pointing at the newest whole one. All checkpoints are kept.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from nla_shell.io.config import RESUME_MUTABLE_KEYS, ConfigError

COMPLETE = "COMPLETE"
CONFIG_NAME = "config.yaml"
TRAINING_STATE_NAME = "training_state.pt"
_STEP_DIR = re.compile(r"step_(\d+)")
_UNSET = object()  # a config key absent from one side of a comparison


# --------------------------------------------------------------------------- atomic saves


def checkpoint_dir(save_dir: str | os.PathLike[str], step: int) -> Path:
    """`save_dir/step_NNNNNN`, the checkpoint taken after `step` finished steps."""
    return Path(save_dir) / f"step_{step:06d}"


def save_checkpoint(
    save_dir: str | os.PathLike[str], step: int, *, write: Callable[[Path], None]
) -> Path:
    """Save a checkpoint atomically: `write(tmp_dir)` fills a temp dir that is then renamed.

    Returns the final `save_dir/step_NNNNNN`. If `write` raises, the temp dir is removed
    and the exception propagates; a checkpoint already at this step is replaced only once
    the new one is complete.
    """
    final = checkpoint_dir(save_dir, step)
    tmp = final.with_name(f".tmp_{final.name}")
    if tmp.exists():  # left by a run killed mid-save
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        (tmp / COMPLETE).write_text(f"{step}\n")
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        # rename() cannot replace a non-empty directory; move the old one aside first.
        # A crash between the two renames loses only this step's (hidden) copy.
        old = final.with_name(f".old_{final.name}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


def latest_checkpoint(save_dir: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step in `save_dir`, or None."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for entry in save_dir.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and (entry / COMPLETE).is_file():
            step = int(match.group(1))
            if best is None or step > best[0]:
                best = (step, entry)
    return None if best is None else best[1]


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    # Makes the directory's entries (new files, a rename) durable, not only the file data.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- RNG state


def rng_state(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """The state of python's, numpy's and torch's global RNGs, and of the named generators.

    Holds only tensors and plain Python values, so it loads with `torch.load(weights_only=True)`.
    """
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "generators": {name: g.get_state() for name, g in (generators or {}).items()},
    }


def set_rng_state(
    state: Mapping[str, Any], generators: Mapping[str, torch.Generator] | None = None
) -> None:
    """Restore what `rng_state` captured, including each named generator passed here."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state({
        "bit_generator": np_state["bit_generator"],
        "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]},
        "has_gauss": np_state["has_gauss"],
        "gauss": np_state["gauss"],
    })
    torch.set_rng_state(state["torch"])
    cuda_states = state["torch_cuda"]
    if cuda_states:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            # Resuming on another machine is allowed (device may change); exactness is not.
            warnings.warn(
                f"checkpoint holds {len(cuda_states)} CUDA RNG state(s) but "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA device(s) "
                "are visible; CUDA RNGs not restored, so the resumed run will not be bit-exact",
                stacklevel=2,
            )
    for name, generator in (generators or {}).items():
        if name not in state["generators"]:
            raise KeyError(
                f"no saved RNG state for generator {name!r}; saved: {sorted(state['generators'])}"
            )
        generator.set_state(state["generators"][name])


# --------------------------------------------------------------------------- training state


@dataclass(frozen=True)
class TrainingState:
    """Everything besides model weights needed to continue a run exactly."""

    step: int
    """Finished steps: the resumed run's first step index."""
    data_cursor: dict[str, Any]
    """The data stream's position (its own format), e.g. {"epoch": 0, "row": 1234}."""
    optimizer_states: dict[str, dict[str, Any]]
    """`state_dict()` of each optimizer (and LR scheduler), by name, e.g. "actor", "critic"."""
    rng: dict[str, Any]
    """What `rng_state` returned."""
    extra: dict[str, Any]
    """Anything else (e.g. the skipped-step counter); tensors and plain values only."""


def save_training_state(
    directory: str | os.PathLike[str],
    *,
    step: int,
    data_cursor: Mapping[str, Any],
    optimizer_states: Mapping[str, Mapping[str, Any]],
    rng: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write `directory/training_state.pt`; call it inside `save_checkpoint`'s write callback.

    Everything must be tensors and plain Python values (it is loaded with weights_only=True).
    """
    path = Path(directory) / TRAINING_STATE_NAME
    torch.save(
        {
            "step": step,
            "data_cursor": dict(data_cursor),
            "optimizer_states": {k: dict(v) for k, v in optimizer_states.items()},
            "rng": dict(rng),
            "extra": dict(extra or {}),
        },
        path,
    )
    return path


def load_training_state(directory: str | os.PathLike[str]) -> TrainingState:
    """Read what `save_training_state` wrote (tensors on CPU)."""
    # weights_only: a checkpoint is data, and must not be able to run code when loaded.
    blob = torch.load(Path(directory) / TRAINING_STATE_NAME, map_location="cpu", weights_only=True)
    return TrainingState(**blob)


# --------------------------------------------------------------------------- run identity


def claim_save_dir(
    save_dir: str | os.PathLike[str],
    config_dict: Mapping[str, Any],
    *,
    overwrite: bool,
    resume: str,
    mutable_keys: Collection[str] = RESUME_MUTABLE_KEYS,
) -> None:
    """Make `save_dir` this run's directory and write `config_dict` to its config.yaml.

    A new or empty directory is claimed. A directory holding a run (its config.yaml)
    conflicts when that run's config differs from `config_dict` outside `mutable_keys`,
    or when `resume` is "never" and it holds a complete checkpoint. A conflict raises
    ConfigError, writing nothing, unless `overwrite`, which empties the directory first.
    A non-empty directory without config.yaml is refused even with `overwrite`: it was
    not made by nla, and overwrite must never delete someone's files.
    """
    if resume not in ("auto", "never"):
        raise ValueError(f"resume must be 'auto' or 'never', got {resume!r}")
    save_dir = Path(save_dir)
    config_path = save_dir / CONFIG_NAME
    if save_dir.exists() and not save_dir.is_dir():
        raise ConfigError(f"config key 'save_dir' = {str(save_dir)!r} is a file; give a directory")
    if save_dir.is_dir() and any(save_dir.iterdir()):
        if not config_path.is_file():
            raise ConfigError(
                f"config key 'save_dir' = {str(save_dir)!r} is a non-empty directory without "
                f"{CONFIG_NAME}, so it holds no nla run; choose a new or empty directory "
                f"(overwrite never deletes a directory nla did not create)"
            )
        conflict = _run_conflict(save_dir, config_path, config_dict, resume, mutable_keys)
        if conflict:
            if not overwrite:
                raise ConfigError(
                    f"config key 'save_dir' = {str(save_dir)!r} {conflict}; choose another "
                    f"save_dir, or set overwrite=true to delete its contents and start over"
                )
            for child in save_dir.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
    save_dir.mkdir(parents=True, exist_ok=True)
    tmp = save_dir / f".{CONFIG_NAME}.tmp"
    tmp.write_text(yaml.safe_dump(dict(config_dict), sort_keys=False))
    os.replace(tmp, config_path)


def _run_conflict(
    save_dir: Path,
    config_path: Path,
    config_dict: Mapping[str, Any],
    resume: str,
    mutable_keys: Collection[str],
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

