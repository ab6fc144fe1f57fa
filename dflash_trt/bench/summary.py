"""A benchmark run's aggregates: per cell (temperature, length, prompt set, method) its speedup over the
baseline (per-prompt ratios), acceptance, time split and ceiling; the headline over every set; the
acceptance-length histograms."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from .measure import PassCosts, ceiling

if TYPE_CHECKING:
    from .methods import Method
    from .settings import BenchSettings, Cell, CellKey


def _per_prompt_rate(cell: Cell) -> dict[int, float]:
    """tokens/s per prompt: its tokens over the median of its repeats' times."""
    return {i: len(runs[0].token_ids) / statistics.median(r.seconds for r in runs) for i, runs in cell.runs.items()}


def _quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median": round(statistics.median(xs), 3), "min": round(xs[0], 3), "max": round(xs[-1], 3), "n": len(xs)}


def summarise(
    s: BenchSettings, methods: list[Method], cells: dict[CellKey, Cell], costs: dict[int, PassCosts]
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for T in s.temperatures:
        for L in s.max_new_tokens:
            for name in s.prompt_sets:
                base_rate = _per_prompt_rate(cells[(T, L, name, "baseline")])
                for m in methods:
                    cell = cells.get((T, L, name, m.name))
                    if cell is not None and cell.runs:  # a time budget may leave late cells empty
                        rows.append(row(m, cell, base_rate, costs[L], T, L, name))
    return rows


def row(
    m: Method, cell: Cell, base_rate: dict[int, float], costs: PassCosts, T: float, L: int, name: str
) -> dict[str, Any]:
    runs = [r for rs in cell.runs.values() for r in rs]
    rate = _per_prompt_rate(cell)
    ratios = [rate[i] / base_rate[i] for i in rate]
    lengths = [a for r in runs for a in r.acceptance_lengths]
    tau = sum(lengths) / len(lengths) if lengths else 0.0
    total = sum(r.seconds for r in runs)
    drafts = [r.draft_s for r in runs if r.draft_s is not None]
    split = {
        "target": sum(r.target_s for r in runs) / total,
        "draft": None if len(drafts) < len(runs) else sum(drafts) / total,
        "other": sum(r.other_s for r in runs) / total,
    }
    peaks = [p for p in cell.peak_mb if p is not None]
    ceil = None
    if m.drafter_backend is not None and m.block_size and m.block_size > 1:
        ceil = round(ceiling(tau, costs, m.block_size, m.drafter_backend), 3)
    elif m.family == "baseline":
        ceil = 1.0
    speed = _quantiles(ratios)
    return {
        "temperature": T,
        "max_new_tokens": L,
        "prompt_set": name,
        "method": m.name,
        "family": m.family,
        "block_size": m.block_size,
        "prompts": len(rate),
        "runs": len(runs),
        "tokens": sum(len(r.token_ids) for r in runs),
        "tokens_per_s": round(sum(rate.values()) / len(rate), 2),
        "speedup": speed,
        "speedup_per_prompt": [round(x, 3) for x in ratios],
        "mean_acceptance_length": round(tau, 3),
        "time_split": {k: (round(v, 4) if v is not None else None) for k, v in split.items()},
        "ceiling": ceil,
        "gap_to_ceiling": round(ceil - speed["median"], 3) if ceil else None,
        "peak_rss_delta_mb": round(max(peaks), 1) if peaks else None,
        "target_nll": round(statistics.mean(cell.nll), 4) if cell.nll else None,
    }


def headline(s: BenchSettings, methods: list[Method], cells: dict[CellKey, Cell]) -> list[dict[str, Any]]:
    """Per method, temperature and length: the median speedup over every prompt of every set."""
    out: list[dict[str, Any]] = []
    for T in s.temperatures:
        for L in s.max_new_tokens:
            for m in methods:
                ratios: list[float] = []
                lengths: list[float] = []
                for name in s.prompt_sets:
                    if (T, L, name, m.name) not in cells:
                        continue
                    base = _per_prompt_rate(cells[(T, L, name, "baseline")])
                    rate = _per_prompt_rate(cells[(T, L, name, m.name)])
                    ratios += [rate[i] / base[i] for i in rate]
                    lengths += [
                        a for rs in cells[(T, L, name, m.name)].runs.values() for r in rs for a in r.acceptance_lengths
                    ]
                if not ratios:
                    continue
                out.append(
                    {
                        "temperature": T,
                        "max_new_tokens": L,
                        "method": m.name,
                        "family": m.family,
                        "block_size": m.block_size,
                        "speedup": _quantiles(ratios),
                        "mean_acceptance_length": round(sum(lengths) / len(lengths), 3) if lengths else 0.0,
                    }
                )
    return out


def histograms(methods: list[Method], cells: dict[CellKey, Cell]) -> dict[str, dict[str, dict[str, int]]]:
    """Counts of tokens committed per round, per method and temperature (all sets and lengths pooled)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for (T, L, name, mname), cell in cells.items():
        h = out.setdefault(mname, {}).setdefault(f"{T:g}", {})
        for rs in cell.runs.values():
            for r in rs:
                for a in r.acceptance_lengths:
                    if float(a).is_integer():
                        h[str(int(a))] = h.get(str(int(a)), 0) + 1
    return out
