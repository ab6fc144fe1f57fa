"""Benchmark output: Markdown tables (stdout), results JSON and PNG plots under the results folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}"


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(report: dict[str, Any]) -> str:
    """Headline table (all prompt sets pooled), then one detailed table per temperature and length."""
    lines = []
    meta = report["meta"]
    m = meta["machine"]
    lines.append(
        f"Machine: {m['processor']}, {m['cpus']} CPUs, torch threads {m['torch_threads']}; "
        f"torch {meta['versions']['torch']}, transformers {meta['versions']['transformers']}, "
        f"onnxruntime {meta['versions']['onnxruntime']}."
    )
    groups = meta.get("prompt_groups", {})
    if groups.get("truncated_by_time_budget"):
        lines.append(
            f"Time budget reached: {groups['run']} of {groups['planned']} prompt groups ran "
            f"(fewer prompts per cell than asked)."
        )
    if meta["skipped_block_sizes"]:
        lines.append(
            f"Block sizes {meta['skipped_block_sizes']} skipped: above the drafter's trained size "
            f"({meta['trained_block_size']})."
        )
    lines += [
        "",
        "### Speedup over the target alone (median over all prompts, [min-max])",
        "",
        "| method | "
        + " | ".join(f"T={t['temperature']:g}, {t['max_new_tokens']} tok" for t in _combos(report))
        + " |",
        "|---|" + "---|" * len(_combos(report)),
    ]
    by = {(h["method"], h["temperature"], h["max_new_tokens"]): h for h in report["summary"]}
    for method in dict.fromkeys(h["method"] for h in report["summary"]):
        cells = []
        for c in _combos(report):
            h = by.get((method, c["temperature"], c["max_new_tokens"]))
            if h is None:
                cells.append("-")
                continue
            sp = h["speedup"]
            cells.append(
                f"{sp['median']:.2f}x [{sp['min']:.2f}-{sp['max']:.2f}], tau {h['mean_acceptance_length']:.2f}"
            )
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    for c in _combos(report):
        T, L = c["temperature"], c["max_new_tokens"]
        lines += [
            "",
            f"### T={T:g}, {L} new tokens",
            "",
            "| set | method | tok/s | speedup (median [min-max]) | tau | ceiling | target / draft / other % "
            "| peak dRSS MB | " + ("greedy check |" if T == 0 else "target NLL |"),
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in report["results"]:
            if r["temperature"] != T or r["max_new_tokens"] != L:
                continue
            sp, ts = r["speedup"], r["time_split"]
            check = _check(report, r) if T == 0 else _num(r["target_nll"], "{:.3f}")
            lines.append(
                f"| {r['prompt_set']} | {r['method']} | {r['tokens_per_s']:.1f} | "
                f"{sp['median']:.2f}x [{sp['min']:.2f}-{sp['max']:.2f}] | {r['mean_acceptance_length']:.2f} | "
                f"{_num(r['ceiling'], '{:.2f}x')} | {_pct(ts['target'])} / {_pct(ts['draft'])} / {_pct(ts['other'])} | "
                f"{_num(r['peak_rss_delta_mb'], '{:.1f}')} | {check} |"
            )
    eq = report["equality"]
    lines.append("")
    if eq["ran"]:
        lines.append(
            f"Greedy equality with the baseline: {eq['identical']}/{eq['checked']} identical, "
            f"{len(eq['numerical_ties'])} numerical ties (logit gap <= {eq['tie_tolerance']:g}), "
            f"{len(eq['mismatches'])} mismatches -> {'PASSED' if eq['passed'] else 'FAILED'}."
        )
    else:
        lines.append(f"Greedy equality: not checked ({eq['reason']}).")
    for key in ("sampling", "tau", "ceiling", "memory"):
        lines.append(f"\n_{report['notes'][key]}_")
    return "\n".join(lines) + "\n"


def _combos(report: dict[str, Any]) -> list[dict[str, Any]]:
    seen = dict.fromkeys((h["temperature"], h["max_new_tokens"]) for h in report["summary"])
    return [{"temperature": t, "max_new_tokens": n} for t, n in seen]


def _check(report: dict[str, Any], r: dict[str, Any]) -> str:
    if r["family"] == "baseline" and r["runs"] == r["prompts"]:
        return "reference"
    eq = report["equality"]
    key = (r["method"], r["prompt_set"], r["max_new_tokens"])
    bad = sum(1 for e in eq["mismatches"] if (e["method"], e["prompt_set"], e["max_new_tokens"]) == key)
    ties = sum(1 for e in eq["numerical_ties"] if (e["method"], e["prompt_set"], e["max_new_tokens"]) == key)
    return "MISMATCH" if bad else ("identical" + (f" ({ties} ties)" if ties else ""))


def write_json(report: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def plot(report: dict[str, Any], out: Path) -> list[Path]:
    """speedup.png (by method and block size, per prompt set) and acceptance_hist.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    combos = _combos(report)
    sets = list(dict.fromkeys(r["prompt_set"] for r in report["results"]))
    methods = [m["name"] for m in report["meta"]["methods"]]
    fig, axes = plt.subplots(len(combos), 1, figsize=(max(8, 1.1 * len(methods)), 3.2 * len(combos)), squeeze=False)
    width = 0.8 / max(len(sets), 1)
    for ax, c in zip(axes[:, 0], combos):
        x = np.arange(len(methods))
        for k, name in enumerate(sets):
            rows = {
                r["method"]: r
                for r in report["results"]
                if r["prompt_set"] == name
                and r["temperature"] == c["temperature"]
                and r["max_new_tokens"] == c["max_new_tokens"]
            }
            nan = {"median": np.nan, "min": np.nan, "max": np.nan}  # a cell a time budget left empty
            sp = [rows[m]["speedup"] if m in rows else nan for m in methods]
            med = np.array([x["median"] for x in sp])
            lo = med - np.array([x["min"] for x in sp])
            hi = np.array([x["max"] for x in sp]) - med
            ax.bar(x + (k - (len(sets) - 1) / 2) * width, med, width, yerr=[lo, hi], capsize=2, label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(x, methods, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("speedup vs target alone")
        ax.set_title(
            f"T={c['temperature']:g}, {c['max_new_tokens']} new tokens (median, min-max over prompts)", fontsize=9
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths = [out / "speedup.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    hist = report["acceptance_histograms"]
    shown = [m for m in methods if m not in ("baseline", "hf-generate") and hist.get(m)]
    if shown:
        cols = min(4, len(shown))
        rows_n = (len(shown) + cols - 1) // cols
        fig, axes = plt.subplots(rows_n, cols, figsize=(3.2 * cols, 2.6 * rows_n), squeeze=False)
        for ax, m in zip(axes.flat, shown):
            temps = sorted(hist[m])
            top = max(int(k) for t in temps for k in hist[m][t])
            x = np.arange(1, top + 1)
            w = 0.8 / len(temps)
            for j, t in enumerate(temps):
                counts = np.array([hist[m][t].get(str(v), 0) for v in x], dtype=float)
                ax.bar(x + (j - (len(temps) - 1) / 2) * w, counts / max(counts.sum(), 1), w, label=f"T={t}")
            ax.set_title(m, fontsize=9)
            ax.set_xticks(x)
            ax.set_xlabel("tokens per round", fontsize=8)
            ax.set_ylabel("fraction of rounds", fontsize=8)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(shown) :]:
            ax.axis("off")
        fig.tight_layout()
        paths.append(out / "acceptance_hist.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths
