"""Concurrent requests batched into the engine: one worker thread owns the models.

Each request becomes a `Job` (vectors, or a text's token ids and positions, and its decoding
settings) handed to `Batcher.submit`, which returns a Future. The worker takes the first
waiting job, gathers whatever else arrives within `wait_s` up to `max_sites` sites, and runs
jobs that share their decoding settings (samples, greedy, max_new_tokens) as one engine call:
the texts' activations are captured together, then every site is explained in one batch. A
failure fails that batch's futures and the worker goes on serving.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Sequence

import torch

from nla_shell.serving.reader import NLAReader


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


class Batcher:
    """The worker thread and its queue; `stats` counts batches and sites (GET /v1/info shows them)."""

    def __init__(self, reader: NLAReader, *, max_sites: int, wait_s: float) -> None:
        self.reader, self.max_sites, self.wait_s = reader, max_sites, wait_s
        self.stats = {"batches": 0, "sites": 0, "jobs": 0, "largest_batch_sites": 0}
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="nla-batcher", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Future:
        self._queue.put(job)
        return job.future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the worker

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            for group in self._gather(first).values():
                self._explain(group)

    def _gather(self, first: Job) -> dict[Decoding, list[Job]]:
        """The first job and those arriving within wait_s (up to max_sites sites), grouped by decoding."""
        groups: dict[Decoding, list[Job]] = {first.decoding: [first]}
        sites, deadline = first.n_sites, time.monotonic() + self.wait_s
        while sites < self.max_sites:
            try:
                job = self._queue.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                break
            if job is None:
                self._queue.put(None)  # closing: finish this batch, then stop
                break
            groups.setdefault(job.decoding, []).append(job)
            sites += job.n_sites
        return groups

    def _explain(self, jobs: list[Job]) -> None:
        """One engine call for jobs that share their decoding; each job's future gets its slice of results."""
        try:
            vectors = self._vectors(jobs)
            decoding = jobs[0].decoding
            results = self.reader.explain(vectors, samples=decoding.samples, greedy=decoding.greedy,
                                          max_new_tokens=decoding.max_new_tokens)
            start = 0
            for job in jobs:
                part = results[start : start + job.n_sites]
                start += job.n_sites
                job.future.set_result(part)  # each kept explanation's reconstruction comes from the scoring pass
        except Exception as err:  # noqa: BLE001 - the requests of this batch fail; the server keeps serving
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(err)
            return
        n_sites = len(vectors)
        self.stats.update(batches=self.stats["batches"] + 1, sites=self.stats["sites"] + n_sites,
                          jobs=self.stats["jobs"] + len(jobs),
                          largest_batch_sites=max(self.stats["largest_batch_sites"], n_sites))

    def _vectors(self, jobs: list[Job]) -> torch.Tensor:
        """[sites, D]: the jobs' vectors in order, the texts' captured in one forward."""
        texts = [job for job in jobs if job.vectors is None]
        captured = iter(self.reader.capture([j.token_ids for j in texts], [j.positions for j in texts]) if texts else [])
        return torch.cat([job.vectors if job.vectors is not None else next(captured) for job in jobs])

