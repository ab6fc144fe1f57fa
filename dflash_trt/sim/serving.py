"""Serving on the simulated engines: workloads, block-size policies, and the driver that steps the real loop.

The driver runs the server's own loop (`server.orchestrator.BatchLoop`, the turn the orchestrator's worker
thread runs) without threads or HTTP: requests wait in its FIFO (validated by `new_row` on arrival), join the
`BatchDecoder` while fewer than `max_active` rows are active, every turn is one step whose rounds go to their
requests, and a finished row leaves as in the server. Time
is the engines' virtual clock plus the host's work per step (`host_step_s`, measured: see there). Arrivals are closed-loop (`concurrency` requests in
flight, a finished one replaced at once) or open-loop Poisson (`rate` requests per second).

Policies: `policies.py` (each a `decoding.policy.BlockPolicy`, so the driver never reaches into the decoder).
"""

from __future__ import annotations

import collections
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache, partial
from pathlib import Path
from typing import cast

from ..decoding import GenerationConfig, Round, SamplingParams
from ..decoding.chunking import BACKLOG_STEPS, STALL
from ..decoding.loop import BatchDecoder
from ..decoding.proposers import DEFAULT_PROPOSER, proposer_for
from ..decoding.row import BatchRow
from ..server.orchestrator import BatchLoop
from .acceptance import POOR, AcceptanceProfile, paper_profiles
from .cost import PassCost
from .engines import VirtualClock, sim_engines
from .measured import HOST_STEP, read
from .optimum import Optimum
from .policies import TimedPolicy, sim_decoder
from .suffix import Proposing

GREEDY = SamplingParams(0.0)

PREFILL = ("separate", "chunked")
# The host's work per decoder step (policy, acceptance, commits, rollbacks, stop checks, batching) is measured,
# not assumed: `make bench-parts` runs the real loop on the simulator's zero-cost engines and records the CPU time
# of a step at C rows less the fake engines' own ("sim_host", copied to data/measured/host-step.json: measured.py).
# From the CPU that measured it to a GPU server's host: 1.0. The figure is CPU time of the loop's one thread (time
# spent waiting for the shared machine's other processes is not in it) on a Sapphire Rapids-class Xeon core (AMX),
# the core family of the DGX H100's host CPUs (Xeon Platinum 8480C), and Python's single-thread speed is a core's,
# not a node's. No GPU host has run it, so no other factor is taken
# (docs/benchmarks.md#make-bench-parts-the-parts-of-a-round).
CPU_TO_GPU_HOST = 1.0


@cache
def _host_curve(path: Path = HOST_STEP) -> tuple[tuple[int, float], ...]:
    data = read(path, "host-step")["sim_host"]
    return tuple(sorted((int(c), float(v["host_ms"]) * 1e-3) for c, v in data.items()))


def host_step_s(rows: int, path: Path = HOST_STEP) -> float:
    """Seconds of host work for one step of `rows` rows on a GPU server: the measured curve (linear between the
    measured C, flat beyond its ends) times CPU_TO_GPU_HOST."""
    curve = _host_curve(path)
    if rows <= curve[0][0]:
        return curve[0][1] * CPU_TO_GPU_HOST
    for (c0, s0), (c1, s1) in zip(curve, curve[1:]):
        if rows <= c1:
            return (s0 + (s1 - s0) * (rows - c0) / (c1 - c0)) * CPU_TO_GPU_HOST
    return curve[-1][1] * CPU_TO_GPU_HOST


def __getattr__(name: str) -> float:
    """HOST_STEP_S: one row's step (`host_step_s(1)`), for callers that price a step without its batch; read on
    first use, so that importing this module needs no measurement."""
    if name == "HOST_STEP_S":
        return host_step_s(1)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- workloads ----------------------------------------------------------------------------
