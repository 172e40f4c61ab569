"""Atomic, verified checkpoints and exact-resume state (RNGs, optimizers, data cursor); which run a directory
holds (its config.yaml, claimed before the first step) is nla_shell.training.run_identity's.

Layout of a run directory:

    save_dir/config.yaml                 the resolved config (written by run_identity.claim_save_dir)
    save_dir/step_000050/MANIFEST.json   size and sha256 of every file of the checkpoint
    save_dir/step_000050/COMPLETE        a checkpoint after 50 finished steps; written last
    save_dir/.tmp_step_000100/           a save in progress (or killed mid-way): never counted
    save_dir/.old_step_000050/           a checkpoint being replaced by a new save of its step
    save_dir/.deleting_step_000010/      a checkpoint being pruned (keep_last)

A checkpoint is built in the temp dir by a caller-supplied callback; its files are then
hashed and fsynced in one pass (read back from the page cache they were just written to),
the manifest and COMPLETE are written, and the dir is renamed into place: a crash at any
point leaves every earlier checkpoint whole. Resuming verifies the manifest (sizes, then
hashes) and falls back past a damaged checkpoint to the newest verified one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


COMPLETE = "COMPLETE"
MANIFEST_NAME = "MANIFEST.json"
CONFIG_NAME = "config.yaml"
TRAINING_STATE_NAME = "training_state.pt"
OPTIMIZER_SHARDS_NAME = "optimizer_shards"
"""A sharding=fsdp2 checkpoint's optimiser moments: torch Distributed Checkpoint's files, every rank's shard."""
_STEP_DIR = re.compile(r"step_(\d+)")
_STALE = re.compile(r"\.(tmp|old|deleting|shards)_(step_\d+)")
_HASH_CHUNK = 8 * 2**20


# --------------------------------------------------------------------------- atomic saves


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved, verified or loaded; the message names its path and the cause."""


def checkpoint_dir(save_dir: str | os.PathLike[str], step: int) -> Path:
    """`save_dir/step_NNNNNN`, the checkpoint taken after `step` finished steps."""
    return Path(save_dir) / f"step_{step:06d}"


def save_checkpoint(
    save_dir: str | os.PathLike[str],
    step: int,
    *,
    write: Callable[[Path], None],
    metrics: Mapping[str, Any] | None = None,
) -> Path:
    """Save a checkpoint atomically: `write(tmp_dir)` fills a temp dir that is then renamed.

    Returns the final `save_dir/step_NNNNNN`. Its MANIFEST.json records each file's size
    and sha256, and those of `metrics` that are finite numbers (e.g. the held-out score by
    which keep_last protects the best checkpoint; None or NaN where a step had none). If anything fails, the temp dir is removed and a CheckpointError names
    the checkpoint and the cause (disk full, permission denied, ...); every earlier
    checkpoint is untouched, and one already at this step is replaced only once the new
    one is complete.
    """
    final = checkpoint_dir(save_dir, step)
    tmp = final.with_name(f".tmp_{final.name}")
    try:
        if tmp.exists():  # left by a run killed mid-save
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        write(tmp)
        files = _hash_and_fsync(tmp)
        scores = {k: float(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float)) and math.isfinite(v)}
        manifest = {"step": step, "files": files, "metrics": scores}
        _write_synced(tmp / MANIFEST_NAME, json.dumps(manifest, indent=1, allow_nan=False))
        _write_synced(tmp / COMPLETE, f"{step}\n")
        _fsync_dir(tmp)
        if final.exists():
            # rename() cannot replace a non-empty directory; move the old one aside first.
            # A crash between the two renames leaves .old_step_N, which the next start-up
            # (remove_stale_entries) renames back.
            old = final.with_name(f".old_{final.name}")
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
    except Exception as error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"cannot save checkpoint {final}: {describe_error(error)}; the earlier checkpoints are intact"
        ) from error
    except BaseException:  # e.g. an abandoned step: leave nothing half-written
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def shards_dir(save_dir: str | os.PathLike[str], step: int) -> Path:
    """Where every rank writes its shard of the checkpoint after `step` steps, before rank 0's `save_checkpoint`
    moves the directory into the checkpoint (as OPTIMIZER_SHARDS_NAME): hashed, made complete and renamed with the
    rest. A run killed in between leaves it to `remove_stale_entries`."""
    final = checkpoint_dir(save_dir, step)
    return final.with_name(f".shards_{final.name}")


def describe_error(error: BaseException) -> str:
    """One line: an OSError's cause and path, or another error's type and first message line."""
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror} ({error.filename})" if error.filename else error.strerror
    first_line = next(iter(str(error).splitlines()), "")
    return f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__


def complete_checkpoints(save_dir: str | os.PathLike[str]) -> list[Path]:
    """The checkpoints of `save_dir` marked COMPLETE, newest (highest step) first."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    found = [
        (int(match.group(1)), entry)
        for entry in save_dir.iterdir()
        if (match := _STEP_DIR.fullmatch(entry.name)) and (entry / COMPLETE).is_file()
    ]
    return [path for _, path in sorted(found, reverse=True)]


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """The steps done of a checkpoint dir named step_NNNNNN."""
    match = _STEP_DIR.fullmatch(Path(path).name)
    if match is None:
        raise ValueError(f"{str(path)!r} is not a step_NNNNNN checkpoint dir")
    return int(match.group(1))


