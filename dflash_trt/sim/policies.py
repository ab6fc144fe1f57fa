"""The block-size policies the simulator compares, each a `decoding.policy.BlockPolicy`: the decoder's own
(the target alone, a fixed block, adaptive with the server's start-up cost grid timed on the virtual clock),
two peers' static rules and a reference that knows each row's true acceptance.

- "trtllm-schedule": TensorRT-LLM's `draft_len_schedule` (batch size -> draft length, the smallest key >= the
  batch; above the largest key speculation is off, its implicit `max_concurrency`), and
  `acceptance_rate_threshold` over `acceptance_rate_window_size` speculating iterations (speculation off
  for good once the rolling accepted/drafted falls below it). Documented in the LLM API reference
  (`DFlashDecodingConfig`, TensorRT-LLM 1.3.0rc27+: nvidia.github.io/TensorRT-LLM/.../DFlashDecodingConfig.html)
  and PR NVIDIA/TensorRT-LLM#10860, whose example is {4: 4, 8: 2, 32: 1} for a 4-token drafter: full
  length up to batch 4, halving as the batch doubles, off above 32. Scaled to DFlash's 15 drafts:
  {4: 15, 8: 7, 32: 3}. The docs give no threshold value; 0.1 with a window of 32 iterations is used.
- "vllm-table": vLLM's `num_speculative_tokens_per_batch_size` (PR vllm-project/vllm#32374): inclusive batch
  ranges -> K, gaps inherit the previous range's K, clamped to num_speculative_tokens. The PR's example for
  a 3-token EAGLE drafter is {"1-16": 3, "64-128": 2, "256-4096": 0}; scaled to 15: {1-16: 15, 64-128: 10,
  256-4096: 0}.
- "oracle" (a reference, not deployable): the adaptive policy told each row's true acceptance (its class's
  constant-rate equivalent, `AcceptanceProfile.equivalent_rate`) and never probing: the same per-step choice
  with perfect knowledge of acceptance (no strict bound: still greedy per step). Where adaptive is level with
  it, better acceptance estimates would not help.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..decoding.adaptive import AdaptiveBlocks
from ..decoding.cost import CostModel
from ..decoding.estimates import AcceptanceTracker
from ..decoding.loop import BatchDecoder
from ..decoding.policy import BlockPolicy, FixedBlocks
from ..decoding.step import StepResult, StepRows
from .acceptance import AcceptanceProfile

if TYPE_CHECKING:
    from ..decoding.loop import BatchRow
    from .engines import VirtualClock

POLICIES = ("none", "fixed-4", "fixed-8", "fixed-16", "adaptive", "trtllm-schedule", "vllm-table")
REFERENCES = ("oracle",)  # not deployable: see the module docstring
TRTLLM_SCHEDULE = {4: 15, 8: 7, 32: 3}
TRTLLM_THRESHOLD, TRTLLM_WINDOW = 0.1, 32
VLLM_TABLE = ((1, 16, 15), (64, 128, 10), (256, 4096, 0))


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


def _every_row(step: StepRows, drafts: int) -> list[int]:
    """`drafts` draft tokens for every row (a block of drafts + 1) within its cap; a row's own size kept."""
    return cast(list[int], np.where(step.fixed > 0, step.fixed, np.minimum(step.cap, drafts + 1)).tolist())


class TrtllmSchedule(FixedBlocks):
    """TensorRT-LLM's draft-length schedule by batch size, and its acceptance-rate threshold (module docstring)."""

    def __init__(self) -> None:
        self.window: list[tuple[int, int]] = []  # (drafted, accepted) of recent speculating steps
        self.disabled = False

    def choose(self, step: StepRows) -> list[int]:
        return _every_row(step, 0 if self.disabled else schedule_draft_len(step.batch))

    def observe(self, result: StepResult) -> None:
        rounds = [rnd for _, rnd in result.verified]
        drafted = sum(r.drafted for r in rounds)
        if self.disabled or drafted == 0:
            return
        self.window.append((drafted, sum(r.accepted for r in rounds)))
        del self.window[:-TRTLLM_WINDOW]
        if len(self.window) == TRTLLM_WINDOW:
            d, a = (sum(x) for x in zip(*self.window))
            if a / d < TRTLLM_THRESHOLD:
                self.disabled = True


class VllmTable(FixedBlocks):
    """vLLM's draft tokens per batch-size range (module docstring)."""

    def __init__(self, trained: int):
        self.trained = trained

    def choose(self, step: StepRows) -> list[int]:
        return _every_row(step, table_k(step.batch, self.trained - 1))


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


def sim_decoder(
    name: str,
    target: Any,  # SimTargetEngine
    drafter: Any,  # SimDrafterEngine
    clock: VirtualClock,
    profiles: Sequence[AcceptanceProfile],
    max_active: int,
) -> BatchDecoder:
    """The decoder that serves policy `name` on the simulated engines, its policy timed (`TimedPolicy`)."""
    if name not in POLICIES + REFERENCES:
        raise ValueError(f"unknown policy {name!r}: one of {POLICIES + REFERENCES}")
    policy: BlockPolicy = FixedBlocks()
    block_size = None
    if name == "none":
        return BatchDecoder(target, None, block_size=1, policy=TimedPolicy(policy), clock=clock)
    if name.startswith("fixed-"):
        block_size = int(name.split("-")[1])
    elif name == "trtllm-schedule":
        policy = TrtllmSchedule()
    elif name == "vllm-table":
        policy = VllmTable(drafter.block_size)
    elif name == "oracle":  # the server's start-up (AdaptiveBlocks.measured); the oracle needs no probes
        policy = Oracle.measured(target, drafter, max_active, clock, gpu=True, probe_every=0, profiles=profiles)
    else:
        policy = AdaptiveBlocks.measured(target, drafter, max_active, clock, gpu=True)
    return BatchDecoder(target, drafter, block_size=block_size, policy=TimedPolicy(policy), clock=clock)
