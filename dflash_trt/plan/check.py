"""`plan check`: does a plan still hold on the acceptance and batch sizes an engine's metrics show?

The rule (why a tau check is a throughput check): at a fixed batch size and draft length a verify round
costs the same whatever the drafter's acceptance, so tokens/s at that cell scale with tokens per round.
A plan's simulated tokens/s at concurrency C and k drafted tokens, times tau_now(k) / tau_planned(k), is
what the same cell gives at the acceptance seen now. From that (every count in drafted tokens, the anchor
excluded, as plan.json keys them):

* the batch: the mean running batch picks the plan's cell (the smallest planned concurrency at or above it,
  as TensorRT-LLM's draft_len_schedule picks its key); a batch above the largest planned concurrency is
  outside the plan (TensorRT-LLM's schedule drafts nothing there, vLLM carries its last range): it fails;
* tau: the engine's tau against the plan's at the drafts per round the engine ran;
* the gain: the plan's predicted gain over the target alone at that cell and draft length, against the gain
  at the acceptance seen now; it no longer holds when it fell by more than the tolerance or to 1x or less;
* the schedule: at each planned concurrency the best draft length at the acceptance seen now, against the
  plan's (advice: re-plan with `dflash-trt plan --from-metrics` to write it).

The acceptance seen now, at draft lengths the engine did not run: where the engine gives per-position rates
(vLLM, this project's server) the observed positions replace the plan's and the last observed rate carries
on; where it gives tau only (SGLang, TensorRT-LLM) every planned per-position rate is scaled by one factor
whose tau at the engine's drafts per round is the observed tau.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..sim.acceptance import tau_of
from .metrics import Observed

ABOVE = (
    "above it TensorRT-LLM's draft_len_schedule drafts nothing (1 under the open PR 16888's min_runtime_draft_len), "
    "vLLM keeps its last range's length and nothing was simulated: re-plan up to the largest batch served, or "
    "bound the engine's batch"
)
HOLDS, FAILS = 0, 3  # exit statuses of `plan check` (1 stays for errors)


class PlanDocError(ValueError):
    """A plan folder whose plan.json lacks what the check needs."""


@dataclass
class Report:
    lines: list[tuple[bool, str]] = field(default_factory=list)  # (held, what) per assumption
    advice: list[str] = field(default_factory=list)
    schedule: dict[int, int] = field(default_factory=dict)  # concurrency -> best drafts at the acceptance seen

    @property
    def holds(self) -> bool:
        return all(ok for ok, _ in self.lines)

    def add(self, ok: bool, text: str) -> None:
        self.lines.append((ok, text))

    def text(self) -> str:
        rows = [("held      " if ok else "NOT HELD  ") + t for ok, t in self.lines]
        rows += ["advice    " + a for a in self.advice]
        rows.append("the plan holds" if self.holds else "the plan's predicted gain no longer holds")
        return "\n".join(rows)


def planned_rates(doc: dict[str, Any]) -> list[list[float]]:
    try:
        rates = doc["inputs"]["acceptance"]["position_rates"]
        assert isinstance(rates, list) and rates and all(isinstance(r, list) and r for r in rates)
        return [[float(x) for x in r] for r in rates]
    except (KeyError, TypeError, AssertionError):
        raise PlanDocError(
            "plan.json has no inputs.acceptance.position_rates: write the plan again with this version"
        ) from None


def mean_tau(profiles: list[list[float]], block: int) -> float:
    return sum(tau_of(r, block) for r in profiles) / len(profiles)


def seen_rates(obs: Observed, planned: list[list[float]]) -> list[list[float]]:
    """The per-position acceptance seen now, extended to every planned position (module docstring)."""
    n = max(len(r) for r in planned)
    if obs.position_rates:
        seen = list(obs.position_rates)[:n]
        return [seen + [seen[-1]] * (n - len(seen))]
    block = max(2, round(obs.mean_drafts or n) + 1)
    lo, hi = 0.0, 1.0
    while mean_tau([[min(1.0, hi * x) for x in r] for r in planned], block) < obs.tau and hi < 1e6:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        below = mean_tau([[min(1.0, mid * x) for x in r] for r in planned], block) < obs.tau
        lo, hi = (mid, hi) if below else (lo, mid)
    return [[min(1.0, hi * x) for x in r] for r in planned]


def per_position(seen: list[float], planned: list[list[float]]) -> str:
    """The seen per-position rates and the one furthest below the plan's (its mean over request classes)."""
    n = min(len(seen), min(len(r) for r in planned))
    plan = [sum(r[k] for r in planned) / len(planned) for k in range(n)]
    worst = min(range(n), key=lambda k: seen[k] - plan[k])
    return (
        f"per position: seen {', '.join(f'{r:.2f}' for r in seen)}; the furthest below the plan is position "
        f"{worst} ({seen[worst]:.2f} vs {plan[worst]:.2f})"
    )


