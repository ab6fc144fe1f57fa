"""A plan written out: the three serving configurations, plan.json, the printed table and plan.png.

* trtllm-serve.yaml: `trtllm-serve TARGET --backend pytorch --config FILE`, speculative_config as
  DFlashDecodingConfig reads it (builders/trtllm_serve.py: the drafter's fields when a drafter folder is given,
  max_draft_len plus draft_len_schedule or max_concurrency from the plan). TensorRT-LLM turns speculation
  off above the schedule's largest key, so the plan's largest concurrency is where its schedule ends.
* vllm-speculative-config.json: `vllm serve TARGET --speculative-config "$(cat FILE)"`, method "dflash",
  num_speculative_tokens (the most drafts any batch size gets) and num_speculative_tokens_per_batch_size
  (vllm-project/vllm#32374: a list of inclusive [first batch, last batch, drafts] ranges from batch 1; vLLM
  carries the last range's value to larger batches, vllm/v1/spec_decode/dynamic/utils.py). No range drafts 0: the
  drafts are floored at 1 as TensorRT-LLM's schedule is (tune.dflash_drafts), because under Model Runner V2 the
  DFlash speculator drafts its full block every step whatever the scheduled length (VLLM_NOTES), so a range of 0
  would pay the drafter and verify nothing.
* vllm-args.txt: the flags for `vllm serve TARGET`: --max-num-seqs, the largest planned concurrency
  (SchedulerConfig.max_num_seqs, vllm/config/scheduler.py: the most sequences an engine's scheduler runs in one
  iteration; each data-parallel engine schedules its own batch), so the batch never leaves the planned range,
  as trtllm-serve.yaml's max_batch_size and sglang-args.txt's --max-running-requests bound theirs; and
  --speculative-config with the JSON above.
* sglang-args.txt: flags for `python -m sglang.launch_server`: SGLang's DFLASH verifies one block size
  (--speculative-num-draft-tokens is the block, the anchor token included) at every batch size, so the file
  holds the one block with the best geometric mean, over the planned concurrencies, of tokens/s relative to
  each concurrency's best, and says what it costs where another block is better.
"""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path
from typing import Any

from .inputs import Acceptance, Cost
from .tune import Plan

