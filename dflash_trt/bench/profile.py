"""Where one DFlash round's time goes: target verify, drafter, acceptance and rollback, the loop's Python.

Each round reports its own timings (decoding.RoundTimings: the drafter pass, the target pass, acceptance
with the rollback, the whole step); the loop runs as it does everywhere (one request, a batch of one). A
second, cProfile'd generation lists the functions with the most own time (cProfile slows Python-heavy code,
so its absolute numbers are inflated; the buckets come from the timed run).
"""

from __future__ import annotations

import cProfile
import json
import pstats
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..decoding import BatchDecoder, GenerationConfig

BUCKETS = (
    ("target", "target verify: the target session's forward (every layer, the lm_head, the features)"),
    ("drafter", "drafter: the drafter session's pass (embedding, layers, lm_head, argmax) and the proposal"),
    ("acceptance", "sampling / acceptance (argmax compare or rejection sampling) and the target's rollback"),
    ("loop_overhead", "the loop's own Python (block sizes, block tensors, commit, stop check, stats)"),
)


def profile_generation(decoder: BatchDecoder, prompt_ids: list[int], config: GenerationConfig) -> dict[str, Any]:
    """Run one generation, timing every part of each round; per-round mean ms per bucket."""
    rounds: list[dict[str, Any]] = []
    prefill_ms: float | None = None
    generated = 0
    t0 = time.perf_counter()
    for r in decoder.stream(prompt_ids, config):
        total = time.perf_counter() - t0
        generated += len(r.token_ids)
        if r.prefill:
            prefill_ms = total * 1e3
        else:
            t = r.timings
            rounds.append(
                {
                    "target": t.target_s,
                    "drafter": t.draft_s,
                    "acceptance": t.accept_s,
                    "loop_overhead": max(0.0, total - t.target_s - t.draft_s - t.accept_s),
                    "total": total,
                    "tokens": len(r.token_ids),
                }
            )
        t0 = time.perf_counter()
    n = len(rounds)
    per_round = {k: 1e3 * sum(r[k] for r in rounds) / n for k, _ in BUCKETS}
    total_ms = 1e3 * sum(r["total"] for r in rounds) / n
    return {
        "rounds": n,
        "new_tokens": generated,
        "tau": sum(r["tokens"] for r in rounds) / n,
        "prefill_ms": prefill_ms,
        "round_ms": total_ms,
        "round_ms_median": 1e3 * statistics.median(r["total"] for r in rounds),
        "per_round_ms": {k: round(v, 4) for k, v in per_round.items()},
        "share": {k: round(v / total_ms, 4) for k, v in per_round.items()},
        "tokens_per_s": generated / (sum(r["total"] for r in rounds) + (prefill_ms or 0) / 1e3),
    }


def cprofile_top(
    decoder: BatchDecoder, prompt_ids: list[int], config: GenerationConfig, n: int = 15
) -> list[dict[str, Any]]:
    prof = cProfile.Profile()
    prof.enable()
    decoder.generate([prompt_ids], config)
    prof.disable()
    stats = pstats.Stats(prof)
    rows: list[dict[str, Any]] = []
    # Stats.stats (func -> (cc, nc, tt, ct, callers)) is real but left out of typeshed's stub
    table: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = getattr(stats, "stats")
    for (file, line, func), (cc, nc, tt, ct, callers) in table.items():
        rows.append(
            {
                "function": f"{Path(file).name}:{line}({func})",
                "calls": nc,
                "own_ms": tt * 1e3,
                "cumulative_ms": ct * 1e3,
            }
        )
    rows.sort(key=lambda r: -r["own_ms"])
    return [{**r, "own_ms": round(r["own_ms"], 2), "cumulative_ms": round(r["cumulative_ms"], 2)} for r in rows[:n]]


def profile_rounds(
    target_dir: str | Path,
    drafter_dir: str | Path,
    out: Path,
    max_new: int,
    threads: int | None,
    block_sizes: Sequence[int],
    dtype: str = "float32",
    device: str = "cpu",
) -> dict[str, Any]:
    from ..decoding import GenerationConfig
    from ..loading import load_decoder
    from .prompts import held_out_code_prompts

    if threads:
        torch.set_num_threads(threads)
    from .methods import target_model

    decoder = load_decoder(target_dir, drafter_dir, dtype, device)
    target_model(decoder).generation_config.eos_token_id = None
    assert decoder.drafter is not None  # loaded with a drafter folder
    trained = decoder.drafter.block_size
    usable = [b for b in block_sizes if 2 <= b <= trained]
    block = max(usable) if usable else trained
    prompt = decoder.encode(held_out_code_prompts(1)[0])
    cfg = GenerationConfig(max_new_tokens=max_new, block_size=block)
    base_cfg = GenerationConfig(max_new_tokens=max_new, block_size=1)
    decoder.generate([prompt], cfg)  # warm-up
    dflash = profile_generation(decoder, prompt, cfg)
    baseline = profile_generation(decoder, prompt, base_cfg)
    result = {
        "target": str(target_dir),
        "drafter": str(drafter_dir),
        "block_size": block,
        "trained_block_size": trained,
        "prompt_tokens": len(prompt),
        "max_new_tokens": max_new,
        "torch_threads": torch.get_num_threads(),
        "buckets": dict(BUCKETS),
        "dflash": dflash,
        "baseline": baseline,
        "cprofile_top_own_time": cprofile_top(decoder, prompt, cfg),
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(result, indent=1) + "\n")
    result["path"] = str(out / "profile.json")
    return result


def print_profile(p: dict[str, Any]) -> None:
    d, b = p["dflash"], p["baseline"]
    print(
        f"DFlash round profile: block {p['block_size']} (trained {p['trained_block_size']}), "
        f"{p['prompt_tokens']}-token prompt, {d['new_tokens']} new tokens, {p['torch_threads']} torch threads"
    )
    print(
        f"DFlash: {d['rounds']} rounds, tau {d['tau']:.2f}, {d['round_ms']:.2f} ms/round (median "
        f"{d['round_ms_median']:.2f}), prefill {d['prefill_ms']:.1f} ms, {d['tokens_per_s']:.1f} tok/s"
    )
    print(f"target alone (same loop, block 1): {b['round_ms']:.2f} ms/step, {b['tokens_per_s']:.1f} tok/s\n")
    print("| bucket | DFlash ms/round | share | baseline ms/step | share |\n|---|---|---|---|---|")
    for key, label in BUCKETS:
        print(
            f"| {label} | {d['per_round_ms'][key]:.3f} | {100 * d['share'][key]:.1f}% | "
            f"{b['per_round_ms'][key]:.3f} | {100 * b['share'][key]:.1f}% |"
        )
    print("\ncProfile, most own time (inflated by profiling; see buckets above for real shares):")
    for r in p["cprofile_top_own_time"][:10]:
        print(f"  {r['own_ms']:9.1f} ms  {r['calls']:6d} calls  {r['function']}")
    print(f"\nwrote {p['path']}")
