"""Serving on the simulated engines: workloads, block-size policies, and the driver that steps the real loop.

The driver is the orchestrator's loop (server/scheduler.py) without threads or HTTP: requests wait in a FIFO,
join the `BatchDecoder` (validated by `new_row`, then `join`) while fewer than `max_active` rows are active,
and every loop turn is one `decoder.step()`; a finished row leaves through the decoder as in the server. Time
is the engines' virtual clock plus `HOST_STEP_S` per step. Arrivals are closed-loop (`concurrency` requests in
flight, a finished one replaced at once) or open-loop Poisson (`rate` requests per second).

Policies: the decoder's own modes (target alone, a fixed block, adaptive with the server's start-up cost grid
timed on the virtual clock) and two peers' static rules driven through the decoder's block-size knob
before each step (`decoder.block_size`: the largest block a row may use; 1 = nobody drafts this step):

- "trtllm-schedule": TensorRT-LLM's `draft_len_schedule` (batch size -> draft length, the smallest key >= the
  batch; above the largest key speculation is off, its implicit `max_concurrency`), and
  `acceptance_rate_threshold` over `acceptance_rate_window_size` speculating iterations (speculation off
  for good once the rolling accepted/drafted falls below it). Documented in the LLM API reference
  (`DFlashDecodingConfig`, TensorRT-LLM 1.3.0rc27+: nvidia.github.io/TensorRT-LLM/.../DFlashDecodingConfig.html)
  and PR NVIDIA/TensorRT-LLM#10860, whose example is {4: 4, 8: 2, 32: 1} for a 4-token drafter: full
  length up to batch 4, halving as the batch doubles, off above 32. Scaled to DFlash's 15 drafts:
  {4: 15, 8: 7, 32: 3}. The docs give no threshold value; 0.1 with a window of 32 iterations is used (the
  paper's workloads accept 0.22-0.46 of 15 drafts; a drafter far below 0.1 is broken, not weak).
- "vllm-table": vLLM's `num_speculative_tokens_per_batch_size` (PR vllm-project/vllm#32374): inclusive batch
  ranges -> K, gaps inherit the previous range's K, clamped to num_speculative_tokens. The PR's example for
  a 3-token EAGLE drafter is {"1-16": 3, "64-128": 2, "256-4096": 0}; scaled to 15: {1-16: 15, 64-128: 10,
  256-4096: 0}.

A reference that is no deployable policy: "oracle", the adaptive policy told each row's true acceptance (its
class's constant-rate equivalent, `AcceptanceProfile.equivalent_rate`) and never probing: the same per-step
choice with perfect knowledge of acceptance (no strict bound: still greedy per step). Where adaptive is level
with it, better acceptance estimates would not help.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..decoding import GenerationConfig, SamplingParams
from ..decoding.adaptive import AcceptanceTracker
from ..decoding.loop import BatchDecoder, BatchRow, BlockPolicy
from .acceptance import POOR, AcceptanceProfile, paper_profiles
from .cost import PassCost
from .engines import VirtualClock, sim_engines

HOST_STEP_S = 0.3e-3  # per decoder step on a GPU server: scheduling, batching and bookkeeping on the host

POLICIES = ("none", "fixed-4", "fixed-8", "fixed-16", "adaptive", "trtllm-schedule", "vllm-table")
REFERENCES = ("oracle",)  # not deployable: see the module docstring
TRTLLM_SCHEDULE = {4: 15, 8: 7, 32: 3}
TRTLLM_THRESHOLD, TRTLLM_WINDOW = 0.1, 32
VLLM_TABLE = ((1, 16, 15), (64, 128, 10), (256, 4096, 0))


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
            prompt = [c] + [rng.randrange(len(self.profiles), 256) for _ in range(plen(rng) - 1)]
            out.append((prompt, olen(rng), c))
        return out


def workload(name: str, **lengths: str) -> Workload:
    """ "paper": each request from one of the paper's benchmarks (equal weights); "mixed": half of them
    accept poorly (tau ~2 at block 16), the other half as "paper"; a benchmark name: that benchmark only."""
    paper = paper_profiles()
    if name == "paper":
        return Workload(name, tuple(paper.values()), (1.0,) * len(paper), **lengths)
    if name == "mixed":
        return Workload(name, (*paper.values(), POOR), (0.5 / len(paper),) * len(paper) + (0.5,), **lengths)
    if name in paper:
        return Workload(name, (paper[name],), (1.0,), **lengths)
    raise ValueError(f"unknown workload {name!r}: paper, mixed or one of {sorted(paper)}")


# ---- policies -----------------------------------------------------------------------------
def schedule_draft_len(batch: int) -> int:
    """TensorRT-LLM draft_len_schedule: the entry of the smallest batch key >= batch; 0 above the largest."""
    for key in sorted(TRTLLM_SCHEDULE):
        if batch <= key:
            return TRTLLM_SCHEDULE[key]
    return 0


def table_k(batch: int, num_speculative_tokens: int = 15) -> int:
    """vLLM num_speculative_tokens_per_batch_size: the range holding batch, else the previous range's K."""
    k = num_speculative_tokens
    for lo, hi, kk in VLLM_TABLE:
        if batch >= lo:
            k = kk
        if lo <= batch <= hi:
            break
    return min(k, num_speculative_tokens)


