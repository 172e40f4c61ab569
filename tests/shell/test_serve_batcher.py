"""The batcher behind `nla serve` (nla_shell.serving.batcher) on a stand-in reader: cancellation stays local, a
cancelled job never reaches the engine, a full queue refuses at once, a dead worker fails only what it held."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from nla_shell.serving.batcher import Batcher, QueueFull, WorkerDied
from nla_shell.serving.jobs import Decoding, Job
from serve_harness import Crash, StandInReader

GREEDY = Decoding(samples=1, greedy=True, max_new_tokens=4)


def job(first: float) -> Job:
    return Job(GREEDY, vectors=torch.tensor([[first, 0.0, 0.0, 0.0]]))


def explanations(future) -> list[str]:
    return [site.explanation for site in future.result(timeout=10)]


@pytest.fixture
def blocked():
    """A stand-in reader whose engine waits for its gate; the gate opens after the test at the latest."""
    reader = StandInReader()
    reader.gate.clear()
    yield reader
    reader.gate.set()


def test_a_job_cancelled_while_its_batch_runs_fails_no_one_else_in_the_batch(blocked):
    """Issue 47's reproduction: job 1 cancelled while the batch holding jobs 1 and 2 is explained. Before the fix
    set_result on the cancelled future raised InvalidStateError, which failed job 2, whose result was computed."""
    batcher = Batcher(blocked, max_sites=8, wait_s=0.5)
    try:
        first, second = job(1.0), job(2.0)
        batcher.submit(first)
        batcher.submit(second)
        assert blocked.entered.wait(timeout=10)  # both jobs are in the batch being explained
        first.future.cancel()
        blocked.gate.set()
        assert explanations(second.future) == ["site 2"]
        assert batcher.stats["batches"] == 1 and batcher.stats["jobs"] == 2
    finally:
        batcher.close()


def test_a_job_cancelled_before_it_starts_never_reaches_the_engine(blocked):
    batcher = Batcher(blocked, max_sites=1, wait_s=0.0)
    try:
        running, waiting, later = job(1.0), job(2.0), job(3.0)
        batcher.submit(running)
        assert blocked.entered.wait(timeout=10)
        batcher.submit(waiting)
        assert waiting.future.cancel()  # its client left while it waited
        assert batcher.waiting == 0  # it holds no place in the queue
        batcher.submit(later)
        blocked.gate.set()
        assert explanations(running.future) == ["site 1"] and explanations(later.future) == ["site 3"]
        assert blocked.seen == [1.0, 3.0]
        assert batcher.stats["dropped_jobs"] == 1 and batcher.stats["jobs"] == 2
    finally:
        batcher.close()


def test_a_full_queue_refuses_at_once_and_frees_as_the_worker_takes_jobs(blocked):
    batcher = Batcher(blocked, max_sites=1, wait_s=0.0, max_queue=2)
    try:
        jobs = [job(float(i)) for i in range(3)]
        batcher.submit(jobs[0])
        assert blocked.entered.wait(timeout=10)  # taken by the worker: no longer waiting
        batcher.submit(jobs[1])
        batcher.submit(jobs[2])
        start = time.monotonic()
        with pytest.raises(QueueFull, match="2 requests are waiting"):
            batcher.submit(job(9.0))
        assert time.monotonic() - start < 0.5 and batcher.stats["refused_jobs"] == 1
        blocked.gate.set()
        assert [explanations(j.future) for j in jobs] == [["site 0"], ["site 1"], ["site 2"]]
        assert explanations(batcher.submit(job(4.0))) == ["site 4"]
    finally:
        batcher.close()


def test_a_worker_that_dies_fails_the_jobs_it_held_and_a_new_worker_serves_the_next():
    reader = StandInReader(fault=Crash("the engine's thread state is gone"))
    batcher = Batcher(reader, max_sites=8, wait_s=0.0)
    try:
        held = batcher.submit(job(1.0))
        with pytest.raises(WorkerDied, match="the worker stopped on Crash: the engine's thread state is gone"):
            held.result(timeout=10)
        assert explanations(batcher.submit(job(2.0))) == ["site 2"]
        assert batcher.stats["worker_restarts"] == 1
    finally:
        batcher.close()


def test_a_batch_gathers_while_requests_keep_arriving_up_to_its_longest_wait():
    """Under load the engine gets full batches: a job arriving within wait_s of the last joins, until max_wait_s."""
    reader = StandInReader()
    batcher = Batcher(reader, max_sites=64, wait_s=0.15, max_wait_s=10.0)
    try:
        futures = []
        for i in range(4):  # 0.05 s apart: each within wait_s of the one before, 0.15 s in all
            futures.append(batcher.submit(job(float(i))))
            time.sleep(0.05)
        for future in futures:
            future.result(timeout=10)
        assert batcher.stats["batches"] == 1 and batcher.stats["largest_batch_sites"] == 4
        alone = time.monotonic()
        batcher.submit(job(9.0)).result(timeout=10)  # alone: it waits wait_s, not max_wait_s
        assert time.monotonic() - alone < 2.0
    finally:
        batcher.close()


def test_batches_are_padded_to_one_shape_only_for_an_engine_with_cuda_graphs():
    """The native engine on a GPU captures CUDA graphs per batch shape: the batcher asks for max_sites prompts every
    call there (reader.explain pads and drops the extra), and for no padding elsewhere."""
    for engine, padded in ((SimpleNamespace(cuda_graphs=True), 8), (SimpleNamespace(cuda_graphs=False), None),
                           (None, None)):
        reader = StandInReader(engine=engine)
        batcher = Batcher(reader, max_sites=8, wait_s=0.0)
        try:
            assert explanations(batcher.submit(job(1.0))) == ["site 1"]
        finally:
            batcher.close()
        assert reader.pad_to == [padded]