def length_sampler(spec: str) -> Callable[[random.Random], int]:
    """A named length distribution: "fixed:N", "uniform:A-B", "lognormal:MEDIAN,SIGMA[,MIN-MAX]"."""
    kind, _, args = spec.partition(":")
    if kind == "fixed":
        n = int(args)
        return lambda rng: n
    if kind == "uniform":
        a, b = (int(x) for x in args.split("-"))
        return lambda rng: rng.randint(a, b)
    if kind == "lognormal":
        parts = args.split(",")
        median, sigma = float(parts[0]), float(parts[1])
        lo, hi = (int(x) for x in parts[2].split("-")) if len(parts) > 2 else (1, 1 << 20)
        return lambda rng: min(hi, max(lo, round(median * math.exp(rng.gauss(0.0, sigma)))))
    raise ValueError(f"unknown length distribution {spec!r} (fixed:N, uniform:A-B, lognormal:MEDIAN,SIGMA[,MIN-MAX])")


@dataclass(frozen=True)
class Workload:
    """Requests whose acceptance class is drawn from `mix` (class name -> weight)."""

    name: str
    profiles: tuple[AcceptanceProfile, ...]
    mix: tuple[float, ...]
    prompt_len: str = "lognormal:512,0.6,32-4096"
    output_len: str = "lognormal:192,0.5,32-1024"

    def requests(self, n: int, seed: int = 0) -> list[tuple[list[int], int, int]]:
        """n (prompt ids, max_new_tokens, class) triples: the prompt's first id is the class (engines.py)."""
        rng = random.Random(seed)
        plen, olen = length_sampler(self.prompt_len), length_sampler(self.output_len)
        out = []
        for _ in range(n):
            c = rng.choices(range(len(self.profiles)), weights=self.mix)[0]
            prompt = [c] + _uniform_ids(rng, len(self.profiles), 256, plen(rng) - 1)
            out.append((prompt, olen(rng), c))
        return out


def _uniform_ids(rng: random.Random, lo: int, hi: int, n: int) -> list[int]:
    """`[rng.randrange(lo, hi) for _ in range(n)]`, the same numbers from the same generator state (randrange's
    rejection sampling on getrandbits of the width's bit length, without its argument checks per call: most of
    a workload's sampling time)."""
    width = hi - lo
    k, bits, out = width.bit_length(), rng.getrandbits, []
    for _ in range(n):
        r = bits(k)
        while r >= width:
            r = bits(k)
        out.append(lo + r)
    return out


def workload(name: str, **lengths: str) -> Workload:
    """ "paper": each request from one of the paper's benchmarks (equal weights); "mixed": half of them
    accept poorly (tau ~2 at block 16), the other half as "paper"; a benchmark name: that benchmark only.
    A "-t1" suffix takes the paper's T = 1 acceptance instead of T = 0 ("paper-t1", "math500-t1")."""
    t1 = name.endswith("-t1")
    paper = paper_profiles(temperature=1.0 if t1 else 0.0)
    name = name.removesuffix("-t1")
    label = name + ("-t1" if t1 else "")
    if name == "paper":
        return Workload(label, tuple(paper.values()), (1.0,) * len(paper), **lengths)
    if name == "mixed":
        return Workload(label, (*paper.values(), POOR), (0.5 / len(paper),) * len(paper) + (0.5,), **lengths)
    if name in paper:
        return Workload(label, (paper[name],), (1.0,), **lengths)
    raise ValueError(f"unknown workload {name!r}: paper, mixed or one of {sorted(paper)}, each with -t1 or not")


# ---- the driver ---------------------------------------------------------------------------
@dataclass
class _Req:
    prompt: list[int]
    max_new: int
    klass: int
    arrival: float = 0.0
    row: BatchRow | None = None
    first: float | None = None
    last: float | None = None
    itl: list[float] = field(default_factory=list)
    done_at: float | None = None
    tokens: int = 0