FILES = (
    "trtllm-serve.yaml",
    "vllm-speculative-config.json",
    "vllm-speculative-config-fixed.json",
    "vllm-args.txt",
    "sglang-args.txt",
    "plan.json",
    "plan.png",
)
# where a plan without --drafter leaves the placeholder DRAFTER (or nothing) for the drafter folder
TO_FILL = [
    'vllm-speculative-config.json, vllm-speculative-config-fixed.json and vllm-args.txt: "model"',
    "sglang-args.txt: --speculative-draft-model-path",
    "trtllm-serve.yaml: speculative_config.speculative_model",
]
UNIT = "drafted tokens per request per step (the anchor token excluded)"
# Above draft_len_schedule's largest key TensorRT-LLM at 00043967 (llm_args.py, the field's description: "33+:
# use draft_len=0 (implicit, speculation disabled)") drafts 0, and max_concurrency's schedule turns speculation off
# above it. The open PR NVIDIA/TensorRT-LLM#16888 (its branch at 011d0933: tensorrt_llm/_torch/speculative/utils.py
# get_draft_len_for_batch_size) would floor every scheduled length, the implicit one included, at
# DecodingBaseConfig.min_runtime_draft_len: 1 for one-engine modes (DFlash is one), 0 for the others. Within the
# plan neither applies: max_batch_size bounds the batch at the largest key, and no key below it schedules 0 once
# drafting starts.
# What `plan check` reads must be switched on in what the plan writes. trtllm-serve's GET /metrics returns the
# iteration statistics only when the LLM args enable them (TorchLlmArgs.enable_iter_perf_stats, default False:
# tensorrt_llm/llmapi/llm_args.py, NVIDIA/TensorRT-LLM at 00043967; without it /metrics answers an empty list);
# SGLang publishes its Prometheus metrics only under --enable-metrics (python/sglang/srt/server_args.py).
TRTLLM_METRICS = {"enable_iter_perf_stats": True}
# The plan simulates prompts entering in chunks within a step budget (tune.run), so the YAML asks TensorRT-LLM for
# the same: BaseLlmArgs.enable_chunked_prefill defaults to False (llm_args.py at 00043967), and its DFlash keeps a
# chunked prompt's context chunk by chunk (tensorrt_llm/_torch/speculative/dflash.py _store_prefill_context,
# NVIDIA/TensorRT-LLM at 00679c66).
TRTLLM_SERVING = {"enable_chunked_prefill": True, **TRTLLM_METRICS}
SGLANG_METRICS = "--enable-metrics"
# vLLM's JSON cannot carry comments: what applies to num_speculative_tokens_per_batch_size is printed, written to
# plan.json "notes" and said in docs/gpu.md. Sources: vllm-project/vllm#32374; Model Runner V2's DFlash speculator
# (vllm/v1/worker/gpu/spec_decode/dflash/speculator.py at 75d3c8e9: num_query_per_req = 1 + num_speculative_steps,
# and propose() takes no per-step length) against the scheduler's scheduled_spec_decode_tokens, which the
# verification and the rejection count follow (vllm/v1/core/sched/scheduler.py, async_scheduler.py); PR 45953
# (merged) ran DFlash with a batch-size schedule on V2; issue 51510 (open) and PR 57053 (open) concern the
# AutoRegressiveSpeculator (EAGLE, MTP, draft models), which ignores the scheduled length on V2, not DFlash;
# vllm/config/vllm.py drops the schedule with data parallelism.
VLLM_NOTES = (
    "num_speculative_tokens_per_batch_size needs a vLLM with pull request 32374 (merged 2026-05; 0.27.1 has it, "
    "issue 49548); older releases refuse the key",
    "no range drafts 0 (floored at 1, as TensorRT-LLM's schedule): vLLM's config accepts a 0 since PR 32374, but "
    "under Model Runner V2 DFlash drafts its whole block every step, so a 0 would pay the drafter for nothing",
    "under the V1 model runner a schedule downgrades full CUDA graphs to piecewise, which the plan does not price",
    "under Model Runner V2 (the default for dense models, and the only runner of DFlash 2 drafters) the schedule "
    "acts on verification: the DFlash speculator drafts 1 + num_speculative_tokens positions every step, and the "
    "target verifies the scheduled length (PR 45953 ran DFlash with a schedule on V2; issue 51510 concerns the "
    "autoregressive speculators, not DFlash); the plan prices the drafter at the scheduled length, so on V2 it "
    "over-predicts where the schedule drafts fewer than num_speculative_tokens, by the drafter's cost of the "
    "difference",
    "with data parallelism (data_parallel_size > 1) vLLM drops the schedule: serve "
    "vllm-speculative-config-fixed.json there, the one length with the best geometric mean over the planned "
    "concurrencies",
    "vllm-args.txt bounds each engine's batch at the largest planned concurrency (--max-num-seqs); with data "
    "parallelism each engine schedules its own batch up to it",
)


def trtllm_spec(plan: Plan, drafter: Path | None) -> dict[str, Any] | None:
    """The speculative_config mapping (None: drafting pays at no planned concurrency)."""
    from ..builders.trtllm_serve import serve_config

    if plan.limits is None:
        return None
    spec: dict[str, Any] = {"decoding_type": "DFlash", "max_draft_len": plan.block - 1}
    if drafter is not None:
        spec = serve_config(drafter)["speculative_config"]
    spec.update(plan.limits)
    return spec


