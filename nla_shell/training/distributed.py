"""Data parallelism for `nla train` under torchrun: ranks, batch slices, reductions.

Every rank holds the actor, the critic and its own rollout engine on its device. All
ranks draw the same global batch and each takes a contiguous slice of whole prompts, so a
GRPO group never splits and the concatenation of the ranks' samples, in rank order, is
the single-process batch. Losses are divided by global counts, so summing gradients over
ranks gives the single-process gradient.

Every helper here is the identity (or a no-op) when no process group is initialised, so
a plain one-process run takes exactly the path it always did. The process group is the
only state: helpers read it the way torch.distributed itself does, not from arguments.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from nla_shell.io.config import ConfigError

T = TypeVar("T")

TIMEOUT = datetime.timedelta(minutes=30)
"""How long a collective waits: generous, because rank 0 evaluates and saves alone while
the other ranks wait at a barrier (NCCL's default, 10 min, could cut a long eval short)."""
BUCKET_BYTES = 128 * 2**20
"""Gradients are summed in flat buckets of about this size: few, large collectives."""


# --------------------------------------------------------------------------- ranks


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job, as torchrun's environment describes it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_info() -> RankInfo:
    """RANK / WORLD_SIZE / LOCAL_RANK from the environment; one process when unset."""
    return RankInfo(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )


def active() -> bool:
    """True inside a process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_main() -> bool:
    """True on rank 0, and in a single-process run."""
    return not active() or dist.get_rank() == 0


@contextlib.contextmanager
def process_group(info: RankInfo, device: torch.device, *, single: bool = False) -> Iterator[None]:
    """Join the job's process group for the duration (NCCL on CUDA, gloo on CPU).

    Nothing happens for a world of one (unless `single`: a group of this one process, for
    FSDP2, which needs a group even when it shards over one rank), or when the caller
    already set a group up (then the caller also tears it down).
    """
    owned = (info.world_size > 1 or single) and not dist.is_initialized()
    if owned:
        if device.type == "cuda":
            # torch binds a group only to an indexed device; one process without torchrun has plain "cuda"
            device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
            torch.cuda.set_device(device)
        # One process needs no rendezvous (and may run outside torchrun): an in-memory store.
        store = {"store": dist.HashStore()} if info.world_size == 1 else {}
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            rank=info.rank,
            world_size=info.world_size,
            timeout=TIMEOUT,
            **store,
            **({"device_id": device} if device.type == "cuda" else {}),
        )
    try:
        yield
    finally:
        if owned:
            dist.destroy_process_group()


def check_divisible(key: str, value: int, world_size: int) -> None:
    """ConfigError unless `value` splits into `world_size` equal whole shares."""
    if value % world_size:
        raise ConfigError(
            f"config key '{key}' = {value} is invalid: with {world_size} ranks every rank takes "
            f"an equal share of whole prompts (a prompt's group of samples never splits across "
            f"ranks); use a multiple of {world_size}"
        )


def shard(items: Sequence[T], info: RankInfo) -> list[T]:
    """This rank's contiguous share of `items` (its length divides by the world size)."""
    per_rank = len(items) // info.world_size
    return list(items[info.rank * per_rank : (info.rank + 1) * per_rank])


def rank_seed(seed: int, rank: int, *salt: int) -> int:
    """A seed of its own for each rank (and salt), so ranks never sample the same rollouts."""
    return int(np.random.SeedSequence([seed, rank, *salt]).generate_state(1)[0])


# --------------------------------------------------------------------------- collectives


def _collective_device() -> torch.device:
    # NCCL moves only CUDA tensors; gloo only CPU ones.
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _reduce(values: Sequence[float], op: dist.ReduceOp) -> list[float]:
    if not active():
        return list(values)
    packed = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(packed, op=op)
    return packed.tolist()


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    """Each value summed over ranks (float64, so counts stay exact); unchanged in one process."""
    return _reduce(values, dist.ReduceOp.SUM)


def all_reduce_max(values: Sequence[float]) -> list[float]:
    """Each value's maximum over ranks; unchanged in one process."""
    return _reduce(values, dist.ReduceOp.MAX)


def all_gather(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank; [obj] in one process."""
    if not active():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def gather_samples(columns: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-sample 1-D tensors concatenated over ranks in rank order: the global batch's.

    Since each rank holds a contiguous slice of the global batch, the result is what a
    single process would have computed, so the step metrics are computed as there.
    """
    if not active():
        return columns
    parts = all_gather({k: v.detach().cpu() for k, v in columns.items()})
    return {k: torch.cat([p[k] for p in parts]) for k in columns}


def barrier() -> None:
    """Wait for every rank; a no-op in one process."""
    if active():
        dist.barrier()


def on_main(fn: Callable[[], T]) -> T:
    """`fn()` on rank 0 only; its result, or the exception it raised, reaches every rank.

    For decisions that must be taken once (claiming the run directory, choosing the
    checkpoint to resume): a failure on rank 0 then stops every rank with the same error
    instead of leaving the others waiting at the next collective.
    """
    if not active():
        return fn()
    box: list[Any] = [(None, None)]
    if is_main():
        try:
            box = [(fn(), None)]
        except Exception as error:  # noqa: BLE001 - re-raised on every rank below
            box = [(None, error)]
    dist.broadcast_object_list(box, src=0)
    result, error = box[0]
    if error is not None:
        raise error
    return result


def broadcast_parameters(params: Iterable[torch.nn.Parameter]) -> None:
    """Copy rank 0's values into every rank's parameters (a no-op in one process).

    Seeded initialisation already agrees across ranks; this makes the start identical
    whatever the kernels, as DDP does at construction.
    """
    if not active():
        return
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=0)


def all_reduce_grads(params: Iterable[torch.nn.Parameter]) -> float:
    """Sum each parameter's gradient over ranks, in place; returns the seconds it took.

    A sum, not a mean: every rank's loss is already divided by the global count. Every
    rank must pass the same parameters in the same order; one without a gradient on this
    rank (no samples reached it) contributes zeros. Gradients travel in flat buckets of
    about BUCKET_BYTES, one all_reduce each. On CUDA the time includes a synchronisation
    before and after, so it measures the collective itself. Parameters FSDP2 shards
    (DTensors, sharding=fsdp2) are skipped: their backward already summed their gradients.
    """
    if not active():
        return 0.0
    from torch.distributed.tensor import DTensor

    grads = []
    for p in params:
        if isinstance(p, DTensor):
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    _synchronize(grads)
    t0 = time.perf_counter()
    for bucket in _buckets(grads):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    _synchronize(grads)
    return time.perf_counter() - t0


def _buckets(grads: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of same-dtype, same-device gradients of about BUCKET_BYTES each."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        if bucket and (size >= BUCKET_BYTES or (g.dtype, g.device) != (bucket[0].dtype, bucket[0].device)):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel() * g.element_size()
    if bucket:
        yield bucket


def _synchronize(tensors: list[torch.Tensor]) -> None:
    if tensors and tensors[0].is_cuda:
        torch.cuda.synchronize(tensors[0].device)


# --------------------------------------------------------------------------- launching


def exec_torchrun(nproc: int, argv: Sequence[str]) -> NoReturn:
    """Replace this process with `torchrun --standalone --nproc_per_node nproc -m nla_shell.cli argv`.

    exec, not a child process: signals (Ctrl-C, a scheduler's SIGTERM) reach torchrun
    itself, which stops its workers, and its exit status is the command's. --standalone
    picks a free rendezvous port, so concurrent jobs on one machine never collide.
    """
    if rank_info().world_size > 1 or "LOCAL_RANK" in os.environ:
        raise ConfigError("--nproc is given but this process already runs under torchrun; use one or the other")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "-m", "nla_shell.cli", *argv,
    ]
    print(f"[nla] launching: {' '.join(command[1:])}", flush=True)
    sys.stderr.flush()
    os.execv(sys.executable, command)