def latest_checkpoint(save_dir: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step in `save_dir`, or None (not verified)."""
    return next(iter(complete_checkpoints(save_dir)), None)


def _hash_and_fsync(root: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {"bytes", "sha256"}} of every file under `root`, each fsynced on the way.

    Files are hashed in parallel threads (hashlib releases the GIL), straight after they
    were written, so the data comes from the page cache: the one extra pass costs hashing
    time, not disk reads.
    """
    paths = sorted(p for p in root.rglob("*") if p.is_file())

    def one(path: Path) -> tuple[str, dict[str, Any]]:
        return path.relative_to(root).as_posix(), {"bytes": path.stat().st_size, "sha256": file_sha256(path, fsync=True)}

    with ThreadPoolExecutor(max_workers=_hash_workers()) as pool:
        files = dict(pool.map(one, paths))
    for directory in {p.parent for p in paths} | {root}:
        _fsync_dir(directory)
    return files


def _hash_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    # Makes the directory's entries (new files, a rename) durable, not only the file data.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- verification


def checkpoint_problem(path: str | os.PathLike[str], *, hashes: bool = True) -> str | None:
    """Why the checkpoint at `path` fails verification against its manifest, or None if it passes.

    Checks COMPLETE, then every manifest entry's presence and size, then (with `hashes`)
    its sha256, so truncation, deletion and bit flips are all caught. A checkpoint written
    before manifests existed has none: it passes unverified (`has_manifest` tells).
    """
    path = Path(path)
    if not (path / COMPLETE).is_file():
        return f"no {COMPLETE} marker"
    if not has_manifest(path):
        return None
    try:
        files = json.loads((path / MANIFEST_NAME).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"unreadable {MANIFEST_NAME} ({describe_error(error)})"
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != entry["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {entry['bytes']}"
    if hashes:
        with ThreadPoolExecutor(max_workers=_hash_workers()) as pool:
            digests = dict(zip(files, pool.map(file_sha256, [path / name for name in files])))
        for name, entry in files.items():
            if digests[name] != entry["sha256"]:
                return f"{name} does not match its sha256 in {MANIFEST_NAME} (corrupted)"
    return None


def has_manifest(path: Path) -> bool:
    return (path / MANIFEST_NAME).is_file()


def file_sha256(path: Path, *, fsync: bool = False) -> str:
    """The file's sha256 (hex); with `fsync`, also flush it to disk through the same descriptor."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def latest_verified_checkpoint(
    save_dir: str | os.PathLike[str], *, required: Collection[str] = ()
) -> Path | None:
    """The newest checkpoint that passes `checkpoint_problem`, or None when there is none at all.

    A newer checkpoint that fails is reported on stderr by path and cause and skipped. The
    one chosen must hold every entry of `required` (paths relative to it, e.g. "critic"):
    a part the config needs but the checkpoint never had is a CheckpointError, not
    something to replace silently. So is a save_dir whose checkpoints all fail.
    """
    failures: list[str] = []
    for path in complete_checkpoints(save_dir):
        problem = checkpoint_problem(path)
        if problem is not None:
            failures.append(f"{path} ({problem})")
            continue
        for failure in failures:
            print(f"[warn] checkpoint {failure} failed verification; resuming from {path.name}, "
                  "the newest verified checkpoint", file=sys.stderr, flush=True)
        if not has_manifest(path):
            print(f"[warn] checkpoint {path} has no {MANIFEST_NAME} (saved by an older nla): resuming from it "
                  "unverified", file=sys.stderr, flush=True)
        missing = [part for part in required if not (path / part).exists()]
        if missing:
            raise CheckpointError(
                f"checkpoint {path} has no {', '.join(missing)}, which this config needs; restore it, "
                "or delete this step_* dir to resume from an earlier checkpoint"
            )
        return path
    if failures:
        raise CheckpointError(
            f"no checkpoint in {save_dir} passes verification: {'; '.join(failures)}; delete the damaged "
            "step_* dirs to start over, or set overwrite=true (--overwrite)"
        )
    return None


# --------------------------------------------------------------------------- housekeeping


def remove_stale_entries(save_dir: str | os.PathLike[str]) -> None:
    """Finish what a killed run left half-done; call it holding the run-dir lock.

    A `.old_step_N` whose `step_N` is missing was moved aside by a re-save killed between
    its two renames: it is a whole checkpoint and goes back into place. Every other
    `.tmp_*` / `.old_*` / `.deleting_*` / `.shards_*` step dir is an unfinished save, replace
    or prune, and is deleted.
    """
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return
    for entry in sorted(save_dir.iterdir()):
        match = _STALE.fullmatch(entry.name)
        if not match:
            continue
        final = save_dir / match.group(2)
        if match.group(1) == "old" and not final.exists() and (entry / COMPLETE).is_file():
            os.replace(entry, final)
        else:
            shutil.rmtree(entry)


def prune_checkpoints(
    save_dir: str | os.PathLike[str], *, keep_last: int, best_by: str | None = None
) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints, and the best one; returns those deleted.

    The best is the checkpoint whose manifest's `metrics[best_by]` is highest (finite
    values only), kept whatever its age. Nothing is deleted unless the newest checkpoint
    passes full verification (CheckpointError otherwise). Each deletion first renames the
    dir to `.deleting_step_N`, so a kill mid-way never leaves a half-deleted step_N that
    looks complete.
    """
    checkpoints = complete_checkpoints(save_dir)
    if checkpoints and (problem := checkpoint_problem(checkpoints[0])) is not None:
        raise CheckpointError(f"checkpoint {checkpoints[0]} fails verification right after saving ({problem}); "
                              "nothing pruned: check the disk")
    keep = set(checkpoints[:keep_last])
    if best_by is not None and (best := best_checkpoint(save_dir, by=best_by)) is not None:
        keep.add(best)
    deleted = []
    for path in checkpoints:
        if path not in keep:
            trash = path.with_name(f".deleting_{path.name}")
            os.replace(path, trash)
            shutil.rmtree(trash)
            deleted.append(path)
    return deleted


def best_checkpoint(save_dir: str | os.PathLike[str], *, by: str) -> Path | None:
    """The complete checkpoint whose manifest's `metrics[by]` is highest (the newest among ties); None when none has it."""
    scored = [(score, path) for path in complete_checkpoints(save_dir) if (score := _manifest_metric(path, by)) is not None]
    return max(scored, key=lambda item: item[0])[1] if scored else None


def _manifest_metric(path: Path, key: str) -> float | None:
    try:
        value = json.loads((path / MANIFEST_NAME).read_text(encoding="utf-8"))["metrics"].get(key)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


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
    blob = {
        "step": step,
        "data_cursor": dict(data_cursor),
        "optimizer_states": {k: dict(v) for k, v in optimizer_states.items()},
        "rng": dict(rng),
        "extra": dict(extra or {}),
    }
    try:
        # Through a Python file: a failed write is an OSError with its errno (torch's own
        # writer reports only "iostream error").
        with open(path, "wb") as f:
            torch.save(blob, f)
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(path)) from error
    return path


def load_training_state(directory: str | os.PathLike[str]) -> TrainingState:
    """Read what `save_training_state` wrote (tensors on CPU)."""
    path = Path(directory) / TRAINING_STATE_NAME
    try:
        # weights_only: a checkpoint is data, and must not be able to run code when loaded.
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"cannot load {path}: {describe_error(error)}") from error
    return TrainingState(**blob)


def restore_optimizer(optimizer: torch.optim.Optimizer, state: TrainingState, name: str, directory: str | os.PathLike[str]) -> None:
    """Load the `name` optimizer state of the checkpoint in `directory`, or say in one line why it does not fit.

    A state saved for other trainable parameters (another AR mode, or a critic saved before
    its final norm and lm_head were frozen) fails inside torch with a message that names no
    file; this names the checkpoint, the optimizer and the way out.
    """
    try:
        optimizer.load_state_dict(state.optimizer_states[name])
    except (KeyError, ValueError) as error:
        raise CheckpointError(
            f"checkpoint {Path(directory) / TRAINING_STATE_NAME}: its {name} optimizer state does not fit this "
            f"run's trainable {name} parameters ({describe_error(error)}); resume with the settings and nla version "
            "that saved it, or start a new run from its weights (av_ckpt= its adapter, ar_ckpt= its critic)"
        ) from None