# plan.json before drafted tokens became its one unit keyed cells and tau by block (drafts + 1); operators
# keep such files, so they are read through this table (old key -> new key), with a notice.
BLOCK_KEYS = {"tokens_per_s_by_block": "tokens_per_s_by_drafts", "tuned_block": "tuned_drafts"}
BLOCK_KEYS |= {"schedule_block": "schedule_drafts", "tau_by_block": "tau_by_drafts"}
OLD_UNITS = "plan.json keyed by block (drafts + 1, before drafted tokens became its one unit): read in drafts"


def _in_drafts(value: Any) -> Any:
    """A block-keyed mapping or a block count, one less: drafted tokens (the anchor excluded)."""
    if isinstance(value, dict):
        return {str(int(b) - 1): v for b, v in value.items()}
    return int(value) - 1


def upgrade(doc: dict[str, Any]) -> str | None:
    """Rewrite, in place, a plan.json written with block keys (BLOCK_KEYS) into drafts; the notice, or None
    when `doc` is already in drafts. A key present in both forms keeps its drafts value."""
    try:
        parts = [c for c in doc.get("cells", []) if isinstance(c, dict)]
        parts.append(doc.get("inputs", {}).get("acceptance", {}))
        old = False
        for part in parts:
            for key, new in BLOCK_KEYS.items():
                if isinstance(part, dict) and key in part:
                    value = _in_drafts(part.pop(key))
                    part.setdefault(new, value)
                    old = True
    except (AttributeError, TypeError, ValueError) as e:
        raise PlanDocError(f"plan.json is not a plan written by `dflash-trt plan`: {e}") from None
    return OLD_UNITS if old else None


def cells(doc: dict[str, Any]) -> list[dict[str, Any]]:
    upgrade(doc)
    try:
        out = sorted(doc["cells"], key=lambda c: c["concurrency"])
        if all("0" in c["tokens_per_s_by_drafts"] and c["schedule_drafts"] >= 0 for c in out):
            return out
    except (KeyError, TypeError):
        pass
    raise PlanDocError("plan.json has no cells with tokens_per_s_by_drafts and schedule_drafts")


def implied(cell: dict[str, Any], planned: list[list[float]], seen: list[list[float]]) -> dict[int, float]:
    """Tokens/s per draft length at this cell at the acceptance seen now (module docstring's rule)."""
    out = {}
    for k_text, tps in cell["tokens_per_s_by_drafts"].items():
        k = int(k_text)
        out[k] = tps if k == 0 else tps * mean_tau(seen, k + 1) / mean_tau(planned, k + 1)
    return out


def schedule_advice(
    rep: Report, table: list[dict[str, Any]], planned: list[list[float]], seen: list[list[float]]
) -> None:
    """Per planned concurrency, the draft length the acceptance seen would choose (a change: when it gains 2 %)."""
    for cl in table:
        t = implied(cl, planned, seen)
        best = max(sorted(t), key=lambda k: (t[k], -k))
        rep.schedule[cl["concurrency"]] = best
        k = cl["schedule_drafts"]
        if best != k and t[best] > t.get(k, 0) * 1.02:
            rep.advice.append(
                f"C={cl['concurrency']}: {best} drafts would give {t[best]:.0f} tokens/s, the plan's "
                f"{k} {t.get(k, 0):.0f}: re-plan with --from-metrics"
            )