def trtllm_header(plan: Plan, step_tokens: int | None) -> list[str]:
    """What trtllm-serve.yaml's values mean and what TensorRT-LLM does around them (comment lines)."""
    from ..builders.trtllm_serve import ATTENTION_NOTE

    top = plan.cells[-1].concurrency
    chunk = f"chunked at {step_tokens} tokens a step" if step_tokens else "chunked"
    return [
        f"values: {UNIT}; the schedule covers batch sizes 1..{top} (a key b: that many drafts up to batch b)",
        f"above the largest key TensorRT-LLM drafts 0, which stops refreshing DFlash's per-request context buffers "
        f"(NVIDIA/TensorRT-LLM#16888; that PR, open, would floor it at DecodingBaseConfig.min_runtime_draft_len, 1, "
        f"instead): max_batch_size {top} keeps the batch inside the plan, and no planned batch size drafts fewer "
        "than 1",
        "enable_iter_perf_stats: true: trtllm-serve's /metrics (what `dflash-trt plan check` reads) is empty "
        "without it",
        f"attention: {ATTENTION_NOTE}; DFlash 2 drafters cannot take TRTLLM (no non-causal sliding-window "
        "attention, NVIDIA/TensorRT-LLM#19159)",
        f"enable_chunked_prefill: true: the plan simulated prompts {chunk} (BaseLlmArgs' default is false); "
        "TensorRT-LLM's DFlash keeps a chunked prompt's context chunk by chunk "
        "(tensorrt_llm/_torch/speculative/dflash.py _store_prefill_context, NVIDIA/TensorRT-LLM 00679c66)",
    ]


def no_schedule_note(plan: Plan) -> str:
    """Why trtllm-serve.yaml serves the target alone (plan.limits is None). TensorRT-LLM's draft_len_schedule
    drafts max_draft_len at its smallest key (validate_draft_len_schedule_and_sort) and no more above it, so a
    plan that drafts nothing at its smallest concurrency and drafts at a larger one cannot be written for it."""
    pays = [c.concurrency for c in plan.cells if c.best_block > 1]
    if not pays:
        return "drafting pays at no planned concurrency: serve the target alone"
    return (
        f"drafting pays at C={', '.join(map(str, pays))} but not at C={plan.cells[0].concurrency}, which "
        "TensorRT-LLM's draft_len_schedule cannot say (its smallest key drafts max_draft_len): serve the target "
        "alone there, or plan from a larger --concurrency"
    )


def vllm_ranges(plan: Plan) -> list[list[int]]:
    """[first, last, drafts] per run of equal draft lengths, from batch 1 to the largest planned concurrency;
    never 0 drafts (module docstring: floored at 1, as tune.dflash_drafts floors TensorRT-LLM's)."""
    out: list[list[int]] = []
    start = 1
    for cell in plan.cells:
        k = max(1, cell.best_block - 1)
        if out and out[-1][2] == k:
            out[-1][1] = cell.concurrency
        else:
            out.append([start, cell.concurrency, k])
        start = cell.concurrency + 1
    return out


def vllm_config(plan: Plan, drafter: Path | None) -> dict[str, Any]:
    ranges = vllm_ranges(plan)
    return {
        "method": "dflash",
        "model": str(drafter.resolve()) if drafter is not None else "DRAFTER",
        "num_speculative_tokens": max(1, max(k for _, _, k in ranges)),
        "num_speculative_tokens_per_batch_size": ranges,
    }


def vllm_fixed(plan: Plan, drafter: Path | None) -> dict[str, Any]:
    """One length at every batch size, for where vLLM's schedule cannot act (VLLM_NOTES)."""
    return {
        "method": "dflash",
        "model": str(drafter.resolve()) if drafter is not None else "DRAFTER",
        "num_speculative_tokens": max(1, sglang_block(plan)[0] - 1),
    }


