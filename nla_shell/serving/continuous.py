"""Continuous batching for `nla serve` (engine=native or vllm): sites join the engine as others finish.

With `continuous_batching` on, the batcher's worker (nla_shell.serving.batcher) hands each job it
takes to a `SlotScheduler`, which captures a text's activations, queues the job's sites, and on
every `advance` admits waiting sites into the free slots of its stream decoder, runs one step,
and collects the rows that ended (EOS or their max_new_tokens). A job is answered when all its
sites x samples have ended: the AR scores the jobs completed at one step in one pass
(`NLAReader.site_results`, the scoring `explain` does) and each future gets its results.

The decoder (a StreamDecoder, nla_shell.engines.base; `stream_decoder` picks it) is
- engine=native: a `SlotDecoder` (nla_shell.engines.native_stream): one prefill per admission,
  the injection at each prompt's marker, one decode step per `advance`;
- engine=vllm: a `VLLMStream` (nla_shell.engines.vllm_stream): each site one vLLM request (n =
  its samples) handed to vLLM's own scheduler, one `LLMEngine.step()` per `advance`. Tested
  against a stand-in that follows vLLM 0.24's LLMEngine API, not on vLLM.
The scheduler is the same for both: every job keeps its own decoding settings (samples, greedy,
max_new_tokens), so jobs with different settings decode together; sites are admitted in arrival
order; a site needs `samples` free slots at once.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import torch

from nla_shell.engines.base import FinishedRow, Rollout, RolloutEngine, RolloutRequest, StreamDecoder
from nla_shell.engines.native import NativeRolloutEngine
from nla_shell.engines.native_stream import SlotDecoder
from nla_shell.engines.vllm import VLLMRolloutEngine
from nla_shell.engines.vllm_stream import VLLMStream
from nla_shell.serving.jobs import Job
from nla_shell.serving.reader import NLAReader


@dataclass
class _InFlight:
    """A started job: its vectors [n, D], its rows' rollouts (site-major), how far its sites got."""

    job: Job
    vectors: torch.Tensor
    rollouts: list[Rollout | None] = field(default_factory=list)
    admitted: int = 0  # sites handed to the decoder
    left: int = 0  # rows not yet ended

    @property
    def samples(self) -> int:
        return self.job.decoding.samples


def stream_decoder(engine: RolloutEngine, *, slots: int, max_prompt_len: int, max_new_tokens: int,
                   engine_name: str) -> StreamDecoder:
    """The StreamDecoder of `engine`: a SlotDecoder on a native engine, a VLLMStream on a vLLM one; ValueError on any
    other (`engine_name` names it)."""
    if isinstance(engine, NativeRolloutEngine):
        return SlotDecoder(engine, slots=slots, max_prompt_len=max_prompt_len, max_new_tokens=max_new_tokens)
    if isinstance(engine, VLLMRolloutEngine):
        return VLLMStream(engine, slots=slots, max_new_tokens=max_new_tokens)
    raise ValueError(f"continuous_batching needs engine=native or engine=vllm, this reader's is {engine_name}")


