"""A request's work as the server's worker sees it: its sites and the decoding settings it shares with others.

Both ways of batching (nla_shell.serving.batcher per engine call, nla_shell.serving.continuous per decode
step) take these.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True)
class Decoding:
    """The settings a batch shares."""

    samples: int
    greedy: bool
    max_new_tokens: int


@dataclass
class Job:
    """One request's sites: `vectors` [n, D], or a text's `token_ids` and the `positions` to read."""

    decoding: Decoding
    vectors: torch.Tensor | None = None
    token_ids: Sequence[int] | None = None
    positions: Sequence[int] = ()
    future: Future = field(default_factory=Future)

    @property
    def n_sites(self) -> int:
        return len(self.vectors) if self.vectors is not None else len(self.positions)