def vllm_args(plan: Plan, config: dict[str, Any]) -> str:
    """vllm-args.txt: --max-num-seqs at the largest planned concurrency and --speculative-config (module
    docstring), shell-quoted, under comment lines that say what each does."""
    top = plan.cells[-1].concurrency
    lines = [
        "# usage: eval \"vllm serve TARGET $(grep -v '^#' vllm-args.txt)\"",
        f"# --max-num-seqs {top}: the plan covers batch sizes 1..{top}; each engine's scheduler runs at most this many",
        "# requests an iteration (SchedulerConfig.max_num_seqs; each data-parallel engine its own batch), so the",
        "# batch stays where the schedule was planned: requests above it queue.",
        "# --speculative-config: vllm-speculative-config.json (num_speculative_tokens_per_batch_size, vLLM PR 32374;",
        f"# {UNIT}; no range drafts 0). Where vLLM drops the schedule (data parallelism),",
        "# use vllm-speculative-config-fixed.json instead.",
    ]
    flags = ["--max-num-seqs", str(top), "--speculative-config", json.dumps(config, separators=(",", ":"))]
    return "\n".join(lines) + "\n" + shlex.join(flags) + "\n"


def vllm_json(config: dict[str, Any]) -> str:
    """The config as JSON with one batch range a line (a reader scans the ranges as a table)."""
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in config.items() if not isinstance(v, list)]
    if "num_speculative_tokens_per_batch_size" in config:
        ranges = ",\n".join(f"    {json.dumps(r)}" for r in config["num_speculative_tokens_per_batch_size"])
        lines.append(f'  "num_speculative_tokens_per_batch_size": [\n{ranges}\n  ]')
    return "{\n" + ",\n".join(lines) + "\n}\n"


def sglang_block(plan: Plan) -> tuple[int, dict[int, float]]:
    """The one block with the best geometric mean of tokens/s over each concurrency's best, and its ratios."""

    def ratios(b: int) -> dict[int, float]:
        return {c.concurrency: c.tokens_per_s[b] / c.tokens_per_s[c.best_block] for c in plan.cells}

    best = max(range(1, plan.block + 1), key=lambda b: sum(math.log(max(r, 1e-9)) for r in ratios(b).values()))
    return best, ratios(best)


def sglang_args(plan: Plan, drafter: Path | None) -> str:
    block, ratio = sglang_block(plan)
    worst = min(ratio, key=lambda c: ratio[c])
    top = plan.cells[-1].concurrency
    lines = [
        # eval keeps a drafter path with spaces one argument (the flags below are shell-quoted)
        "# usage: eval \"python -m sglang.launch_server --model-path TARGET $(grep -v '^#' sglang-args.txt)\"",
        f"# SGLang's DFLASH drafts one length at every batch size: {block - 1} {UNIT}, the length with the best",
        "# geometric mean of tokens/s relative to each planned concurrency's best "
        f"(worst: {ratio[worst]:.3f}x at C={worst});",
        f"# --speculative-num-draft-tokens counts the anchor token too: {block} = {block - 1} drafts + 1.",
    ]
    if block == 1:
        lines.append("# drafting pays at no planned concurrency as one fixed length: serve without --speculative-*")
        return "\n".join(lines) + "\n"
    lines += [
        f"# --max-running-requests {top}: the plan covers batch sizes 1..{top}; it replaces SGLang's speculative",
        "# default of 48 (server_args.py sets 48 when unset) and caps admission there: requests above it queue.",
        f"# {SGLANG_METRICS}: /metrics, which `dflash-trt plan check --engine sglang` reads, is off without it.",
    ]
    flags = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path"]
    flags += [
        str(drafter.resolve()) if drafter is not None else "DRAFTER",
        "--speculative-num-draft-tokens",
        str(block),
    ]
    flags += ["--max-running-requests", str(top), SGLANG_METRICS]
    return "\n".join(lines) + "\n" + shlex.join(flags) + "\n"


