"""The serving simulation's report (`make bench-sim`, results/sim/README.md): Markdown sections
rendered from its results.json, each a list of lines. `dflash_trt.sim.bench` keeps the recipe and its prose;
these render what the run computed."""

from __future__ import annotations

from typing import Any


def criteria_table(checks: list[dict[str, Any]], title: str) -> list[str]:
    """The checks as a PASS / FAIL table under `title`."""
    lines = [f"## {title}", "", "| check | result | figure |", "|---|---|---|"]
    lines += [f"| {c['what']} | {'PASS' if c['passed'] else 'FAIL'} | {c['figure']} |" for c in checks]
    return lines


def poisson_table(rows: list[dict[str, Any]], title: str) -> list[str]:
    """The open-loop sweep: per arrival rate and policy, tokens/s, latency percentiles and goodput."""
    lines = [
        "",
        f"## {title}",
        "",
        "| rate req/s | policy | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | goodput req/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rate_rps']} | {r['policy']} | {r['tokens_per_s']:.0f} | {r['ttft_ms']['p50']:.0f} | "
            f"{r['ttft_ms']['p99']:.0f} | {r['itl_ms']['p50']:.1f} | {r['itl_ms']['p99']:.1f} | {r['goodput_rps']:.2f} |"
        )
    return lines


def cpu_calibration(c: dict[str, Any]) -> list[str]:
    """Calibration (a): the simulator on this CPU's recorded cost grid against the measured tokens/s."""
    lines = [
        "",
        "## Calibration (a): this CPU",
        "",
        f"The simulator with `make bench-load`'s recorded CPU cost grid and host time per step "
        f"({1e3 * c['host_step_s']:.2f} ms), the demo pair's recorded per-prompt acceptance (tau at block 8),",
        f"on the engines-alone stream (C={c['concurrency']}, {c['requests']} requests, {c['osl']} new tokens):",
        "",
        "The grid keeps each cell's fastest pass (other agents share the 2 cores); the verify passes of the same",
        f"benchmark ran at {c['k']}x the grid's price for their shape (its step profile), so the grid is scaled by",
        "that measured factor; the raw grid's figures are given too.",
        "",
        "| mode | simulated tokens/s | measured tokens/s | error | raw grid | raw error |",
        "|---|---|---|---|---|---|",
    ]
    for k, m in c["modes"].items():
        lines.append(
            f"| {k} | {m['simulated_tokens_per_s']:.0f} | {m['measured_tokens_per_s']:.0f} | "
            f"{100 * m['error']:+.1f} % | {m['raw_grid_tokens_per_s']:.0f} | {100 * m['raw_grid_error']:+.1f} % |"
        )
    return lines
