"""Concurrent requests batched into the engine: one worker thread owns the models.

Each request becomes a `Job` (vectors, or a text's token ids and positions, and its decoding
settings) handed to `Batcher.submit`, which returns a Future, or raises `QueueFull` when
`max_queue` jobs already wait. The worker takes the first waiting job and gathers what else
arrives, up to `max_sites` sites, until no job has arrived for `wait_s` or `max_wait_s` has
passed since the first: under load the engine gets full batches, and a lone request waits
`wait_s`. Jobs that share their decoding settings (samples, greedy, max_new_tokens) run as one
engine call: the texts' activations are captured together, then every site is explained in
one batch.

A job starts when the worker takes it into a batch (`Future.set_running_or_notify_cancel`):
one cancelled before that (its client gone or timed out) is dropped, its sites never reach
the engine, and once started it can no longer be cancelled, so a client that leaves fails no
one else. An engine that raises fails that batch's futures and the worker goes on; a worker
that dies (anything escaping the loop) fails the jobs it held and those waiting, and a new
worker takes its place.

By default batching is per engine call, not per decode step: a batch runs to its end before
the next starts (no admission of new sequences between decode steps). On an engine with CUDA
graphs (native on a GPU) every call is padded to `max_sites` prompts, one batch shape for all.
With `continuous=True` (engine=native or vllm) the worker instead keeps `max_sites` slots busy
(nla_shell.serving.continuous): it takes a waiting job whenever slots are free for it, feeds
its sites into them between steps (native: its own decode loop; vllm: vLLM's scheduler, handed
no more rows than the slots), and answers each job once all its sites have ended and been
scored; a job waits in the queue (cancellable, counted by `waiting`) until then.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

import torch

from nla_shell.serving.continuous import SlotScheduler
from nla_shell.serving.jobs import Decoding, Job
from nla_shell.serving.reader import NLAReader


class QueueFull(Exception):
    """`max_queue` jobs already wait: the request is refused at once (503)."""


class WorkerDied(RuntimeError):
    """The worker thread stopped on an error while it held this job (500)."""


class Batcher:
    """The worker thread and its queue; `stats` counts batches, sites, dropped jobs and worker restarts (GET /v1/info
    shows them)."""

    def __init__(self, reader: NLAReader, *, max_sites: int, wait_s: float, max_wait_s: float | None = None,
                 max_queue: int | None = None, continuous: bool = False, max_new_tokens: int = 256) -> None:
        self.reader, self.max_sites, self.wait_s = reader, max_sites, wait_s
        self.max_wait_s = wait_s if max_wait_s is None else max(max_wait_s, wait_s)
        self.max_queue = max_queue
        # An engine with CUDA graphs (native on a GPU) captures them per batch shape: every batch is padded to
        # max_sites so that one shape serves, rather than a capture for each new batch size the traffic makes.
        self.pad_to = max_sites if getattr(reader.engine, "cuda_graphs", False) else None
        self.stats = {"batches": 0, "sites": 0, "jobs": 0, "largest_batch_sites": 0, "dropped_jobs": 0,
                      "refused_jobs": 0, "worker_restarts": 0}
        # continuous: max_sites decode slots (rows: sites x samples), each as long as max_new_tokens at most
        self._scheduler = SlotScheduler(reader, slots=max_sites, max_new_tokens=max_new_tokens,
                                        stats=self.stats) if continuous else None
        if continuous:
            self.stats["idle_s"] = 0.0
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._submit_lock = threading.Lock()
        self._closing = False
        self._idle_since: float | None = None  # when the continuous worker began waiting for a job, while it waits
        self._thread = self._start_worker()

    def submit(self, job: Job) -> Future:
        """Queue a job; its future gets the job's SiteExplanations. Raises QueueFull when max_queue jobs wait."""
        with self._submit_lock:
            if (reason := self.refusal()) is not None:
                raise QueueFull(reason)
            self._queue.put(job)
        return job.future

    def refusal(self) -> str | None:
        """Why a job arriving now is refused (max_queue jobs wait), counted in stats["refused_jobs"]; None when
        there is room. The server asks before reading a request's body, and submit asks again."""
        if self.max_queue is None or (waiting := self.waiting) < self.max_queue:
            return None
        self.stats["refused_jobs"] += 1
        return f"{waiting} requests are waiting (the limit, max_queue)"

    def counters(self) -> dict[str, float]:
        """`stats` as of now: a wait of the worker still under way counts in idle_s up to this moment. (Copied
        before `_idle_since` is read, and the worker clears that before it adds the wait: a wait is never counted
        twice.)"""
        counters = dict(self.stats)
        if (since := self._idle_since) is not None:
            counters["idle_s"] += time.perf_counter() - since
        return counters

    @property
    def waiting(self) -> int:
        """Jobs queued, not yet taken by the worker and not cancelled (a cancelled one holds no place in the queue:
        the worker drops it)."""
        with self._queue.mutex:
            return sum(job is not None and not job.future.cancelled() for job in self._queue.queue)

    def close(self) -> None:
        self._closing = True
        self._queue.put(None)
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the worker

    def _start_worker(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="nla-batcher", daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        held: list[Job] = []
        try:
            if self._scheduler is not None:
                self._run_continuously(held)
                return
            while True:
                first = self._queue.get()
                if first is None:
                    return
                held = [first]
                groups = self._gather(first, held)
                for group in groups.values():
                    self._explain(group)
                held = []
        except BaseException as err:  # noqa: BLE001 - whatever killed the worker, its clients hear of it
            if self._scheduler is not None:
                held = held + self._scheduler.held()  # a job in both is failed once (_worker_died skips done ones)
                self._scheduler.reset()
            self._worker_died(held, err)

    def _run_continuously(self, held: list[Job]) -> None:
        """The worker with continuous batching: between decode steps, take waiting jobs while slots are free for
        them; leave the decoder's session when no job is in flight, and wait for the next (stats["idle_s"]: the
        seconds it waited so, beside the scheduler's admit_s, step_s and answer_s). `held` lists the jobs taken and
        not yet handed to the scheduler."""
        scheduler = self._scheduler
        while True:
            self._idle_since = since = time.perf_counter()
            first = self._queue.get()
            self._idle_since = None
            self.stats["idle_s"] += time.perf_counter() - since
            if first is None:
                return
            closing = False
            with scheduler.running():
                job: Job | None = first
                while True:
                    if job is not None:
                        held[:] = [job]
                        if self._take(job):
                            scheduler.add(job)
                        held.clear()
                    job = None
                    if not closing and scheduler.room > 0:
                        job, closing = self._next_waiting()
                    if job is None:
                        if not scheduler.busy:
                            break
                        scheduler.advance()
            if closing:
                return

    def _next_waiting(self) -> tuple[Job | None, bool]:
        """(a waiting job or None, whether the batcher is closing): without waiting."""
        try:
            job = self._queue.get_nowait()
        except queue.Empty:
            return None, False
        return job, job is None

    def _worker_died(self, held: list[Job], err: BaseException) -> None:
        """Fail the jobs the dead worker held and those waiting (500), then start a new worker."""
        failure = WorkerDied(f"the worker stopped on {type(err).__name__}: {err}")
        while True:  # the waiting jobs too: the new worker may meet the same fault, and no client should wait on it
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._closing = True
            else:
                held.append(job)
        for job in held:
            if job.future.done() or not (job.future.running() or job.future.set_running_or_notify_cancel()):
                continue  # answered before the fault, or cancelled by its client
            job.future.set_exception(failure)
        self.stats["worker_restarts"] += 1
        if not self._closing:
            self._thread = self._start_worker()

    def _take(self, job: Job) -> bool:
        """Start the job (it can no longer be cancelled); False, and it is dropped, when it was cancelled first."""
        if job.future.set_running_or_notify_cancel():
            return True
        self.stats["dropped_jobs"] += 1
        return False

    def _gather(self, first: Job, held: list[Job]) -> dict[Decoding, list[Job]]:
        """The first job and those arriving while the batch gathers (see the module docstring), grouped by decoding;
        cancelled jobs dropped. Every job taken from the queue is appended to `held`."""
        groups: dict[Decoding, list[Job]] = {}
        sites = 0
        start = last = time.monotonic()
        job: Job | None = first
        while True:
            if self._take(job):
                groups.setdefault(job.decoding, []).append(job)
                sites += job.n_sites
            if sites >= self.max_sites:
                break
            now = time.monotonic()
            timeout = min(last + self.wait_s, start + self.max_wait_s) - now
            try:
                job = self._queue.get(timeout=max(timeout, 0)) if sites else self._queue.get()
            except queue.Empty:
                break
            if job is None:
                self._queue.put(None)  # closing: finish this batch, then stop
                break
            held.append(job)
            if not sites:  # everything so far was dropped: this job starts the batch's clock
                start = time.monotonic()
            last = time.monotonic()
        return groups

    def _explain(self, jobs: list[Job]) -> None:
        """One engine call for jobs that share their decoding; each job's future gets its slice of results."""
        try:
            vectors = self._vectors(jobs)
            decoding = jobs[0].decoding
            results = self.reader.explain(vectors, samples=decoding.samples, greedy=decoding.greedy,
                                          max_new_tokens=decoding.max_new_tokens, pad_to=self.pad_to)
        except Exception as err:  # noqa: BLE001 - the requests of this batch fail; the server keeps serving
            for job in jobs:
                job.future.set_exception(err)
            return
        start = 0
        for job in jobs:  # every job is running (see _take): set_result cannot meet a cancelled future
            job.future.set_result(results[start : start + job.n_sites])
            start += job.n_sites
        n_sites = len(vectors)
        self.stats.update(batches=self.stats["batches"] + 1, sites=self.stats["sites"] + n_sites,
                          jobs=self.stats["jobs"] + len(jobs),
                          largest_batch_sites=max(self.stats["largest_batch_sites"], n_sites))

    def _vectors(self, jobs: list[Job]) -> torch.Tensor:
        """[sites, D]: the jobs' vectors in order, the texts' captured in one forward."""
        texts = [job for job in jobs if job.vectors is None]
        captured = iter(self.reader.capture([j.token_ids for j in texts], [j.positions for j in texts]) if texts else [])
        return torch.cat([job.vectors if job.vectors is not None else next(captured) for job in jobs])
