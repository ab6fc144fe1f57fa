"""The orchestrator: one worker thread advances every active request in batched steps (decoding/loop.py).

    submit -> bounded FIFO queue -> up to `max_active` rows of one BatchDecoder
           -> step(): draft for every running row (one drafter call), verify every running row with the new
              rows' prompt chunks in the same pass (one target call), accept / commit per row
           -> each row's round goes back to its request's event loop as an event

The turn itself (admit / step / deliver / retire) is `BatchLoop`, apart from threads, locks and clocks: the
serving simulator (sim/serving.py) drives the same class on its virtual clock, so what it simulates is this loop.

A new request joins at the next step: with chunked prefill (the default) its prompt enters the verify pass in
chunks within the step's token budget, so a long prompt lengthens the streaming rows' steps a little instead of
freezing them; its first token comes with its last chunk (the decoder's `prefill` option, decoding/loop.py). A
cancelled (disconnected) or timed-out request leaves before the next step, a joining one mid-prompt too; the
others go on. If a batched pass raises, every row of that step fails (500) and the worker goes on serving new
requests.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from ..decoding import GenerationResult, Round
from ..decoding.loop import BatchDecoder
from ..decoding.row import BatchRow
from ..decoding.step import StepProfile, StepResult
from ..runtime.cpu_threads import release_openmp_workers

if TYPE_CHECKING:
    from .metrics import ServerMetrics

log = logging.getLogger("dflash_trt.server")


class QueueFull(Exception):
    """More requests waiting than the configured queue holds: answer 429."""


class ShuttingDown(Exception):
    """The server is draining: answer 503."""


@dataclass
class RoundEvent:
    round: Round  # its `text`: new text, safe to show (never a partial stop string or a partial character)
    result: GenerationResult | None = None  # set on the last round


@dataclass
class ErrorEvent:
    kind: str  # "timeout", "cancelled", "shutdown", "engine"
    message: str


@dataclass
class Job:
    id: str
    row: BatchRow  # validated by BatchDecoder.new_row in the request thread; the worker joins it to the batch
    loop: asyncio.AbstractEventLoop
    deadline: float  # the orchestrator's clock() after which the request is abandoned
    events: asyncio.Queue[RoundEvent | ErrorEvent] = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.monotonic)  # on the orchestrator's clock
    last_event: float | None = None
    cancelled: ErrorEvent | None = None  # why the worker should drop this job at its next turn
    outcome: str | None = None  # once finished: "ok" or an ErrorEvent kind
    latency: float | None = None  # once finished: seconds from submitted to finished
    fallback_counted: bool = False

    @property
    def finished(self) -> bool:
        return self.outcome is not None

    def cancel(self, kind: str = "cancelled", message: str = "the client went away") -> None:
        """Ask the worker to drop this job before its next step (a no-op once finished)."""
        if self.cancelled is None:
            self.cancelled = ErrorEvent(kind, message)

    def _emit(self, event: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the request's loop is gone (server stopped): nobody is listening
            pass


class Member(Protocol):
    """What BatchLoop needs of a job: its row, made (and validated) by `BatchDecoder.new_row` when it was
    submitted, not yet joined."""

    @property
    def row(self) -> BatchRow | None: ...


J = TypeVar("J", bound=Member)


class BatchLoop(Generic[J]):
    """One turn of the serving loop, for the server's worker thread and the simulator's virtual clock alike:
    jobs wait in a FIFO (`pending`); `admit` joins them to the decoder's batch, oldest first, while fewer than
    `max_active` are `active`; `step` runs one batched step of every active row; `deliver` hands each round to
    its job; `retire` drops the finished jobs. The server runs admit and retire under its lock and the rest on
    its worker thread; the simulator runs them in turn."""

    def __init__(self, decoder: BatchDecoder | None, max_active: int) -> None:
        self.decoder, self.max_active = decoder, max_active
        self.pending: collections.deque[J] = collections.deque()
        self.active: list[J] = []

    def admit(self, drop: Callable[[J], bool] = lambda job: False) -> None:
        """Join waiting jobs while there is room; a job `drop` is true for (gone before it started) leaves the
        queue without engine work (`drop` does what its leaving needs)."""
        while self.pending and len(self.active) < self.max_active:
            job = self.pending.popleft()
            if drop(job):
                continue
            assert self.decoder is not None and job.row is not None
            self.decoder.join(job.row)  # its prompt enters with the next step
            self.active.append(job)

    def step(self) -> StepResult:
        assert self.decoder is not None
        return self.decoder.step()

    @staticmethod
    def deliver(rounds: StepResult, jobs: Iterable[J], to: Callable[[J, Round], None]) -> None:
        """Each round to its job among `jobs`, in the step's row order (a row without a job there: skipped)."""
        by_row = {id(j.row): j for j in jobs}
        for row, rnd in rounds:
            job = by_row.get(id(row))
            if job is not None:
                to(job, rnd)

    def retire(self, finished: Callable[[J], bool]) -> None:
        """Drop the finished jobs from `active` (in place: their rows left the decoder when they finished)."""
        self.active[:] = [j for j in self.active if not finished(j)]


