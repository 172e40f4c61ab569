"""What every stage of a run shares (datagen, SFT, RL, eval, serving): the device and dtype, the
optimiser, the global seed, the data order, and the one voice that tells the run's story."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from nla_shell.io.config import ConfigError
from nla_shell.io.progress import say_line
from nla_shell.training import distributed
from nla_shell.training.distributed import RankInfo


def resolve_device(device: str, dtype: str, rank: RankInfo = RankInfo()) -> tuple[torch.device, torch.dtype]:
    """"auto" -> cuda when available, else cpu; dtype "auto" -> bf16 on cuda, fp32 on cpu.

    Under torchrun each rank takes its own GPU: "auto" and "cuda" become cuda:LOCAL_RANK.
    """
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available; use device=cpu or device=auto")
    if dev.type == "cuda" and rank.world_size > 1:
        if dev.index is not None:
            raise ConfigError(
                f"config key 'device' = {device!r} is invalid under torchrun: every rank uses the GPU "
                "of its LOCAL_RANK; use device=cuda or device=auto"
            )
        if rank.local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"rank {rank.rank} has LOCAL_RANK {rank.local_rank} but only {torch.cuda.device_count()} GPU(s) "
                "are visible: launch at most one rank per GPU (--nproc / --nproc_per_node)"
            )
        dev = torch.device("cuda", rank.local_rank)
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def make_optimizer(params: list[torch.nn.Parameter], lr: float, *, device: torch.device, label: str) -> torch.optim.Optimizer:
    """8-bit AdamW (bitsandbytes) on CUDA when installed, else torch AdamW; says which. Parameters FSDP2 shards
    (sharding=fsdp2) take torch AdamW: bitsandbytes' kernels take whole tensors, not DTensors."""
    from torch.distributed.tensor import DTensor

    if device.type == "cuda" and not any(isinstance(p, DTensor) for p in params):
        try:
            import bitsandbytes as bnb

            say(f"[optim] {label}: bitsandbytes AdamW8bit")
            return bnb.optim.AdamW8bit(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        except ImportError:
            pass
    say(f"[optim] {label}: torch AdamW (fp32 moments)")
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def say(message: str, *, error: bool = False) -> None:
    """Print on rank 0 only: every rank runs the same story, one voice tells it (above the progress bar)."""
    if distributed.is_main():
        say_line(message, error=error)


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's (CPU and CUDA) global RNGs."""
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed)


@dataclass
class DataOrder:
    """Epoch-wise seeded permutations of the training rows; the cursor is (epoch, offset)."""

    n_rows: int
    seed: int
    epoch: int = 0
    offset: int = 0

    def next_batch(self, size: int) -> list[int]:
        if self.offset + size > self.n_rows:
            self.epoch, self.offset = self.epoch + 1, 0
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n_rows)
        picked = order[self.offset : self.offset + size].tolist()
        self.offset += size
        return picked

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}