@dataclass
class RunResult:
    policy: str
    concurrency: int | None
    rate: float | None
    requests: int
    tokens: int
    sim_seconds: float
    tokens_per_s: float  # output tokens per simulated second over the steady window
    ttft_s: dict[str, float]
    itl_s: dict[str, float]
    goodput_rps: float  # requests per second meeting the SLO
    steps: int
    mean_batch: float
    mean_block: float
    tau: float  # committed tokens per verify round
    policy_cpu_s_per_step: float  # real CPU seconds the block-size choice took per step (thread time)
    simulated_step_s: float  # mean simulated seconds per step
    # the same two over the steady window (closed loop: the batch full all along, as for tokens_per_s; nan
    # without one): the figures "at C rows", which the run's means dilute with its ramp and drain (fewer
    # rows, cheaper choices) and with the first step's prefill of every prompt at once
    policy_cpu_s_per_steady_step: float = float("nan")
    simulated_steady_step_s: float = float("nan")
    prefill: str = "separate"  # how prompts entered: "separate" (a pass of their own) or "chunked"
    optimum_gap: float | None = None  # "optimum" only: mean certified bound over its chosen rate, minus 1
    proposer: str = DEFAULT_PROPOSER  # what the requests named (sim/suffix.py: suffix runs replayed from a trace)
    # per proposer of the verify rounds (`request.Round.proposer`): rounds, drafted tokens, accepted drafts
    proposers: dict[str, dict[str, int]] = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)


def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def simulate(
    cost: PassCost,
    work: Workload,
    policy: str,
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    requests: int = 64,
    max_active: int | None = None,
    seed: int = 0,
    slo_ttft_s: float = 2.0,
    slo_tpot_s: float = 0.05,
    keep_outputs: bool = False,
    warmup: int = 32,
    host_s: float | None = None,
    table: dict[int, int] | None = None,
    prefill: str = "chunked",
    step_tokens: int | None = None,
    stall: float = STALL,
    backlog_steps: int = BACKLOG_STEPS,
    proposing: Proposing = Proposing(),
) -> RunResult:
    """One run: `requests` requests of `work` through `policy`, closed-loop at `concurrency` or Poisson at `rate`
    requests/s. The server holds at most `max_active` rows (default 256; adaptive's start-up grid is timed at
    1, max_active / 2 and max_active rows, as server/context.py does): one deployment, whatever the load.
    Throughput is measured over the steady window: closed loop, from the first request's end to the last
    request's admission (the batch is full all along); open loop, over the whole run. Before it, `warmup` short
    requests of the same workload run through the same decoder, 16 at a time, untimed: a long-running server's
    policy state (adaptive's acceptance prior, TensorRT-LLM's acceptance window) is that of a server that has
    seen this traffic. `table`: a tuned policy's best block per concurrency (`policies.sim_decoder`); `prefill`:
    "chunked" (prompts enter in chunks inside the verify pass, the loop's default, within the step budget
    `step_tokens`, default the GPU's, `policies.sim_step_tokens`, a step with chunks at most about `stall` times
    the rows' own unless prompts queue, then at least 1 / `backlog_steps` of them a step, `decoding.chunking`)
    or "separate" (a pass of their own);
    `host_s`: host seconds per step (default: the measured `host_step_s` at the step's rows); `proposing`: the
    proposer the requests name and the trace their suffix matches replay (sim/suffix.py; the warm-up's are DFlash)."""
    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency (closed loop) or rate (Poisson)")
    if prefill not in PREFILL:
        raise ValueError(f"prefill {prefill!r}: one of {PREFILL}")
    limit = concurrency if concurrency is not None else (max_active or 256)
    target, drafter, clock = sim_engines(cost, work.profiles)
    dec = sim_decoder(
        policy,
        target,
        drafter,
        clock,
        work.profiles,
        max_active or 256,
        table=table,
        host_s=host_s if host_s is not None else host_step_s(limit),
        prefill=prefill,
        step_tokens=step_tokens,
        stall=stall,
        backlog_steps=backlog_steps,
    )
    if warmup:  # a server that has served this traffic before: what its policy learns across requests, learnt
        _warm_up(dec, work, warmup, seed)
    if proposer_for(proposing.proposer).weighs_cost:  # timed at start-up as the policy's grid, not in a served step
        dec.run_cost  # noqa: B018
    clock.now = 0.0  # the start-up grid and the warm-up ran before serving
    cast(TimedPolicy, dec.policy).cpu_s = 0.0
    reqs = [_Req(p, n, c) for p, n, c in work.requests(requests, seed)]
    if rate is not None:
        rng, t = random.Random(seed + 1), 0.0
        for r in reqs:
            t += rng.expovariate(rate)
            r.arrival = t
    tally = _drive(dec, clock, reqs, limit, concurrency is not None, host_s, proposing)
    run = _summarise(policy, concurrency, rate, clock.now, reqs, tally, (slo_ttft_s, slo_tpot_s))
    run.prefill, run.proposer = prefill, proposing.proposer
    inner = cast(TimedPolicy, dec.policy).policy
    if isinstance(inner, Optimum):
        run.optimum_gap = inner.gap
    if keep_outputs:
        run.outputs = [list(r.row.generated) for r in reqs if r.row is not None]
    return run


