"""The search: every fixed block at every concurrency through the serving simulator, the best per concurrency
(the tuned table), TensorRT-LLM's draft_len_schedule made from it, and that schedule fed back into the simulator.

Runs are closed loop (`concurrency` requests in flight, a finished one replaced at once) on one workload, with
the same requests (seed) for every block at one concurrency, so blocks differ by their policy only. Throughput
is the simulator's steady window (from the first request's end to the last admission: the batch holds exactly
C rows), so the best block at C is the best draft length for a batch of C rows, which is what a
batch-size schedule keys on. The policies here are stateless, so no warm-up runs.

`serving.simulate` takes its policies by name (none, fixed-4/8/16, ...); a plan needs every block 1..B and an
arbitrary schedule, so `run` builds the decoder with a policy object and drives it with `serving.run_closed`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..decoding.loop import BatchDecoder
from ..decoding.policy import FixedBlocks
from ..decoding.step import StepRows
from ..sim import serving
from ..sim.cost import PassCost
from ..sim.engines import sim_engines
from ..sim.policies import TimedPolicy, sim_step_tokens
from ..sim.serving import RunResult, Workload
from ..sim.suffix import Proposing


class BatchSchedule(FixedBlocks):
    """Every row drafts `draft_len(batch)` tokens (a block of that + 1) within its cap: a batch-size schedule."""

    def __init__(self, draft_len: Callable[[int], int]):
        self.draft_len = draft_len

    def choose(self, step: StepRows) -> list[int]:
        k = self.draft_len(step.batch)
        return [int(f) if f > 0 else min(int(c), k + 1) for f, c in zip(step.fixed, step.max_block)]


def trtllm_draft_len(spec: dict[str, Any], batch: int) -> int:
    """The draft length TensorRT-LLM uses at `batch` for a speculative_config (its get_draft_len_for_batch_size:
    the value of the smallest schedule key >= batch, 0 above the largest key; max_concurrency: off above it)."""
    schedule = spec.get("draft_len_schedule")
    if schedule:
        keys = sorted(int(k) for k in schedule)
        i = bisect.bisect_left(keys, batch)
        return int(schedule[keys[i]]) if i < len(keys) else 0
    limit = spec.get("max_concurrency")
    return 0 if limit is not None and batch > int(limit) else int(spec["max_draft_len"])


def fixed(block: int) -> Callable[[int], int] | None:
    """`block` at every batch size (None for block 1: the target alone)."""
    return None if block == 1 else (lambda batch: block - 1)


def scheduled(limits: dict[str, Any] | None) -> Callable[[int], int] | None:
    """TensorRT-LLM's draft length per batch size for these speculation limits (None: the target alone)."""
    if limits is None:
        return None
    return lambda batch: trtllm_draft_len(limits, batch)


def run(
    cost: PassCost,
    work: Workload,
    draft_len: Callable[[int], int] | None,
    concurrency: int,
    requests: int,
    seed: int,
    block: int,
    proposing: Proposing = Proposing(),
) -> RunResult:
    """One closed-loop run: `draft_len` per batch size (None: the target alone, no drafter). Prompts enter in
    chunks within the GPU server's step budget (`sim_step_tokens`: the profile's GPU, 2048 for a measured grid),
    not the CPU server's default. `proposing`: the requests' proposer and the suffix trace it replays
    (sim/suffix.py; default DFlash)."""
    target, sim_drafter, clock = sim_engines(cost, work.profiles)
    drafter: Any = sim_drafter  # a DrafterEngine in all but max_context's declared type (as sim_decoder takes it)
    budget = getattr(cost, "step_tokens", None) or sim_step_tokens(cost)  # a CPU server's own, else the GPU's
    if draft_len is None:
        policy, drafting, block = TimedPolicy(FixedBlocks()), None, 1
    else:
        policy, drafting = TimedPolicy(BatchSchedule(draft_len)), drafter
    dec = BatchDecoder(target, drafting, block_size=block, policy=policy, clock=clock, step_tokens=budget)
    return serving.run_closed(
        dec, clock, work, "plan", concurrency=concurrency, requests=requests, seed=seed, proposing=proposing
    )


@dataclass
class Cell:
    """One concurrency: tokens/s of every block (1 = the target alone; mean over seeds), the best block, and
    the fed-back schedule's run (its figures are the plan's predictions)."""

    concurrency: int
    requests: int
    tokens_per_s: dict[int, float]
    best_block: int = 1
    schedule_block: int = 1
    predicted: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """The fed-back schedule's tokens/s over the tuned table's (the best block's)."""
        return float(self.predicted["tokens_per_s"]) / self.tokens_per_s[self.best_block]


def figures(runs: Sequence[RunResult]) -> dict[str, Any]:
    """The mean over seeds of what a plan predicts: tokens/s, TTFT and ITL percentiles (ms), tau, mean block."""
    n = len(runs)
    return {
        "tokens_per_s": sum(r.tokens_per_s for r in runs) / n,
        "ttft_ms": {q: 1e3 * sum(r.ttft_s[q] for r in runs) / n for q in ("p50", "p99")},
        "itl_ms": {q: 1e3 * sum(r.itl_s[q] for r in runs) / n for q in ("p50", "p99")},
        "tau": sum(r.tau for r in runs) / n,
        "mean_block": sum(r.mean_block for r in runs) / n,
    }