def plan_json(
    plan: Plan, acc: Acceptance, cost: Cost, settings: dict[str, Any], configs: dict[str, Any]
) -> dict[str, Any]:
    """Every input (labelled measured or assumed), setting and figure of the plan."""
    return {
        "inputs": {
            "acceptance": {
                "name": acc.name,
                "max_drafts": acc.block_size - 1,
                "measured": acc.measured,
                "source": acc.source,
                # per request class, conditional per draft position: what `plan check` compares an engine with
                "position_rates": [[round(r, 4) for r in p.rates[: plan.block - 1]] for p in acc.profiles],
                "tau_by_drafts": {
                    str(b - 1): round(sum(p.tau(b) for p in acc.profiles) / len(acc.profiles), 4)
                    for b in range(1, plan.block + 1)
                },
            },
            "cost": {"measured": cost.measured, "source": cost.source, "parts": cost.parts},
            "workload": {"measured": False, "source": "assumed: " + settings["workload"]},
        },
        "settings": settings,
        "cells": [
            {
                "concurrency": c.concurrency,
                "requests": c.requests,
                "tokens_per_s_by_drafts": {str(b - 1): round(t, 1) for b, t in c.tokens_per_s.items()},
                "tuned_drafts": c.best_block - 1,
                "schedule_drafts": c.schedule_block - 1,
                "predicted": predicted_json(c.predicted),
                "schedule_vs_tuned": round(c.ratio, 4),
                "vs_target_alone": round(c.predicted["tokens_per_s"] / c.tokens_per_s[1], 3),
            }
            for c in plan.cells
        ],
        "configs": configs,
        "units": f"every count of tokens drafted (*_drafts, *_by_drafts keys, configs) and every configuration "
        f"file: {UNIT}; 0 drafts is the target alone",
        "notes": {"vllm": list(VLLM_NOTES), "trtllm": trtllm_header(plan, settings.get("step_tokens"))},
        "alerts": alerts(plan, acc),
    }


def predicted_json(predicted: dict[str, Any]) -> dict[str, Any]:
    """tune.figures' prediction with its mean block given as mean drafts per verify row (plan.json's one unit)."""
    out = {k: v for k, v in predicted.items() if k != "mean_block"}
    if "mean_block" in predicted:
        out["mean_drafts"] = predicted["mean_block"] - 1
    return {k: _rounded(v) for k, v in out.items()}