def run_closed(
    dec: BatchDecoder,
    clock: VirtualClock,
    work: Workload,
    label: str,
    *,
    concurrency: int,
    requests: int,
    seed: int,
    proposing: Proposing = Proposing(),
) -> RunResult:
    """`requests` requests of `work` through a decoder the caller built on `sim_engines`' engines (any policy),
    closed-loop at `concurrency`, no warm-up, the default SLO, the measured host work, the requests drafting with
    `proposing` (as in `simulate`): `dflash-trt plan` runs its schedules this way."""
    reqs = [_Req(p, n, c) for p, n, c in work.requests(requests, seed)]
    tally = _drive(dec, clock, reqs, concurrency, True, None, proposing)
    run = _summarise(label, concurrency, None, clock.now, reqs, tally, (2.0, 0.05))
    run.proposer = proposing.proposer
    return run


def _warm_up(dec: BatchDecoder, work: Workload, n: int, seed: int) -> None:
    """`n` short requests of `work` through `dec`, 16 at a time."""
    warm = Workload(work.name, work.profiles, work.mix, "uniform:32-96", "uniform:48-96").requests(n, seed + 7)
    queue = [(p, GenerationConfig(max_new_tokens=m, sampling=GREEDY, stop_token_ids=())) for p, m, _ in warm]
    while queue or dec.active:
        while queue and len(dec.active) < 16:
            p, cfg = queue.pop(0)
            dec.join(dec.new_row(p, cfg))
        dec.step()


@dataclass
class _Tally:
    """What the driver counts while it runs."""

    steps: int = 0
    batch_sum: int = 0
    blocks: list[int] = field(default_factory=list)
    rounds: int = 0
    committed: int = 0
    window_start: float | None = None
    window_end: float | None = None
    tokens_at: list[tuple[float, int]] = field(default_factory=list)  # per step: its end, tokens committed
    proposers: dict[str, dict[str, int]] = field(default_factory=dict)  # per proposer: rounds, drafted, accepted
    step_cpu: list[tuple[float, float, float]] = field(default_factory=list)  # per step: end, seconds, policy CPU


def _drive(
    dec: BatchDecoder,
    clock: VirtualClock,
    reqs: list[_Req],
    limit: int,
    closed: bool,
    host_s: float | None,
    proposing: Proposing = Proposing(),
) -> _Tally:
    """The server's loop (`server.orchestrator.BatchLoop`: admit, step, deliver, retire) on the virtual clock:
    a request enters its FIFO when it arrives (closed loop: when fewer than `limit` are in flight, its arrival
    that moment), at most `limit` rows run, one step a turn, then the host's work per step."""
    proposing.check()
    dec.shared_suffixes = None  # earlier outputs hold no repeats of pseudo-random tokens: the trace's replay is all
    timed = cast(TimedPolicy, dec.policy)
    waiting, tally = collections.deque(reqs), _Tally()
    loop: BatchLoop[_Req] = BatchLoop(dec, limit)
    while waiting or loop.pending or loop.active:
        while waiting and (
            waiting[0].arrival <= clock.now if not closed else len(loop.pending) + len(loop.active) < limit
        ):
            r = waiting.popleft()
            if closed:
                r.arrival = clock.now
            r.row = proposing.new_row(dec, r.prompt, r.max_new)
            loop.pending.append(r)
            if not waiting:
                tally.window_end = clock.now
        loop.admit()
        if not loop.active:
            clock.now = max(clock.now, waiting[0].arrival)
            continue
        rows = len(dec.active)
        tally.batch_sum += rows
        began, cpu_before = clock.now, timed.cpu_s
        result = loop.step()
        clock.advance(host_s if host_s is not None else host_step_s(rows))
        tally.step_cpu.append((clock.now, clock.now - began, timed.cpu_s - cpu_before))
        tally.steps += 1
        tally.blocks += result.profile.blocks
        tally.tokens_at.append((clock.now, 0))
        loop.deliver(result, loop.active, partial(_account, now=clock.now, tally=tally))
        loop.retire(lambda r: r.done_at is not None)
    return tally