@dataclass
class KnownAcceptance(AcceptanceTracker):
    """The oracle's estimate: the row's true per-position rate, whatever its rounds accept."""

    known: float = 0.6

    @property
    def alpha(self) -> float:
        return self.known

    def update(self, drafted: int, accepted: int) -> None:
        return None


class Policy:
    """Builds the decoder for one policy and sets its block-size knob before each step."""

    def __init__(self, name: str, max_active: int = 256, trained: int = 16):
        if name not in POLICIES + REFERENCES:
            raise ValueError(f"unknown policy {name!r}: one of {POLICIES + REFERENCES}")
        self.name, self.max_active, self.trained = name, max_active, trained
        self.window: list[tuple[int, int]] = []  # trtllm: (drafted, accepted) of recent speculating steps
        self.disabled = False

    def decoder(self, target: Any, drafter: Any, clock: VirtualClock) -> BatchDecoder:
        if self.name == "none":
            return BatchDecoder(target, None, clock=clock)
        if self.name.startswith("fixed-"):
            return BatchDecoder(target, drafter, block_size=int(self.name.split("-")[1]), clock=clock)
        if self.name in ("adaptive", "oracle"):  # the server's start-up (BlockPolicy.measured), on the virtual clock
            probe_every = 0 if self.name == "oracle" else BlockPolicy.probe_every  # the oracle needs no probes
            policy = BlockPolicy.measured(target, drafter, self.max_active, clock, gpu=True, probe_every=probe_every)
            return BatchDecoder(target, drafter, policy=policy, clock=clock)
        return BatchDecoder(target, drafter, block_size=self.trained, clock=clock)

    def admit(self, row: BatchRow, profile: AcceptanceProfile) -> BatchRow:
        """A row about to join (its class's acceptance `profile`): the oracle is told the row's true rate."""
        if self.name == "oracle":
            row.acceptance = KnownAcceptance(known=profile.equivalent_rate())
        return row

    def before_step(self, decoder: BatchDecoder) -> None:
        batch = len(decoder.active)
        if self.name == "trtllm-schedule":
            k = 0 if self.disabled else schedule_draft_len(batch)
            decoder.block_size = max(1, min(self.trained, k + 1))
        elif self.name == "vllm-table":
            decoder.block_size = max(1, min(self.trained, table_k(batch, self.trained - 1) + 1))

    def after_step(self, rounds: Sequence[tuple[BatchRow, Any]]) -> None:
        if self.name != "trtllm-schedule" or self.disabled:
            return
        drafted = sum(r.drafted for _, r in rounds if not r.prefill)
        if drafted == 0:
            return
        self.window.append((drafted, sum(r.accepted for _, r in rounds if not r.prefill)))
        del self.window[:-TRTLLM_WINDOW]
        if len(self.window) == TRTLLM_WINDOW:
            d, a = (sum(x) for x in zip(*self.window))
            if a / d < TRTLLM_THRESHOLD:
                self.disabled = True


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
    host_step_s: float = HOST_STEP_S,
) -> RunResult:
    """One run: `requests` requests of `work` through `policy`, closed-loop at `concurrency` or Poisson at `rate`
    requests/s. The server holds at most `max_active` rows (default 256; adaptive's start-up grid is timed at
    1, max_active / 2 and max_active rows, as server/context.py does): one deployment, whatever the load. Throughput is measured over the steady window:
    closed loop, from the first request's end to the last request's admission (the batch is full all along);
    open loop, over the whole run. Before it, `warmup` short requests of the same workload run through the
    same decoder, 16 at a time, untimed: a long-running server's policy state (adaptive's acceptance prior,
    TensorRT-LLM's acceptance window) is that of a server that has seen this traffic."""
    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency (closed loop) or rate (Poisson)")
    limit = concurrency if concurrency is not None else (max_active or 256)
    target, drafter, clock = sim_engines(cost, work.profiles)
    pol = Policy(policy, max_active or 256, drafter.block_size)
    dec = pol.decoder(target, drafter, clock)
    greedy = SamplingParams(0.0)
    if warmup:  # a server that has served this traffic before: what its policy learns across requests, learnt
        warm = Workload(work.name, work.profiles, work.mix, "uniform:32-96", "uniform:48-96").requests(warmup, seed + 7)
        pending = [GenerationConfig(max_new_tokens=n, sampling=greedy, stop_token_ids=()) for _, n, _ in warm]
        queue = [(p, cfg) for (p, _, _), cfg in zip(warm, pending)]
        while queue or dec.active:
            while queue and len(dec.active) < 16:
                p, cfg = queue.pop(0)
                dec.join(pol.admit(dec.new_row(p, cfg), work.profiles[p[0]]))
            pol.before_step(dec)
            pol.after_step(dec.step())
    clock.now = 0.0  # the start-up grid and the warm-up ran before serving
    rng = random.Random(seed + 1)
    reqs = [_Req(p, n, c) for p, n, c in work.requests(requests, seed)]
    if rate is not None:
        t = 0.0
        for r in reqs:
            t += rng.expovariate(rate)
            r.arrival = t
    waiting = list(reqs)
    active: dict[int, _Req] = {}
    steps, batch_sum, blocks, rounds_n, committed = 0, 0, [], 0, 0
    policy_cpu = 0.0
    window_start: float | None = None
    window_end: float | None = None
    tokens_at: list[tuple[float, int]] = []
    orig_block_sizes = dec._block_sizes

    step_cpu: list[tuple[float, float, float]] = []  # per step: its end (simulated), its seconds, policy CPU

    def timed_block_sizes(rows: list[BatchRow]) -> list[int]:
        nonlocal policy_cpu
        t0 = time.thread_time()
        out = orig_block_sizes(rows)
        policy_cpu += time.thread_time() - t0
        return out

    dec._block_sizes = timed_block_sizes  # type: ignore[method-assign]  # timing only: the policy is unchanged
    while waiting or active:
        while waiting and len(active) < limit and waiting[0].arrival <= clock.now:
            r = waiting.pop(0)
            if concurrency is not None:
                r.arrival = clock.now
            cfg = GenerationConfig(max_new_tokens=r.max_new, sampling=greedy, stop_token_ids=())
            r.row = dec.join(pol.admit(dec.new_row(r.prompt, cfg), work.profiles[r.klass]))
            active[r.row.id] = r
            if not waiting:
                window_end = clock.now
        if not active:
            clock.now = max(clock.now, waiting[0].arrival)
            continue
        pol.before_step(dec)
        batch_sum += len(dec.active)
        began, cpu_before = clock.now, policy_cpu
        rounds = dec.step()
        clock.advance(host_step_s)
        step_cpu.append((clock.now, clock.now - began, policy_cpu - cpu_before))
        pol.after_step(rounds)
        steps += 1
        now = clock.now
        blocks += dec.last_profile.blocks
        n_step = 0
        for row, rnd in rounds:
            r = active[row.id]
            n = len(rnd.token_ids)
            n_step += n
            if rnd.prefill:
                r.first = now
            else:
                rounds_n += 1
                committed += n
                if n and r.last is not None:
                    r.itl += [(now - r.last) / n] * n
            r.last = now
            r.tokens += n
            if row.done:
                r.done_at = now
                del active[row.id]
                if window_start is None:
                    window_start = now
        tokens_at.append((now, n_step))
    end = clock.now
    total = sum(r.tokens for r in reqs)
    if concurrency is not None and window_start is not None and window_end is not None and window_end > window_start:
        t0, t1 = window_start, window_end
    else:
        t0, t1 = 0.0, end
    in_window = sum(n for t, n in tokens_at if t0 < t <= t1)
    steady = [(seconds, cpu) for t, seconds, cpu in step_cpu if t0 < t <= t1] if concurrency is not None else []
    ttft = [r.first - r.arrival for r in reqs if r.first is not None]
    itl = [x for r in reqs for x in r.itl]
    good = 0
    for r in reqs:
        tpot = statistics.mean(r.itl) if r.itl else 0.0
        if r.first is not None and r.first - r.arrival <= slo_ttft_s and tpot <= slo_tpot_s:
            good += 1
    return RunResult(
        policy=policy,
        concurrency=concurrency,
        rate=rate,
        requests=len(reqs),
        tokens=total,
        sim_seconds=end,
        tokens_per_s=in_window / (t1 - t0) if t1 > t0 else 0.0,
        ttft_s={"p50": _pct(ttft, 0.5), "p99": _pct(ttft, 0.99), "mean": statistics.mean(ttft)},
        itl_s={"p50": _pct(itl, 0.5), "p99": _pct(itl, 0.99), "mean": statistics.mean(itl) if itl else 0.0},
        goodput_rps=good / end if end > 0 else 0.0,
        steps=steps,
        mean_batch=batch_sum / max(1, steps),
        mean_block=statistics.mean(blocks) if blocks else 1.0,
        tau=committed / max(1, rounds_n),
        policy_cpu_s_per_step=policy_cpu / max(1, steps),
        simulated_step_s=end / max(1, steps),
        policy_cpu_s_per_steady_step=statistics.mean(c for _, c in steady) if steady else float("nan"),
        simulated_steady_step_s=statistics.mean(s for s, _ in steady) if steady else float("nan"),
        outputs=[list(r.row.generated) for r in reqs if r.row is not None] if keep_outputs else [],
    )