def held_out_json(held_out: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """tune.holdout's figures per concurrency, its best block given in drafts (plan.json's one unit)."""
    out = {}
    for c, v in held_out.items():
        row = {k: x for k, x in v.items() if k != "best_block"}
        out[str(c)] = _rounded({"best_drafts": v["best_block"] - 1, **row})
    return out


def alerts(plan: Plan, acc: Acceptance, tolerance: float = 0.1) -> dict[str, Any]:
    """The two numbers of deploy/k8s/base/prometheusrule.yaml's plan alerts (what `plan check` checks with its
    default --tolerance): tau below the plan's at the drafts it serves, less the tolerance (the smallest over
    the drafting concurrencies: the aggregate tau mixes them); a batch above the largest planned concurrency."""
    taus = [sum(p.tau(c.schedule_block) for p in acc.profiles) / len(acc.profiles) for c in plan.cells]
    drafting = [t for c, t in zip(plan.cells, taus) if c.schedule_block > 1]
    return {
        "tau_floor": round((1 - tolerance) * min(drafting), 2) if drafting else None,
        "batch_above": plan.cells[-1].concurrency,
    }


def _rounded(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return round(x, 4) if isinstance(x, float) else x


def table(plan: Plan) -> str:
    head = f"{'C':>5} {'tuned':>5} {'sched':>5} {'tok/s':>9} {'x alone':>7} {'vs tuned':>8} {'TTFT p50/p99 ms':>17} {'ITL p50/p99 ms':>15}"
    rows = [head]
    for c in plan.cells:
        p = c.predicted
        rows.append(
            f"{c.concurrency:>5} {c.best_block - 1:>5} {c.schedule_block - 1:>5} {p['tokens_per_s']:>9.1f} "
            f"{p['tokens_per_s'] / c.tokens_per_s[1]:>7.2f} {c.ratio:>8.3f} "
            f"{p['ttft_ms']['p50']:>8.0f}/{p['ttft_ms']['p99']:<8.0f} {p['itl_ms']['p50']:>7.1f}/{p['itl_ms']['p99']:<7.1f}"
        )
    return "\n".join(rows) + f"\n(tuned, sched: {UNIT})"


def plot(plan: Plan, path: Path, title: str) -> None:
    """Tokens/s by concurrency (every block faint, the target alone, the schedule) and the schedule's ITL / TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [c.concurrency for c in plan.cells]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for b in range(2, plan.block + 1):
        label = f"fixed 1..{plan.block - 1} drafts" if b == 2 else None
        left.plot(cs, [c.tokens_per_s[b] for c in plan.cells], color="0.8", lw=0.8, label=label)
    left.plot(cs, [c.tokens_per_s[1] for c in plan.cells], "k--", label="target alone")
    left.plot(cs, [c.predicted["tokens_per_s"] for c in plan.cells], "o-", color="C0", label="planned schedule")
    for c in plan.cells:
        left.annotate(str(c.schedule_block - 1), (c.concurrency, c.predicted["tokens_per_s"]), fontsize=7)
    left.set(
        xscale="log", xlabel="concurrency", ylabel="tokens/s (simulated)", title="throughput (labels: drafts per step)"
    )
    left.legend(fontsize=8)
    right.plot(cs, [c.predicted["itl_ms"]["p50"] for c in plan.cells], "o-", label="ITL p50")
    right.plot(cs, [c.predicted["itl_ms"]["p99"] for c in plan.cells], "s--", label="ITL p99")
    right.plot(cs, [c.predicted["ttft_ms"]["p50"] for c in plan.cells], "^-", label="TTFT p50")
    right.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="ms (simulated)", title="latency")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.set_xticks(cs, [str(c) for c in cs])
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(
    plan: Plan,
    acc: Acceptance,
    cost: Cost,
    settings: dict[str, Any],
    out: Path,
    drafter: Path | None,
    held_out: dict[int, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Write FILES into `out` (plan.json with the held-out check when one ran); returns plan.json's."""
    from ..builders.trtllm_serve import to_yaml

    out.mkdir(parents=True, exist_ok=True)
    spec = trtllm_spec(plan, drafter)
    lines = [f"dflash-trt plan: {acc.name} acceptance, {cost.source.split(';')[0]}"]
    if spec is None:
        yaml = "".join(f"# {x}\n" for x in [*lines, f"{no_schedule_note(plan)} (no speculative_config)"])
        yaml += to_yaml(TRTLLM_SERVING)
    else:
        lines += trtllm_header(plan, settings.get("step_tokens"))
        if drafter is None:
            lines.append("add speculative_model: the drafter folder (no --drafter was given)")
        body = {"max_batch_size": plan.cells[-1].concurrency, **TRTLLM_SERVING, "speculative_config": spec}
        yaml = "".join(f"# {x}\n" for x in lines) + to_yaml(body)
    vllm = vllm_config(plan, drafter)
    (out / "trtllm-serve.yaml").write_text(yaml)
    (out / "vllm-speculative-config.json").write_text(vllm_json(vllm))
    (out / "vllm-speculative-config-fixed.json").write_text(vllm_json(vllm_fixed(plan, drafter)))
    (out / "vllm-args.txt").write_text(vllm_args(plan, vllm))
    sglang = sglang_args(plan, drafter)
    (out / "sglang-args.txt").write_text(sglang)
    configs = {
        "trtllm": spec,
        "vllm": vllm,
        "vllm_max_num_seqs": plan.cells[-1].concurrency,
        "sglang_drafts": sglang_block(plan)[0] - 1,
    }
    doc = plan_json(plan, acc, cost, settings, configs)
    if drafter is None:
        doc["to_fill"] = TO_FILL
    if held_out is not None:
        doc["held_out"] = held_out_json(held_out)
    (out / "plan.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(plan, out / "plan.png", f"{acc.name} acceptance; {cost.source.split(';')[0]}")
    return doc