def sweep(
    cost: PassCost, work: Workload, concurrency: int, requests: int, seeds: Sequence[int], block: int, bar: Any
) -> dict[int, float]:
    """Tokens/s of every fixed block 1..`block` at one concurrency, the mean over `seeds` (the same requests
    for every block)."""
    tokens = {}
    for b in range(1, block + 1):
        tokens[b] = figures([run(cost, work, fixed(b), concurrency, requests, s, block) for s in seeds])["tokens_per_s"]
        bar.update(len(seeds))
    return tokens


def best_blocks(tokens: dict[int, dict[int, float]]) -> dict[int, int]:
    """Per concurrency, the block of the most tokens/s (ties: the smaller block)."""
    return {c: max(sorted(t), key=lambda b: (t[b], -b)) for c, t in tokens.items()}


@dataclass
class Plan:
    block: int  # the largest block planned (the drafter's)
    cells: list[Cell]
    limits: dict[str, Any] | None  # TensorRT-LLM's max_draft_len + draft_len_schedule / max_concurrency
    seeds: tuple[int, ...]


def dflash_drafts(best: dict[int, int]) -> dict[int, int]:
    """Drafts per concurrency for TensorRT-LLM from the best blocks, never 0 once drafting starts: a schedule
    length resolving to 0 stops refreshing DFlash's per-request context buffers, so acceptance collapses for the
    rest of every affected request once the batch shrinks (NVIDIA/TensorRT-LLM#16888). A plan that does not
    draft at its smallest concurrency keeps its 0 there (speculation_limits refuses it: serve the target alone)."""
    drafts = {c: b - 1 for c, b in best.items()}
    return {c: max(1, k) for c, k in drafts.items()} if drafts[min(drafts)] > 0 else drafts


def requests_for(concurrency: int, minimum: int = 24, per_row: int = 3) -> int:
    """Requests a run at `concurrency`: per_row x C, at least `minimum`. The steady window holds the requests
    beyond the first C, so (per_row - 1) x C of them are measured at a full batch."""
    return max(minimum, per_row * concurrency)


def plan(
    cost: PassCost,
    work: Workload,
    block: int,
    concurrencies: Sequence[int],
    requests: Callable[[int], int] = requests_for,
    seeds: Sequence[int] = (0,),
    progress: bool = True,
) -> Plan:
    """Tune, schedule and feed back (module docstring)."""
    from tqdm import tqdm

    from ..builders.trtllm_serve import ServeConfigError, speculation_limits

    bar = tqdm(total=len(concurrencies) * (block + 1) * len(seeds), desc="simulating", unit="run", disable=not progress)
    cells = []
    for c in concurrencies:
        cells.append(Cell(c, requests(c), sweep(cost, work, c, requests(c), seeds, block, bar)))
    best = best_blocks({cell.concurrency: cell.tokens_per_s for cell in cells})
    try:
        limits: dict[str, Any] | None = speculation_limits(dflash_drafts(best))
    except ServeConfigError:
        limits = None  # no drafting at the smallest concurrency: outputs.no_schedule_note says what follows
    for cell in cells:
        cell.best_block = best[cell.concurrency]
        k = trtllm_draft_len(limits, cell.concurrency) if limits else 0
        cell.schedule_block = k + 1
        fed = [run(cost, work, scheduled(limits), cell.concurrency, cell.requests, s, block) for s in seeds]
        cell.predicted = figures(fed)
        bar.update(len(seeds))
    bar.close()
    return Plan(block, cells, limits, tuple(seeds))


def holdout(
    plan: Plan,
    cost: PassCost,
    work: Workload,
    seed: int,
    concurrencies: Sequence[int],
    requests: Callable[[int], int] = requests_for,
    progress: bool = True,
) -> dict[int, dict[str, Any]]:
    """The plan's schedule on requests it was not tuned on (`seed`), at `concurrencies` (planned or between):
    per concurrency the schedule's tokens/s, the best fixed block's on the same requests, and their ratio."""
    from tqdm import tqdm

    bar = tqdm(total=len(concurrencies) * (plan.block + 1), desc="held out", unit="run", disable=not progress)
    out = {}
    for c in concurrencies:
        tokens = sweep(cost, work, c, requests(c), (seed,), plan.block, bar)
        fed = run(cost, work, scheduled(plan.limits), c, requests(c), seed, plan.block)
        bar.update()
        best = best_blocks({c: tokens})[c]
        out[c] = {
            "schedule_tokens_per_s": fed.tokens_per_s,
            "best_block": best,
            "best_tokens_per_s": tokens[best],
            "ratio": fed.tokens_per_s / tokens[best],
        }
    bar.close()
    return out
