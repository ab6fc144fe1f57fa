"""The orchestrator: one worker thread advances every active Generation one round at a time.

    submit -> bounded FIFO queue -> up to `max_active` generations, stepped round-robin
           -> each round's tokens go back to the request's event loop as an event

Each Generation owns its target and drafter sessions (its KV caches), so interleaving requests
never mixes their state. The PyTorch / ONNX Runtime backends run one sequence per forward pass:
concurrency here means fair interleaving, not batched passes. A cancelled (disconnected),
timed-out or failed request leaves at its next turn; the others go on.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..decoding import Generation, GenerationResult, Round
from ..decoding.detokenizer import held_back

log = logging.getLogger("dflash_trt.server")


class QueueFull(Exception):
    """More requests waiting than the configured queue holds: answer 429."""


class ShuttingDown(Exception):
    """The server is draining: answer 503."""


@dataclass
class RoundEvent:
    round: Round
    text: str | None  # new text, safe to show (never a partial stop string or a partial character)
    result: GenerationResult | None = None  # set on the last round


@dataclass
class ErrorEvent:
    kind: str  # "timeout", "cancelled", "shutdown", "engine"
    message: str


@dataclass
class Job:
    id: str
    generation: Generation
    loop: asyncio.AbstractEventLoop
    deadline: float  # time.monotonic() after which the request is abandoned
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.monotonic)
    last_event: float | None = None
    emitted_text: str = ""
    cancelled: ErrorEvent | None = None  # why the worker should drop this job at its next turn
    finished: bool = False
    outcome: str | None = None  # "ok" or an ErrorEvent kind
    fallback_counted: bool = False

    def cancel(self, kind: str = "cancelled", message: str = "the client went away") -> None:
        """Ask the worker to drop this job at its next turn (a no-op once finished)."""
        if self.cancelled is None:
            self.cancelled = ErrorEvent(kind, message)

    def _emit(self, event: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the request's loop is gone (server stopped): nobody is listening
            pass


class Orchestrator:
    def __init__(self, decoder, metrics, max_active: int = 8, max_queue: int = 64):
        self.decoder, self.metrics = decoder, metrics
        self.max_active, self.max_queue = max_active, max_queue
        self._cv = threading.Condition()
        self._pending: collections.deque[Job] = collections.deque()
        self._active: list[Job] = []
        self._draining = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
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
    def draining(self) -> bool:
        return self._draining

    @property
    def busy(self) -> int:
        with self._cv:
            return len(self._pending) + len(self._active)

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
        self.metrics.queue_depth.set(0)
        for job in self._active:  # the worker drops them at their next turn
            job.cancel(kind, message)
        self._cv.notify_all()

    # ---- requests -----------------------------------------------------------------------
    def check_admission(self) -> None:
        """Raise ShuttingDown / QueueFull now, before a request spends time on tokenizing (submit checks again)."""
        with self._cv:
            self._admission_locked()

    def _admission_locked(self) -> None:
        if self._draining or self._stopping:
            raise ShuttingDown("the server is shutting down")
        if len(self._pending) + len(self._active) >= self.max_active + self.max_queue:
            raise QueueFull(f"{len(self._pending)} requests already waiting")

    def submit(self, job: Job) -> None:
        with self._cv:
            self._admission_locked()
            self._pending.append(job)
            self.metrics.queue_depth.set(len(self._pending))
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
                while self._pending and len(self._active) < self.max_active:
                    self._active.append(self._pending.popleft())
                turn = list(self._active)
                self.metrics.queue_depth.set(len(self._pending))
                self.metrics.inflight.set(len(self._active))
            for job in turn:  # round-robin: every active job advances one round per turn
                self._advance(job)
            with self._cv:
                self._active = [j for j in self._active if not j.finished]
                self.metrics.inflight.set(len(self._active))
                self._cv.notify_all()

    def _advance(self, job: Job) -> None:
        if job.finished:
            return
        if job.cancelled is not None:
            return self._finish(job, job.cancelled)
        if time.monotonic() > job.deadline:
            return self._finish(job, ErrorEvent("timeout", "the request exceeded the server's time limit"))
        gen = job.generation
        s = gen.stats
        try:  # only this thread touches the engines: no lock (the tokenizer serializes its own calls)
            rnd = gen.step()
            result = gen.result() if gen.done else None
            text = self._safe_text(job, result)
        except Exception as e:  # an engine failure ends this request only
            log.exception("request %s: engine failure", job.id)
            self.metrics.engine_errors.inc()
            return self._finish(job, ErrorEvent("engine", f"{type(e).__name__} in the engine (request {job.id})"))
        now = time.monotonic()
        m = self.metrics
        if gen.drafter_error is not None and not job.fallback_counted:
            job.fallback_counted = True
            m.drafter_fallbacks.inc()
            log.warning("request %s: drafter failed (%r); continuing on the target alone", job.id, gen.drafter_error)
        n = len(rnd.token_ids)
        m.generated_tokens.inc(n)
        if rnd.prefill:
            m.ttft.observe(now - job.submitted)
        else:
            m.acceptance.observe(n)
            m.draft_time.observe(rnd.timings.draft_s)
            m.verify_time.observe(rnd.timings.verify_s)
            if n and job.last_event is not None:
                for _ in range(n):
                    m.itl.observe((now - job.last_event) / n)
        job.last_event = now
        if result is not None:  # bookkeeping first: the request may log as soon as it sees the event
            m.prompt_tokens.inc(s.prompt_tokens)
            self._finish(job, None)
        job._emit(RoundEvent(rnd, text, result))

    def _finish(self, job: Job, error: ErrorEvent | None) -> None:
        job.finished = True
        job.outcome = "ok" if error is None else error.kind
        self.metrics.latency.labels(job.outcome).observe(time.monotonic() - job.submitted)
        if error is not None:
            job._emit(error)

    def _safe_text(self, job: Job, result: GenerationResult | None) -> str | None:
        """Text added by this round that can be shown now: the generation's detokenizer holds back a
        partial character; here the end that may still begin a stop string waits too."""
        gen = job.generation
        if gen.detokenizer is None:
            return None
        if result is not None:  # the last round carries whatever is left of the final text
            full = result.text or ""
        else:
            full = gen.detokenizer.text
            full = full[: len(full) - held_back(full, gen.config.stop_strings)]
        if not full.startswith(job.emitted_text):  # cannot happen with sane tokenizers; never repeat text
            return ""
        new = full[len(job.emitted_text):]
        job.emitted_text = full
        return new