def check(doc: dict[str, Any], obs: Observed, tolerance: float = 0.1) -> Report:
    """Each assumption of the plan in `doc` (plan.json; one keyed by block is read in drafts, `upgrade`)
    against `obs` (module docstring)."""
    planned, table = planned_rates(doc), cells(doc)
    seen = seen_rates(obs, planned)
    rep = Report()
    largest = table[-1]["concurrency"]
    top = max(obs.batch, default=0.0)
    mean = obs.mean_batch
    per = f" per engine ({obs.engines} engines, each its own batch)" if obs.engines and obs.engines > 1 else ""
    rep.add(
        top <= largest,
        f"batch: mean {mean:.1f}, largest {top:.0f} running requests{per}; the plan covers 1..{largest}"
        + ("" if top <= largest else f" ({ABOVE})"),
    )
    cell = next((c for c in table if c["concurrency"] >= mean), table[-1])
    c, by_drafts = cell["concurrency"], cell["tokens_per_s_by_drafts"]
    planned_top = max(int(k) for k in by_drafts)
    k = round(obs.mean_drafts) if obs.mean_drafts else cell["schedule_drafts"]
    if k > planned_top:  # the plan priced no longer draft: compare at its longest
        rep.advice.append(f"the engine drafts {k} per round, more than the plan's longest {planned_top}")
        k = planned_top
    if k != cell["schedule_drafts"]:
        rep.advice.append(
            f"the engine drafts {k} per round at this batch, the plan {cell['schedule_drafts']}: "
            "check that the configuration written is the one serving"
        )
    tau_plan = mean_tau(planned, k + 1)
    drop = obs.tau / tau_plan - 1
    rep.add(drop >= -tolerance, f"tau at {k} drafts: planned {tau_plan:.2f}, seen {obs.tau:.2f} ({drop:+.0%})")
    if obs.position_rates:
        rep.advice.append(per_position(obs.position_rates, planned))
    tps = implied(cell, planned, seen)
    alone = by_drafts["0"]
    gain_plan = by_drafts[str(k)] / alone if str(k) in by_drafts else 1
    gain_now = tps.get(k, alone) / alone
    ok = gain_now > 1 and gain_now >= gain_plan * (1 - tolerance)
    rep.add(
        ok, f"gain over the target alone at C={c}: planned {gain_plan:.2f}x, at the acceptance seen {gain_now:.2f}x"
    )
    if obs.tokens_per_s is not None:
        rep.advice.append(
            f"tokens/s seen {obs.tokens_per_s:.1f}; the plan's at C={c} with the acceptance seen {tps.get(k, alone):.1f} "
            "(a gap here with tau held is the cost profile, not the drafter)"
        )
    if obs.idle_drafting:
        rep.advice.append(
            f"{obs.idle_drafting} iterations ran generation requests without drafts: a schedule at 0 drafts stops "
            "refreshing DFlash's context (TensorRT-LLM PR 16888); bound max_batch_size instead"
        )
    lost = obs.stats_lost
    if lost and lost.dropped:
        rep.advice.append(
            f"trtllm-serve dropped {lost.dropped} iteration records at its max_stats_len cap before a scrape read "
            "them (statsDroppedFrames): the window undercounts; raise max_stats_len in the YAML or scrape more often"
        )
    if lost and lost.unread:
        rep.advice.append(
            f"{lost.unread} iteration records were drained from trtllm-serve's /metrics without reaching this check "
            "(statsSequence skipped them): every read drains it, so another reader (a second scraper, the exporter "
            "sidecar, the return_perf_metrics collector) or a scrape that failed after the drain took them, and the "
            "window undercounts; let one reader poll it"
        )
    if lost and lost.capped_polls:
        rep.advice.append(
            f"{lost.capped_polls} scrapes returned max_stats_len + 1 records or more, the most trtllm-serve's executor "
            "keeps: older records of the window may be lost (this engine does not number them); raise max_stats_len "
            "in the YAML (and pass it as --max-stats-len) or scrape more often (--samples)"
        )
    schedule_advice(rep, table, planned, seen)
    return rep