class Orchestrator:
    """decoder: the BatchDecoder that only the worker thread steps; max_active: the most rows in one step;
    clock: the monotonic seconds every request timing reads (deadlines, latencies, the stall): tests pass one
    of their own, so that an outcome such as a timeout does not depend on how fast the machine steps."""

    def __init__(
        self,
        decoder: BatchDecoder | None,
        metrics: ServerMetrics,
        max_active: int = 8,
        max_queue: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.metrics, self.max_queue, self.clock = metrics, max_queue, clock
        self._loop: BatchLoop[Job] = BatchLoop(decoder, max_active)
        self._cv = threading.Condition()
        self._draining = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        # when the worker last made progress: a step ended, or work arrived at an idle orchestrator
        self._progress_at = self.clock()

    @property
    def decoder(self) -> BatchDecoder | None:
        return self._loop.decoder

    @property
    def max_active(self) -> int:
        return self._loop.max_active

    @property
    def _pending(self) -> collections.deque[Job]:  # the loop's FIFO: read and changed under self._cv
        return self._loop.pending

    @property
    def _active(self) -> list[Job]:  # the loop's joined jobs: read and changed under self._cv
        return self._loop.active

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        # The engines were loaded and timed on this thread; from now on only the worker runs them, and on a
        # CPU it should be the only thread with OpenMP workers (see runtime.cpu_threads).
        release_openmp_workers()
        self._thread = threading.Thread(target=self._run, name="dflash-orchestrator", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Fail whatever is left and end the worker."""
        with self._cv:  # one critical section: no submit() can slip in between the cancel and the flag
            self._stopping = True
            self._cancel_all_locked("shutdown", "the server is shutting down")
        if self._thread is not None:
            self._thread.join(timeout)

    def begin_drain(self) -> None:
        with self._cv:
            self._draining = True

    @property
    def busy(self) -> int:
        with self._cv:
            return len(self._pending) + len(self._active)

    def stalled_for(self) -> float:
        """Seconds since the last step ended while requests wait or run (0 when idle): a step that never
        returns (a hung collective, a lost tensor-parallel rank) grows it without bound."""
        with self._cv:
            if not self._pending and not self._active:
                return 0.0
            return self.clock() - self._progress_at

    def wait_idle(self, timeout: float) -> bool:
        """True when every submitted job finished within `timeout` seconds."""
        end = time.monotonic() + timeout
        with self._cv:
            while self._pending or self._active:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.1))
        return True

    def cancel_all(self, kind: str, message: str) -> None:
        with self._cv:
            self._cancel_all_locked(kind, message)

    def _cancel_all_locked(self, kind: str, message: str) -> None:
        for job in self._pending:  # never started: fail them here
            self._finish(job, ErrorEvent(kind, message))
        self._pending.clear()
        self.metrics.set_queue(waiting=0)
        for job in self._active:  # the worker drops them before its next step
            job.cancel(kind, message)
        self._cv.notify_all()

    # ---- requests -----------------------------------------------------------------------
    def check_open(self) -> None:
        """Raise ShuttingDown once draining or stopping: the one place that decides it (/ready asks too)."""
        if self._draining or self._stopping:
            raise ShuttingDown("the server is shutting down")

    def check_admission(self) -> None:
        """Raise ShuttingDown / QueueFull now, before a request spends time on tokenizing. A request that
        passes joins even if a drain begins before its submit: the drain waits for it."""
        with self._cv:
            self.check_open()
            self._check_room_locked()

    def _check_room_locked(self) -> None:
        if len(self._pending) + len(self._active) >= self.max_active + self.max_queue:
            raise QueueFull(f"{len(self._pending)} requests already waiting")

    def submit(self, job: Job) -> None:
        """Queue a job. Raises QueueFull when the queue filled since check_admission, and ShuttingDown once
        stop() ran (under the same lock as stop's cancel: no job is queued after the worker's last turn)."""
        with self._cv:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            self._check_room_locked()
            if not self._pending and not self._active:  # idle until now: the stall clock starts here
                self._progress_at = self.clock()
            self._pending.append(job)
            self.metrics.set_queue(waiting=len(self._pending))
            self._cv.notify_all()

    # ---- the worker ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._active and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    for job in [*self._pending, *self._active]:
                        if not job.finished:
                            self._finish(job, job.cancelled or ErrorEvent("shutdown", "the server is shutting down"))
                    self._pending.clear()
                    self._active.clear()
                    self._cv.notify_all()
                    return
                self._loop.admit(drop=self._gone)
                jobs = list(self._active)
                self.metrics.set_queue(waiting=len(self._pending))
                self.metrics.set_queue(running=len(self._active))
            if jobs:
                self._step(jobs)
            with self._cv:
                self._progress_at = self.clock()
                self._loop.retire(lambda j: j.finished)
                self.metrics.set_queue(running=len(self._active))
                self._cv.notify_all()

    def _gone(self, job: Job) -> bool:
        """A job cancelled before it started: finished here, without engine work."""
        if job.cancelled is None:
            return False
        self._finish(job, job.cancelled)
        return True

    def _step(self, jobs: list[Job]) -> None:
        """One batched step for every active job (only this thread touches the engines: no lock)."""
        assert self.decoder is not None
        now = self.clock()
        for job in jobs:
            if job.cancelled is not None:
                self._leave(job, job.cancelled)
            elif now > job.deadline:
                self._leave(job, ErrorEvent("timeout", "the request exceeded the server's time limit"))
        live = [j for j in jobs if not j.finished]
        if not live:
            return
        try:
            rounds = self._loop.step()
        except Exception as e:  # a batched pass failed: every row of this step fails, the server goes on
            ids = ", ".join(j.id for j in live)
            log.exception("batched step failed: engine failure for requests %s", ids)
            for job in live:
                self.metrics.engine_errors.inc()
                self._leave(job, ErrorEvent("engine", f"{type(e).__name__} in the engine (request {job.id})"))
            return
        self._observe_step(rounds.profile)
        for engine, k in rounds.cost_correction.items():
            self.metrics.cost_correction.labels(engine).set(k)
        self._loop.deliver(rounds, live, self._deliver)
        failed = {id(row) for row in rounds.failed}
        for job in live:  # left without a round: its drafter failed and it had no fallback
            if not job.finished and id(job.row) in failed:
                log.error("request %s: drafter failure: %r", job.id, job.row.error)
                self.metrics.engine_errors.inc()
                self._leave(
                    job, ErrorEvent("engine", f"{type(job.row.error).__name__} in the drafter (request {job.id})")
                )

    def _leave(self, job: Job, error: ErrorEvent) -> None:
        assert self.decoder is not None
        self.decoder.cancel(job.row)  # frees its cache slots
        self._finish(job, error)

    def _observe_step(self, prof: StepProfile) -> None:
        m = self.metrics
        if self.decoder is not None:
            shared = self.decoder.shared_suffixes
            states = [row.drafts.suffix_states for row in self.decoder.active]
            m.observe_suffix_states(states, shared.size if shared is not None else 0)
        for size in prof.blocks:
            m.block_size.observe(size)
        for kind, rows, tokens in (
            ("prefill", prof.prefill_rows, prof.prefill_tokens),
            ("chunk", prof.chunk_rows, prof.chunk_tokens),
            ("verify", prof.verify_rows, prof.verify_tokens),
        ):
            if rows:
                m.batch_rows.labels(kind).observe(rows)
                m.batch_tokens.labels(kind).observe(tokens)
        for part, seconds in (
            ("prefill", prof.prefill_s),
            ("policy", prof.policy_s),
            ("draft", prof.draft_s),
            ("verify", prof.verify_s),
            ("accept", prof.accept_s),
            ("overhead", prof.overhead_s),
        ):
            m.step_time.labels(part).observe(seconds)

    def _deliver(self, job: Job, rnd: Round) -> None:
        row = job.row
        s = row.stats
        result = row.result() if row.done else None  # its text was decoded in the step (`Round.text`)
        now = self.clock()
        m = self.metrics
        if row.drafter_error is not None and not job.fallback_counted:
            job.fallback_counted = True
            m.drafter_fallbacks.inc()
            log.warning("request %s: drafter failed (%r); continuing on the target alone", job.id, row.drafter_error)
        n = len(rnd.token_ids)
        m.generated_tokens.inc(n)
        if rnd.prefill:
            m.ttft.observe(now - job.submitted)
        else:
            m.acceptance.observe(n)
            m.observe_round(rnd.drafted, rnd.accepted, rnd.proposer)
            m.draft_time.observe(rnd.timings.draft_s)
            m.verify_time.observe(rnd.timings.verify_s)
            if n and job.last_event is not None:
                for _ in range(n):
                    m.itl.observe((now - job.last_event) / n)
        job.last_event = now
        if result is not None:  # bookkeeping first: the request may log as soon as it sees the event
            m.prompt_tokens.inc(s.prompt_tokens)
            self._finish(job, None)
        job._emit(RoundEvent(rnd, result))

    def _finish(self, job: Job, error: ErrorEvent | None) -> None:
        job.outcome = "ok" if error is None else error.kind
        job.latency = self.clock() - job.submitted
        self.metrics.latency.labels(job.outcome).observe(job.latency)
        if error is not None:
            job._emit(error)
