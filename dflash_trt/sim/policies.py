"""The block-size policies the simulator compares, each a `decoding.policy.BlockPolicy`: the decoder's own
(the target alone, a fixed block, adaptive with the server's start-up cost grid timed on the virtual clock),
the peers' rules configured as their documentation configures them, tables tuned per concurrency, and two
references that know each row's true acceptance.

- "trtllm-schedule": TensorRT-LLM's `draft_len_schedule` (batch size -> draft length, the smallest key >= the
  batch; above the largest key speculation is off, its implicit `max_concurrency`), as `DFlashDecodingConfig`
  configures it by default: `acceptance_rate_threshold` None, no threshold (LLM API reference,
  nvidia.github.io/TensorRT-LLM/.../DFlashDecodingConfig.html; PR NVIDIA/TensorRT-LLM#10860, whose example
  {4: 4, 8: 2, 32: 1} for a 4-token drafter is scaled to DFlash's 15 drafts: {4: 15, 8: 7, 32: 3}).
- "trtllm-schedule-threshold": the same with the threshold set (a variant a user opts into): speculation off
  for good once the rolling accepted/drafted over `TRTLLM_WINDOW` speculating iterations falls below
  `TRTLLM_THRESHOLD`. The docs give no value; 0.1 over 32 is used. With 15 drafts a poor row's rate is
  ~1/15, so on `mixed` traffic this switches speculation off.
- "tuned-table": a `draft_len_schedule` tuned per concurrency, as a deployment that benchmarked its traffic
  would write it: key C -> the best of none / fixed-4 / fixed-8 / fixed-16 measured at concurrency C (the
  bench's own fixed runs, mean over seeds); a batch between keys takes the next key up (TensorRT-LLM's rule).
- "vllm-table": vLLM's `num_speculative_tokens_per_batch_size` (PR vllm-project/vllm#32374: inclusive batch
  ranges -> K, a batch in no range takes the previous range's K); its author gives no defaults on purpose, so
  it is tuned the same way: range [C_i, C_{i+1} - 1] -> the best fixed block at C_i (the last range open
  above). It differs from "tuned-table" only between the tuned concurrencies (vLLM rounds down, TensorRT-LLM
  up).
- "oracle" (a reference): the adaptive policy told each row's true acceptance (its class's constant-rate
  equivalent) and never probing: the same greedy per-step choice with perfect knowledge of acceptance.
- "optimum" (the bound, not deployable): per step, the per-row blocks 1..16 (ragged, block 1 allowed, a
  row's own size kept) of the highest expected committed tokens per second under the engines' true pass
  costs (`cost.PassCost`, the simulator's own, at the rows' cache lengths and drafter backlogs) and the rows'
  true per-position acceptance. How it is exact (`Optimum`): a row's expected tokens are concave in its block
  (each further position adds the product of its rates, never more than the one before), so for every total
  N of target tokens the assignment of most expected tokens is the N - rows largest marginal gains, taken
  greedily (exact for separable concave gains); the step's seconds depend on the choice through N (target:
  layer ops, all-reduces and memory-bound attention at the rows' cache lengths), the drafting rows and their
  block tokens. Every N is rated with a lower bound of its seconds (the drafter with the fewest rows that can
  hold N, its ops at the lower monotone envelope of the profile), giving a certified upper bound of the
  step's tokens per second; the best few N are priced exactly and the best exactly priced choice is taken.
  Each step records the bound and the choice's rate (`Optimum.gap`): the choice is within that gap of the
  exact optimum, and the run reports it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..decoding.adaptive import AdaptiveBlocks
from ..decoding.chunking import BACKLOG_STEPS, STALL
from ..decoding.cost import CostModel
from ..decoding.estimates import AcceptanceTracker
from ..decoding.loop import BatchDecoder
from ..decoding.policy import BlockPolicy, FixedBlocks
from ..decoding.step import StepResult, StepRows
from .acceptance import AcceptanceProfile
from .optimum import Optimum

if TYPE_CHECKING:
    from ..decoding.row import BatchRow
    from .engines import VirtualClock

FIXED = ("none", "fixed-4", "fixed-8", "fixed-16")  # the blocks a tuned table picks from (1, 4, 8, 16)
POLICIES = (*FIXED, "adaptive", "trtllm-schedule", "trtllm-schedule-threshold")
TUNED = ("tuned-table", "vllm-table")  # need a table measured from the fixed runs (`sim_decoder`'s `table`)
REFERENCES = ("oracle", "optimum")  # not deployable: see the module docstring
TRTLLM_SCHEDULE = {4: 15, 8: 7, 32: 3}
TRTLLM_THRESHOLD, TRTLLM_WINDOW = 0.1, 32
# A GPU server's token budget per step under chunked prefill: vLLM's OpenAI-server default max_num_batched_tokens
# (vllm/engine/arg_utils.py, EngineArgs' batch defaults, v0.10): 8192 on GPUs of 70 GiB or more, 2048 on smaller
# ones and on every A100 (a larger budget lowered A100 throughput, vLLM PR 17885); the B200-like what-if as a
# B200 (180 GB). The budget trades how fast waiting prompts get in (TTFT, and at a large batch the batch itself:
# prompts that wait are rows that do not decode) against a long prompt's stall of the running rows (ITL); the
# loop bounds the stall by time as well (decoding/chunking.py), whatever the budget. results/sim says what each
# budget measured.
STEP_TOKENS_OF = {"a100": 2048, "h100": 8192, "b200-like-what-if": 8192}


def sim_step_tokens(cost: Any) -> int:
    """The step budget of the GPU a ProfileCost models (by its label, a what-if's name, else its GPU); 2048, the
    smaller default, for any other cost."""
    label, gpu = getattr(cost, "label", ""), getattr(cost, "gpu", "")
    return STEP_TOKENS_OF.get(label, STEP_TOKENS_OF.get(gpu, 2048))


def schedule_draft_len(batch: int, schedule: dict[int, int] = TRTLLM_SCHEDULE) -> int:
    """TensorRT-LLM draft_len_schedule: the entry of the smallest batch key >= batch; 0 above the largest."""
    for key in sorted(schedule):
        if batch <= key:
            return schedule[key]
    return 0


def table_k(batch: int, ranges: Sequence[tuple[int, int, int]], num_speculative_tokens: int = 15) -> int:
    """vLLM num_speculative_tokens_per_batch_size: the range holding batch, else the previous range's K."""
    k = num_speculative_tokens
    for lo, hi, kk in ranges:
        if batch >= lo:
            k = kk
        if lo <= batch <= hi:
            break
    return min(k, num_speculative_tokens)


def vllm_ranges(best_block: dict[int, int]) -> list[tuple[int, int, int]]:
    """The vLLM table tuned from the best block per concurrency: [C_i, C_{i+1} - 1] -> drafts at C_i."""
    keys = sorted(best_block)
    ends = [k - 1 for k in keys[1:]] + [1 << 20]
    return [(lo, hi, best_block[lo] - 1) for lo, hi in zip(keys, ends)]


def _every_row(step: StepRows, drafts: int) -> list[int]:
    """`drafts` draft tokens for every row (a block of drafts + 1) within its cap; a row's own size kept."""
    return cast(list[int], np.where(step.fixed > 0, step.fixed, np.minimum(step.max_block, drafts + 1)).tolist())


class TrtllmSchedule(FixedBlocks):
    """TensorRT-LLM's draft-length schedule by batch size, and its optional acceptance-rate threshold (module
    docstring): `threshold` None is the documented default."""

    def __init__(self, schedule: dict[int, int] = TRTLLM_SCHEDULE, threshold: float | None = None) -> None:
        self.schedule, self.threshold = schedule, threshold
        self.window: list[tuple[int, int]] = []  # (drafted, accepted) of recent speculating steps
        self.disabled = False

    def choose(self, step: StepRows) -> list[int]:
        return _every_row(step, 0 if self.disabled else schedule_draft_len(step.batch, self.schedule))

    def observe(self, result: StepResult) -> None:
        rounds = [rnd for _, rnd in result.verified]
        drafted = sum(r.drafted for r in rounds)
        if self.threshold is None or self.disabled or drafted == 0:
            return
        self.window.append((drafted, sum(r.accepted for r in rounds)))
        del self.window[:-TRTLLM_WINDOW]
        if len(self.window) == TRTLLM_WINDOW:
            d, a = (sum(x) for x in zip(*self.window))
            if a / d < self.threshold:
                self.disabled = True


class VllmTable(FixedBlocks):
    """vLLM's draft tokens per batch-size range (module docstring)."""

    def __init__(self, trained: int, ranges: Sequence[tuple[int, int, int]]):
        self.trained, self.ranges = trained, list(ranges)

    def choose(self, step: StepRows) -> list[int]:
        return _every_row(step, table_k(step.batch, self.ranges, self.trained - 1))


@dataclass
class KnownAcceptance(AcceptanceTracker):
    """The oracle's estimate: the row's true per-position rate, whatever its rounds accept."""

    known: float = 0.6

    @property
    def alpha(self) -> float:
        return self.known

    def update(self, drafted: int, accepted: int) -> None:
        return None


class Oracle(AdaptiveBlocks):
    """The adaptive policy told each row's true acceptance (the class of a simulated prompt is its first id)."""

    def __init__(self, cost: CostModel, *, profiles: Sequence[AcceptanceProfile] = (), **options: Any):
        super().__init__(cost, **options)
        self.profiles = profiles

    def tracker_for(self, row: BatchRow) -> AcceptanceTracker:
        return KnownAcceptance(known=self.profiles[row.prompt_ids[0]].equivalent_rate())


class TimedPolicy:
    """A policy whose `choose` is timed in CPU seconds of this thread (what a deployment's host would pay)."""

    def __init__(self, policy: BlockPolicy):
        self.policy, self.cpu_s = policy, 0.0

    def choose(self, step: StepRows) -> list[int]:
        t0 = time.thread_time()
        out = self.policy.choose(step)
        self.cpu_s += time.thread_time() - t0
        return out

    def observe(self, result: StepResult) -> None:
        self.policy.observe(result)

    def forget(self, row: BatchRow) -> None:
        self.policy.forget(row)


_MEASURED: dict[tuple[object, ...], tuple[AdaptiveBlocks, float]] = {}


def _measured_adaptive(target: Any, drafter: Any, max_active: int, clock: VirtualClock) -> AdaptiveBlocks:
    """`AdaptiveBlocks.measured` on the simulated engines (the server's start-up grid, a GPU's), remembered in
    this process: on the virtual clock the grid is a function of the engines' costs and sizes and of the time it
    starts at, so a repeat hands out a fresh copy of the policy it gave and moves the clock to where the grid
    left it, and every later figure is the same to the bit (a grid of 256 rows is a second of CPU a run)."""
    key: tuple[object, ...] = (repr(target.cost), repr(drafter.cost), max_active, target.vocab_size)
    key += (target.max_context, drafter.block_size, clock.now)
    if key not in _MEASURED:
        policy = AdaptiveBlocks.measured(target, drafter, max_active, clock, gpu=True)
        _MEASURED[key] = (copy.deepcopy(policy), clock.now)
        return policy
    policy, clock.now = _MEASURED[key]
    return copy.deepcopy(policy)


def sim_decoder(
    name: str,
    target: Any,  # SimTargetEngine
    drafter: Any,  # SimDrafterEngine
    clock: VirtualClock,
    profiles: Sequence[AcceptanceProfile],
    max_active: int,
    *,
    table: dict[int, int] | None = None,
    host_s: float = 0.0,
    prefill: str = "chunked",
    step_tokens: int | None = None,
    stall: float = STALL,
    backlog_steps: int = BACKLOG_STEPS,
) -> BatchDecoder:
    """The decoder that serves policy `name` on the simulated engines, its policy timed (`TimedPolicy`).
    `table`: for "tuned-table" and "vllm-table", the best block per concurrency (1 = no drafting); `host_s`:
    the host's seconds per step, which "optimum" adds to every step it rates; `prefill`, `step_tokens`: the
    loop's prefill mode and its per-step token budget (chunked; default `sim_step_tokens` of the target's cost);
    `stall`, `backlog_steps`: the chunk steps' time bound, in the rows' own steps, and the floor for prompts that
    queue behind it (`decoding.chunking`)."""
    if name not in POLICIES + TUNED + REFERENCES:
        raise ValueError(f"unknown policy {name!r}: one of {POLICIES + TUNED + REFERENCES}")
    if name in TUNED and not table:
        raise ValueError(f"{name} needs its table: the best block per concurrency, from the fixed runs")
    policy: BlockPolicy = FixedBlocks()
    block_size = None
    step_tokens = sim_step_tokens(target.cost) if step_tokens is None else step_tokens
    if name == "none":
        return BatchDecoder(
            target,
            None,
            block_size=1,
            policy=TimedPolicy(policy),
            clock=clock,
            prefill=prefill,
            step_tokens=step_tokens,
            stall=stall,
            backlog_steps=backlog_steps,
        )
    if name.startswith("fixed-"):
        block_size = int(name.split("-")[1])
    elif name == "trtllm-schedule":
        policy = TrtllmSchedule()
    elif name == "trtllm-schedule-threshold":
        policy = TrtllmSchedule(threshold=TRTLLM_THRESHOLD)
    elif name == "tuned-table" and table:
        policy = TrtllmSchedule({c: b - 1 for c, b in table.items()})
    elif name == "vllm-table" and table:
        policy = VllmTable(drafter.block_size, vllm_ranges(table))
    elif name == "optimum":
        policy = Optimum(target.cost, profiles, host_s)
    elif name == "oracle":  # the server's start-up (AdaptiveBlocks.measured); the oracle needs no probes
        policy = Oracle.measured(target, drafter, max_active, clock, gpu=True, probe_every=0, profiles=profiles)
    else:
        policy = _measured_adaptive(target, drafter, max_active, clock)
    return BatchDecoder(
        target,
        drafter,
        block_size=block_size,
        policy=TimedPolicy(policy),
        clock=clock,
        prefill=prefill,
        step_tokens=step_tokens,
        stall=stall,
        backlog_steps=backlog_steps,
    )
