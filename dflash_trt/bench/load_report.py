"""The load benchmark's report (`dflash-trt bench load`, results/load/README.md): Markdown rendered from
its cells (one per server mode, concurrency and temperature), its in-process figures and its checks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Cell = dict[str, Any]
Key = tuple[str, int, float]  # (mode, concurrency, temperature)


def load_markdown(
    cells: list[Cell],
    proc: dict[str, Any] | None,
    found: Sequence[tuple[str, bool | None, str]],
    settings: dict[str, Any],
    all_modes: Sequence[str],
) -> str:
    """The whole README: the cells' table, the server's batches, the checks, then the in-process sections
    present in `proc`. `all_modes` orders the columns (modes without a cell are left out)."""
    by = {(c["mode"], c["concurrency"], c["temperature"]): c for c in cells}
    modes = [m for m in all_modes if any(c["mode"] == m for c in cells)]
    keys = sorted({(c["temperature"], c["concurrency"]) for c in cells})
    lines = _cells_table(by, modes, keys, proc, settings)
    if any(c.get("server") for c in cells):
        lines += _server_batches(by, modes, keys)
    lines += ["", "## Done-figures", ""]
    lines += [f"- {'PASS' if ok else 'FAIL' if ok is not None else 'n/a'}: {what}: {fig}" for what, ok, fig in found]
    if proc and proc.get("engines_alone"):
        lines += _engines_alone(proc["engines_alone"])
    if proc and proc.get("step_profile"):
        lines += _step_profile(proc["step_profile"])
    if proc and proc.get("per_prompt"):
        lines += _per_prompt(proc["per_prompt"], proc.get("repeats", 1))
    return "\n".join(lines) + "\n"


def _cells_table(
    by: dict[Key, Cell],
    modes: list[str],
    keys: list[tuple[float, int]],
    proc: dict[str, Any] | None,
    settings: dict[str, Any],
) -> list[str]:
    hf = {(r["concurrency"], r["temperature"]): r["tokens_per_s"] for r in (proc or {}).get("hf_generate", [])}
    lines = [
        f"# Load benchmark: {settings['target']} + {settings['drafter']}",
        "",
        f"{settings['machine']}; drafter dtype {settings.get('drafter_dtype', 'float32')}; "
        f"aiperf (nice {settings.get('client_nice', 0)}), completions, streaming; "
        f"held-out code prompts, {settings['osl']} "
        "tokens per request (ignore_eos). Output tokens/s (higher is better); ratios side by side in one run.",
        "",
        "| T | concurrency | HF generate | "
        + " | ".join(modes)
        + " | adaptive / HF | adaptive / target | TTFT p50/p99 ms (adaptive) | ITL p50/p99 ms (adaptive) |",
        "|---|---|---|" + "---|" * len(modes) + "---|---|---|---|",
    ]
    for t, c in keys:
        lines.append(_cells_row(by, modes, t, c, hf.get((c, t))))
    return lines


def _cells_row(by: dict[Key, Cell], modes: list[str], t: float, c: int, h: float | None) -> str:
    a = by.get(("adaptive", c, t))
    tg = by.get(("target", c, t))
    vals = " | ".join(
        f"{by[(m, c, t)]['tokens_per_s']:.0f}" if (m, c, t) in by and by[(m, c, t)]["tokens_per_s"] else "-"
        for m in modes
    )
    r_hf = f"{a['tokens_per_s'] / h:.2f}x" if a and h and a["tokens_per_s"] else "-"
    r_t = (
        f"{a['tokens_per_s'] / tg['tokens_per_s']:.2f}x"
        if a and tg and a["tokens_per_s"] and tg["tokens_per_s"]
        else "-"
    )
    lat = (
        f"{a['ttft_ms']['p50']:.0f} / {a['ttft_ms']['p99']:.0f} | {a['itl_ms']['p50']:.1f} / {a['itl_ms']['p99']:.1f}"
        if a and a["ttft_ms"]["p50"] is not None
        else "- | -"
    )
    return (
        f"| {t:g} | {c} | {h:.0f} | {vals} | {r_hf} | {r_t} | {lat} |"
        if h
        else f"| {t:g} | {c} | - | {vals} | {r_hf} | {r_t} | {lat} |"
    )


def _server_batches(by: dict[Key, Cell], modes: list[str], keys: list[tuple[float, int]]) -> list[str]:
    lines = [
        "",
        "## The server's batches (its /metrics over the median run, aiperf's warm-up included)",
        "",
        "Mean rows per verify pass (of C: requests between two of aiperf's, or waiting for the step, "
        "are not in it) / mean block size.",
        "",
        "| T | concurrency | " + " | ".join(modes) + " |",
        "|---|---|" + "---|" * len(modes),
    ]
    for t, c in keys:
        parts = []
        for m in modes:
            srv = by.get((m, c, t), {}).get("server") or {}
            parts.append(f"{srv['mean_verify_rows']} / {srv['mean_block']}" if srv.get("mean_verify_rows") else "-")
        lines.append(f"| {t:g} | {c} | " + " | ".join(parts) + " |")
    return lines


def _engines_alone(e: dict[str, Any]) -> list[str]:
    tps = e["tokens_per_s"]
    return [
        "",
        f"## The engines alone: C={e['concurrency']}, T=0, in process, no server, no client",
        "",
        "The same request stream, each finished request replaced at once; median of "
        f"{len(e['runs_tokens_per_s']['adaptive'])} runs in a rotating order. No server on this machine "
        "can beat these ratios: the cells above add HTTP, streaming and a client on the same cores.",
        "",
        "| HF generate | target (batched decoder) | adaptive | adaptive / HF | target / HF |",
        "|---|---|---|---|---|",
        f"| {tps['hf-generate']:.0f} | {tps['target']:.0f} | {tps['adaptive']:.0f} | "
        f"{e['adaptive_vs_hf']:.2f}x | {e['target_vs_hf']:.2f}x |",
    ]


def _step_profile(p: dict[str, Any]) -> list[str]:
    return [
        "",
        f"## One batched adaptive step at {p['rows']} rows (mean of {p['steps']} steps)",
        "",
        f"{p['mean_verify_tokens']} target tokens per step (mean block {p['mean_block']}), "
        f"{p['committed_per_step']} tokens committed per step.",
        "",
        "| policy | draft | verify | acceptance | Python overhead | total |",
        "|---|---|---|---|---|---|",
        f"| {p['policy_ms']} ms | {p['draft_ms']} ms | {p['verify_ms']} ms | {p['accept_ms']} ms | "
        f"{p['overhead_ms']} ms | {p['total_ms']} ms |",
    ]


def _per_prompt(rows: list[dict[str, Any]], repeats: int) -> list[str]:
    lines = [
        "",
        f"## Per prompt, one request alone (T=0; each time the best of {repeats} runs)",
        "",
        "| set | prompt | prompt tokens | new tokens | tau B=8 | tau adaptive | single B=8 / target | "
        "adaptive / target | equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in rows:
        lines.append(
            f"| {p['set']} | {p['prompt']} | {p['prompt_tokens']} | {p['new_tokens']} | "
            f"{p['tau_single_b8']} | {p['tau_adaptive']} | {p['single_vs_target']:.2f}x | "
            f"{p['adaptive_vs_target']:.2f}x | {p['equal']} |"
        )
    return lines
