"""The simulator drives the server's own loop (server.orchestrator.BatchLoop) on its virtual clock, so the two
cannot drift: the same requests through the orchestrator's worker thread and through the simulator's driver
make the same admissions, the same steps and the same tokens (issue 56)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from dflash_trt.decoding import GenerationConfig
from dflash_trt.decoding.loop import BatchDecoder
from dflash_trt.server.metrics import ServerMetrics
from dflash_trt.server.orchestrator import BatchLoop, Job, Orchestrator
from dflash_trt.sim import serving
from dflash_trt.sim.cost import ProfileCost
from dflash_trt.sim.engines import VirtualClock, sim_engines
from dflash_trt.sim.policies import sim_decoder

ROWS, REQUESTS, SEED = 4, 12, 3


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Calls of BatchLoop's admit / step / deliver / retire, whoever makes them."""
    calls: Counter[str] = Counter()
    for name in ("admit", "step", "retire"):
        method = getattr(BatchLoop, name)

        def wrapped(self: Any, *a: Any, _m: Any = method, _n: str = name, **k: Any) -> Any:
            calls[_n] += 1
            return _m(self, *a, **k)

        monkeypatch.setattr(BatchLoop, name, wrapped)
    deliver = BatchLoop.deliver

    def counted_deliver(*a: Any) -> None:
        calls["deliver"] += 1
        deliver(*a)

    monkeypatch.setattr(BatchLoop, "deliver", staticmethod(counted_deliver))
    return calls


@pytest.fixture
def aloop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def decoder() -> tuple[BatchDecoder, VirtualClock, serving.Workload]:
    work = serving.workload("mixed", prompt_len="uniform:16-300", output_len="uniform:8-40")
    target, drafter, clock = sim_engines(ProfileCost("a100", "llama-3-8b", 1), work.profiles)
    return sim_decoder("fixed-8", target, drafter, clock, work.profiles, ROWS), clock, work


def config(max_new: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new, sampling=serving.GREEDY, stop_token_ids=())


def test_simulator_and_server_run_the_same_loop(counted: Counter[str], aloop: asyncio.AbstractEventLoop) -> None:
    dec, clock, work = decoder()
    reqs = [serving._Req(p, n, c) for p, n, c in work.requests(REQUESTS, SEED)]
    tally = serving._drive(dec, clock, reqs, ROWS, True, 0.0)
    sim_outputs = [list(r.row.generated) for r in reqs if r.row is not None]
    assert counted["step"] == counted["deliver"] == tally.steps and counted["admit"] >= tally.steps
    sim_calls = dict(counted)
    counted.clear()

    dec, clock, work = decoder()
    orch = Orchestrator(dec, ServerMetrics(), max_active=ROWS, max_queue=REQUESTS)
    jobs = [
        Job(str(i), dec.new_row(p, config(n)), aloop, float("inf"))
        for i, (p, n, _) in enumerate(work.requests(REQUESTS, SEED))
    ]
    for job in jobs:  # all queued before the worker's first turn: it admits ROWS, then one per finished row
        orch.submit(job)
    orch.start()
    try:
        assert orch.wait_idle(120)
    finally:
        orch.stop()
    assert [j.outcome for j in jobs] == ["ok"] * REQUESTS
    assert [list(j.row.generated) for j in jobs] == sim_outputs and all(sim_outputs) and len(sim_outputs) == REQUESTS
    assert counted["step"] == counted["deliver"] == tally.steps  # the same steps, one per turn
    assert sim_calls["step"] == counted["step"]
