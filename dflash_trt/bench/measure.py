"""Small direct measurements beside the end-to-end runs: per-pass costs for the speedup ceiling,
peak memory per run, and the target's own log-likelihood of a continuation."""

from __future__ import annotations

import ctypes
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch

if TYPE_CHECKING:
    from ..models.target import CausalLM
    from ..runtime.base import DrafterEngine, TargetEngine

PROC_STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


class PassCosts(TypedDict):
    """Median ms of the passes a round is made of (see pass_costs)."""

    context_tokens: int
    target_step_ms: float
    verify_ms: dict[int, float]  # block size -> ms
    draft_ms: dict[str, dict[int, float]]  # drafter backend -> block size -> ms


# ---- per-pass costs: t(one target step), t(verify B tokens), t(draft B) ----------------------
def _sync() -> None:
    """CUDA kernels run asynchronously: wait for them before reading the clock (a no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()


def _median_ms(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    return _median_setup_ms(lambda: 0, lambda _: fn(), reps, warmup)


def _median_setup_ms(setup: Callable[[], int], fn: Callable[[int], object], reps: int, warmup: int = 2) -> float:
    """Median ms of `fn(setup())` over `reps` calls after `warmup` ones; `setup()` (fresh state each time: a
    drafter row holding the context) is not timed."""
    times = []
    for i in range(warmup + reps):
        state = setup()
        _sync()
        t0 = time.perf_counter()
        fn(state)
        _sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def pass_costs(
    target: TargetEngine, drafters: dict[str, DrafterEngine], context_ids: list[int], block_sizes: list[int], reps: int
) -> PassCosts:
    """Median ms of the passes one round is made of, for one row whose caches hold len(context_ids) tokens.

    target_step_ms: one token through the target + rollback (a baseline decode step);
    verify_ms[B]:   B tokens through the target with features + rollback (a DFlash verify);
    draft_ms[backend][B]: one drafter round given (B+1)//2 newly committed tokens' features.
    """
    from ..runtime.base import DraftRequest

    session = target.new_session()
    row = session.add_row()
    [out] = session.forward([row], [torch.tensor(context_ids)], last_logits_only=True, features=bool(drafters))
    n = session.length(row)
    last = torch.tensor(context_ids[-1:])

    def step() -> None:
        session.forward([row], [last], features=False)
        session.rollback(row, n)

    costs: PassCosts = {"context_tokens": n, "target_step_ms": _median_ms(step, reps), "verify_ms": {}, "draft_ms": {}}
    for b in block_sizes:
        block = torch.tensor((context_ids * b)[:b])

        def verify(block: torch.Tensor = block) -> None:
            session.forward([row], [block], features=bool(drafters))
            session.rollback(row, n)

        costs["verify_ms"][b] = _median_ms(verify, reps)
    session.remove_row(row)
    for backend, engine in drafters.items():
        costs["draft_ms"][backend] = {}
        feats = out.features
        assert feats is not None  # asked for whenever there are drafters
        ds = engine.new_session()
        for b in block_sizes:
            new = (b + 1) // 2

            def context(new: int = new, b: int = b) -> int:
                """A row holding the context, minus what this round brings (the drafter's cache only grows)."""
                r = ds.add_row()
                ds.draft([DraftRequest(r, feats[:-new], context_ids[-1], b)])
                return r

            def draft(r: int, new: int = new, b: int = b) -> None:
                ds.draft([DraftRequest(r, feats[-new:], context_ids[-1], b)])
                ds.remove_row(r)

            costs["draft_ms"][backend][b] = _median_setup_ms(context, draft, reps)
    return costs


def ceiling(tau: float, costs: PassCosts, block_size: int, backend: str) -> float:
    """tau x t(one target step) / (t(verify B) + t(draft B)): the speedup if nothing else cost time."""
    return tau * costs["target_step_ms"] / (costs["verify_ms"][block_size] + costs["draft_ms"][backend][block_size])


# ---- peak memory ---------------------------------------------------------------------------
def _status_kb(field: str) -> int:
    found = re.search(rf"^{field}:\s+(\d+) kB", PROC_STATUS.read_text(), re.M)
    if found is None:
        raise OSError(f"no {field} in {PROC_STATUS}")
    return int(found.group(1))


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """Peak resident memory a run adds: free heap handed back to the OS, the kernel's peak counter
    (VmHWM) reset to the current RSS (`echo 5 > /proc/self/clear_refs`, Linux), run, then
    VmHWM - RSS at the reset. Unavailable (None) where the kernel does not allow the reset."""

    def __init__(self) -> None:
        self.available = PROC_STATUS.exists() and self._try_reset()
        self.base_kb = 0

    @staticmethod
    def _try_reset() -> bool:
        try:
            CLEAR_REFS.write_text("5")
            return True
        except OSError:
            return False

    def reset(self) -> None:
        if self.available:
            _malloc_trim()
            CLEAR_REFS.write_text("5")
            self.base_kb = _status_kb("VmRSS")

    def peak_delta_mb(self) -> float | None:
        if not self.available:
            return None
        return max(0, _status_kb("VmHWM") - self.base_kb) / 1024


# ---- the target's view of a continuation (a loose check of sampled outputs) ------------------
@torch.inference_mode()
def target_nll(model: CausalLM, prompt_ids: list[int], tokens: list[int], temperature: float) -> float:
    """Mean negative log-likelihood per generated token under the target's softmax(logits / T)."""
    if not tokens:
        return float("nan")
    ids = torch.tensor([prompt_ids + tokens], device=model.device)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(logits / max(temperature, 1e-6), dim=-1)
    return float(-logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None]).mean())


@torch.inference_mode()
def divergence_margin(
    model: CausalLM, prompt_ids: list[int], reference: list[int], other: list[int]
) -> tuple[int, float]:
    """First position where two greedy outputs differ, and the target's logit gap there between the
    two tokens (near 0: a numerical tie the two code paths may break differently)."""
    i = next((k for k, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
    if i >= min(len(reference), len(other)):
        return i, float("inf")  # one is a prefix of the other: a length difference, never a tie
    ids = torch.tensor([prompt_ids + reference[:i]], device=model.device)
    logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()
    return i, float((logits[reference[i]] - logits[other[i]]).abs())