class SlotScheduler:
    """Feeds jobs' sites into a stream decoder's free slots between steps and answers each job when its rows end.

    slots: rows in flight at once (sites x samples); max_new_tokens: the longest explanation a job may ask for.
    `stats` (the batcher's) counts admissions as batches, answered jobs and sites, decode steps and the most rows
    in flight, and the worker's seconds in each phase: `admit_s` (captures and prefills), `step_s` (decode steps,
    the host's waits on the device included) and `answer_s` (the AR's scoring and the answers).
    """

    def __init__(self, reader: NLAReader, *, slots: int, max_new_tokens: int, stats: dict[str, int]) -> None:
        self.reader, self.stats = reader, stats
        self.decoder = stream_decoder(reader.engine, slots=slots, max_prompt_len=len(reader.prompt),
                                      max_new_tokens=max_new_tokens, engine_name=reader.engine_name)
        for key in ("decode_steps", "admit_s", "step_s", "answer_s"):
            self.stats.setdefault(key, 0)
        self._jobs: dict[int, _InFlight] = {}
        self._waiting: deque[int] = deque()  # jobs with sites not yet admitted, in arrival order
        self._ids = itertools.count()

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    @property
    def room(self) -> int:
        """Slots free once the waiting sites are admitted (the worker takes another job only while this is > 0)."""
        queued = sum((len(f.vectors) - f.admitted) * f.samples for f in map(self._jobs.get, self._waiting))
        return self.decoder.free - queued

    def held(self) -> list[Job]:
        """The jobs started and not yet answered."""
        return [flight.job for flight in self._jobs.values()]

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with self.decoder.running():
            yield

    def add(self, job: Job) -> None:
        """Start a job: its vectors (a text's captured now), its sites queued for slots. A capture that fails
        fails this job only."""
        if job.decoding.samples > self.decoder.n_slots:
            job.future.set_exception(ValueError(f"samples={job.decoding.samples} needs more than the server's "
                                                f"{self.decoder.n_slots} decode slots (max_batch)"))
            return
        try:
            vectors = job.vectors
            if vectors is None:
                with self._timed("admit_s"):
                    vectors = self.reader.capture([job.token_ids], [job.positions])[0]
        except Exception as err:  # noqa: BLE001 - this request fails; the server keeps serving
            job.future.set_exception(err)
            return
        job_id = next(self._ids)
        rows = len(vectors) * job.decoding.samples
        self._jobs[job_id] = _InFlight(job, vectors.float(), rollouts=[None] * rows, left=rows)
        self._waiting.append(job_id)

    def advance(self) -> None:
        """Admit what fits, decode one step, answer the jobs whose rows have all ended. An engine that raises fails
        every started job (their slots freed); the server goes on."""
        try:
            with self._timed("admit_s"):
                ended = self._admit()
            if self.decoder.busy:
                with self._timed("step_s"):
                    ended += self.decoder.step()
                self.stats["decode_steps"] += 1
        except Exception as err:  # noqa: BLE001 - the requests in flight fail; the server keeps serving
            self.fail_all(err)
            return
        with self._timed("answer_s"):
            self._collect(ended)

    def _collect(self, ended: list[FinishedRow]) -> None:
        """The ended rows into their jobs; the jobs whose rows have all ended answered, one AR pass per samples
        setting."""
        complete = []
        for row in ended:
            job_id, site = row.key
            flight = self._jobs[job_id]
            flight.rollouts[site * flight.samples + row.sample] = row.rollout
            flight.left -= 1
            if flight.left == 0:
                complete.append(self._jobs.pop(job_id))
        for samples in dict.fromkeys(flight.samples for flight in complete):
            self._answer([flight for flight in complete if flight.samples == samples])

    @contextlib.contextmanager
    def _timed(self, key: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stats[key] += time.perf_counter() - start

    def fail_all(self, err: BaseException) -> None:
        """Fail every started job with `err` and free every slot."""
        for flight in self._jobs.values():
            if not flight.job.future.done():
                flight.job.future.set_exception(err)
        self.reset()

    def reset(self) -> None:
        """Forget every job and free every slot (a new worker starts from here)."""
        self.decoder.drop_all()
        self._jobs.clear()
        self._waiting.clear()

    # ------------------------------------------------------------------ the phases of a step

    def _admit(self) -> list[FinishedRow]:
        """Waiting sites into free slots, in arrival order: one admission (native: one prefill) per run of jobs that
        share their samples. Returns the rows that ended at once (native, max_new_tokens 1)."""
        ended = []
        while self._waiting and self.decoder.free >= self._jobs[self._waiting[0]].samples:
            samples, sites = self._next_sites()
            ended += self.decoder.admit([RolloutRequest(self.reader.prompt, f.vectors[i]) for _, i, f in sites],
                                        keys=[(job_id, i) for job_id, i, _ in sites], rows=samples,
                                        max_new_tokens=[f.job.decoding.max_new_tokens for _, _, f in sites],
                                        greedy=[f.job.decoding.greedy for _, _, f in sites])
            self.stats["batches"] += 1
            self.stats["largest_batch_sites"] = max(self.stats["largest_batch_sites"],
                                                    self.decoder.n_slots - self.decoder.free)
        return ended

    def _next_sites(self) -> tuple[int, list[tuple[int, int, _InFlight]]]:
        """(samples, [(job id, site, its job)]): the waiting sites of the leading jobs that share the first one's
        samples, as many as the free slots hold; those jobs' `admitted` advanced."""
        samples = self._jobs[self._waiting[0]].samples
        room, sites = self.decoder.free // samples, []
        while self._waiting and room and self._jobs[self._waiting[0]].samples == samples:
            job_id = self._waiting[0]
            flight = self._jobs[job_id]
            take = min(len(flight.vectors) - flight.admitted, room)
            sites += [(job_id, i, flight) for i in range(flight.admitted, flight.admitted + take)]
            flight.admitted += take
            room -= take
            if flight.admitted == len(flight.vectors):
                self._waiting.popleft()
        return samples, sites

    def _answer(self, flights: list[_InFlight]) -> None:
        """Jobs (of one samples setting) whose rows all ended at this step: one AR pass over them all, and each future
        gets its sites' results. A scoring failure fails these jobs only."""
        try:
            results = self.reader.site_results(torch.cat([flight.vectors for flight in flights]),
                                               [r for flight in flights for r in flight.rollouts],
                                               samples=flights[0].samples)
        except Exception as err:  # noqa: BLE001 - these requests fail; the server keeps serving
            for flight in flights:
                flight.job.future.set_exception(err)
            return
        start = 0
        for flight in flights:  # started (running): set_result cannot meet a cancelled future
            flight.job.future.set_result(results[start : start + len(flight.vectors)])
            start += len(flight.vectors)
        self.stats.update(sites=self.stats["sites"] + start, jobs=self.stats["jobs"] + len(flights))