def _account(r: _Req, rnd: Round, now: float, tally: _Tally) -> None:
    """A round into its request's timings and the tally (the step's tokens: the last `tokens_at` entry)."""
    n = len(rnd.token_ids)
    end, tokens = tally.tokens_at[-1]
    tally.tokens_at[-1] = (end, tokens + n)
    if rnd.prefill:
        r.first = now
    else:
        tally.rounds += 1
        tally.committed += n
        counts = tally.proposers.setdefault(rnd.proposer, {"rounds": 0, "drafted": 0, "accepted": 0})
        counts["rounds"] += 1
        counts["drafted"] += rnd.drafted
        counts["accepted"] += rnd.accepted
        if n and r.last is not None:
            r.itl += [(now - r.last) / n] * n
    r.last = now
    r.tokens += n
    assert r.row is not None
    if r.row.done:
        r.done_at = now
        if tally.window_start is None:
            tally.window_start = now


def _summarise(
    policy: str,
    concurrency: int | None,
    rate: float | None,
    end: float,
    reqs: list[_Req],
    tally: _Tally,
    slo: tuple[float, float],
) -> RunResult:
    """The run's figures from its requests and tally (throughput over the steady window); `slo`: TTFT and
    time-per-output-token bounds in seconds, for goodput."""
    closed = concurrency is not None
    t0, t1 = 0.0, end
    if closed and tally.window_start is not None and tally.window_end is not None:
        if tally.window_end > tally.window_start:
            t0, t1 = tally.window_start, tally.window_end
    in_window = sum(n for t, n in tally.tokens_at if t0 < t <= t1)
    steady = [(seconds, cpu) for t, seconds, cpu in tally.step_cpu if t0 < t <= t1] if closed else []
    ttft = [r.first - r.arrival for r in reqs if r.first is not None]
    itl = [x for r in reqs for x in r.itl]
    good = sum(
        1
        for r in reqs
        if r.first is not None
        and r.first - r.arrival <= slo[0]
        and (statistics.mean(r.itl) if r.itl else 0.0) <= slo[1]
    )
    steps = max(1, tally.steps)
    return RunResult(
        policy=policy,
        concurrency=concurrency,
        rate=rate,
        requests=len(reqs),
        tokens=sum(r.tokens for r in reqs),
        sim_seconds=end,
        tokens_per_s=in_window / (t1 - t0) if t1 > t0 else 0.0,
        ttft_s={"p50": _pct(ttft, 0.5), "p99": _pct(ttft, 0.99), "mean": statistics.mean(ttft)},
        itl_s={"p50": _pct(itl, 0.5), "p99": _pct(itl, 0.99), "mean": statistics.mean(itl) if itl else 0.0},
        goodput_rps=good / end if end > 0 else 0.0,
        steps=tally.steps,
        mean_batch=tally.batch_sum / steps,
        mean_block=statistics.mean(tally.blocks) if tally.blocks else 1.0,
        tau=tally.committed / max(1, tally.rounds),
        policy_cpu_s_per_step=sum(c for _, _, c in tally.step_cpu) / steps,
        simulated_step_s=end / steps,
        policy_cpu_s_per_steady_step=statistics.mean(c for _, c in steady) if steady else float("nan"),
        simulated_steady_step_s=statistics.mean(s for s, _ in steady) if steady else float("nan"),
        proposers=tally.proposers,
    )
