"""The orchestrator's shutdown: no request accepted around stop() is left waiting forever.

Jobs here are cancelled before they are submitted, so the worker finishes them at its first turn
without running an engine; what is tested is the queue bookkeeping, with the real worker thread.
"""

import asyncio
import threading

import pytest

from dflash_trt.server.metrics import ServerMetrics
from dflash_trt.server.orchestrator import Job, Orchestrator, QueueFull, ShuttingDown


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def cancelled_job(loop, i: int) -> Job:
    job = Job(id=str(i), row=None, loop=loop, deadline=float("inf"))
    job.cancel()
    return job


def test_pending_jobs_are_finished_when_the_worker_stops(loop):
    orch = Orchestrator(None, ServerMetrics(), max_active=1, max_queue=4)
    jobs = [cancelled_job(loop, i) for i in range(3)]
    orch._pending.extend(jobs)  # queued, never picked up: the worker sees the stop flag first
    orch._stopping = True
    orch._run()  # returns at once
    assert all(j.finished for j in jobs) and not orch._pending and orch.busy == 0


def test_submit_racing_stop_never_strands_a_job(loop):
    """A submitter thread races stop(): every accepted job ends finished, every other one is refused."""
    for attempt in range(20):
        orch = Orchestrator(None, ServerMetrics(), max_active=1, max_queue=10_000)
        orch.start()
        accepted, started = [], threading.Event()

        def submitter():
            for i in range(100_000):
                job = cancelled_job(loop, i)
                try:
                    orch.submit(job)
                except ShuttingDown:
                    return
                except QueueFull:
                    continue
                accepted.append(job)
                started.set()

        t = threading.Thread(target=submitter)
        t.start()
        started.wait(10)
        orch.stop()
        t.join(10)
        assert not t.is_alive()
        assert accepted and all(j.finished for j in accepted), f"attempt {attempt}: a job was left waiting"
        with pytest.raises(ShuttingDown):
            orch.submit(cancelled_job(loop, -1))
