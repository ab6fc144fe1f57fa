"""`dflash-trt bench suffix-prior`: how well the suffix proposer's probabilities predict what a target accepts,
held out; and the time a step's suffix work takes.

1. Outputs: a target (default SmolLM2-135M-Instruct, `make models`) continues code (`rewrite` and `in-file`
   prompts, dflash_trt/bench/workloads.py) and prose (paragraphs of the project's docs/, which no model here was
   trained on), greedy, with Hugging Face `generate` (the target alone). Greedy, a drafted token is accepted
   exactly when it is the target's next token, so the output says what every run would have kept.
2. Replay: at every output position, the request's suffix structure over the prompt and the output so far
   proposes its run (no MIN_TOKEN_PROB cut, no length cap: every token the run offers, up to SUFFIX_MAX_RUN);
   each token reached (those before it right) is a record: its context's length and counts, its old prior
   (1 - PRIOR_HALF / (PRIOR_HALF + length + hits - 1), the rule before the counts) and whether it was right.
3. Held out: each kind's texts are split in two; PRIOR_HALF and PRIOR_WEIGHT are fitted (log loss, on a grid)
   on the first half only, and the table compares predicted with observed acceptance by bucket of predicted
   probability on the second half, beside the old prior's buckets on the same tokens.
4. Step time: ROWS rows decode the recorded outputs (each round: the proposer's run, the true tokens committed,
   finished rows' outputs into the shared structure, a request of LONG_PROMPT tokens joining), and the suffix
   work of each step (every row's pick and commit, the shared structure's settle) is timed: p50 / p99 / max.

    dflash-trt bench suffix-prior --target .cache/models/smollm2-135m-instruct
    dflash-trt bench suffix-prior --reuse results/suffix-prior/results.json   # replay without generating
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_trt.decoding import proposers as P
from dflash_trt.decoding.proposers import SUFFIX_MAX_RUN, Prices, RowDrafts, best_run
from dflash_trt.decoding.suffix import SharedSuffixes, SharedWalk, SuffixAutomaton
from dflash_trt.settings import REPO_ROOT

HALVES = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
WEIGHTS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
EDGES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dflash_trt.models.pretrained import MODELS_DIR, SMOLLM2_135M

    p.add_argument("--target", type=Path, default=MODELS_DIR / SMOLLM2_135M.name, help="the target (HF checkpoint)")
    p.add_argument("--texts", type=int, default=12, help="texts of each kind, code and prose (default 12)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per text (default 128)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64], help="rows of the timed steps")
    p.add_argument("--long-prompt", type=int, default=70_000, help="tokens of the long request in the timed steps")
    p.add_argument("--reuse", type=Path, help="a results.json of an earlier run: its outputs, not generated again")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "suffix-prior", help="results folder")


# ---- 1. texts and outputs ---------------------------------------------------------------------------------------
def prose_texts(n: int) -> list[str]:
    """Paragraphs of the project's docs (prose, not code, tables or lists), spread over the files."""
    found = []
    for path in sorted((REPO_ROOT / "docs").glob("*.md")):
        for para in path.read_text(encoding="utf-8").split("\n\n"):
            text = " ".join(para.split())
            code_like = "|" in text or "=" in text or text.count("(") > 6 or "`" in text[:40]
            if len(text) >= 400 and text[0].isalpha() and not code_like:
                found.append(text[:900])
    step = max(1, len(found) // max(1, n))
    return found[::step][:n]


def code_texts(n: int) -> list[str]:
    from dflash_trt.bench.workloads import WORKLOADS

    half = n // 2
    return WORKLOADS["rewrite"](half).prompts + WORKLOADS["in-file"](n - half).prompts


def generate(target: Path, texts: Sequence[str], max_new: int) -> list[dict[str, list[int]]]:
    """Each text's prompt ids and the target's greedy output ids (Hugging Face generate, the target alone)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)  # in eval mode as loaded
    out = []
    for text in texts:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.eos_token_id)
        out.append({"prompt": ids[0].tolist(), "output": gen[0, ids.shape[1] :].tolist()})
    return out


# ---- 2. replay ----------------------------------------------------------------------------------------------------
def records(sample: dict[str, list[int]]) -> list[tuple[int, int, int, int, int]]:
    """(context length, seen, agreed, hits, right) of every run token reached, at every output position."""
    drafts = RowDrafts(SuffixAutomaton())
    drafts.add(sample["prompt"])
    out, found = sample["output"], []
    for i in range(len(out)):
        assert drafts.suffix is not None
        drafts.suffix.settle(None)
        match = drafts.match(SUFFIX_MAX_RUN)
        if match is not None:
            for j, token in enumerate(match.continuation[: len(out) - i]):
                seen, agreed = match.counts[j] if j < len(match.counts) else (0, 0)
                right = int(token == out[i + j])
                found.append((match.length + j, seen, agreed, match.hits, right))
                if not right:
                    break
        drafts.add([out[i]])
    return found


def predicted(rec: tuple[int, int, int, int, int], half: float, weight: float) -> float:
    length, seen, agreed, _, _ = rec
    return P.continuation_prob(seen, agreed, length, half, weight)


def old_prior(rec: tuple[int, int, int, int, int]) -> float:
    """The rule before the counts: one alpha for the run from its match length and recurrences (PRIOR_HALF 4)."""
    length, _, _, hits, _ = rec
    return min(0.95, 1.0 - 4.0 / (4.0 + length + hits - 1))


def log_loss(pairs: Sequence[tuple[float, int]]) -> float:
    eps = 1e-6
    return -sum(math.log(max(eps, p if y else 1 - p)) for p, y in pairs) / max(1, len(pairs))


def fit(recs: Sequence[tuple[int, int, int, int, int]]) -> tuple[float, float]:
    """The (PRIOR_HALF, PRIOR_WEIGHT) of least log loss on `recs`, on the grid."""
    return min(
        ((h, w) for h in HALVES for w in WEIGHTS), key=lambda hw: log_loss([(predicted(r, *hw), r[4]) for r in recs])
    )


def buckets(pairs: Sequence[tuple[float, int]]) -> list[dict[str, Any]]:
    rows = []
    for lo, hi in zip(EDGES, EDGES[1:]):
        inside = [(p, y) for p, y in pairs if lo <= p < hi]
        if inside:
            rows.append(
                {
                    "bucket": f"{lo:.1f}-{min(hi, 1.0):.1f}",
                    "tokens": len(inside),
                    "predicted": round(statistics.fmean(p for p, _ in inside), 3),
                    "observed": round(statistics.fmean(y for _, y in inside), 3),
                }
            )
    return rows


def short_frequent(recs: Sequence[tuple[int, int, int, int, int]], half: float, weight: float) -> dict[str, Any]:
    """The review's case: contexts of <= 2 tokens that recurred 20 times or more."""
    chosen = [r for r in recs if r[0] <= 2 and r[3] >= 20]
    if not chosen:
        return {"tokens": 0}
    return {
        "tokens": len(chosen),
        "old_prior": round(statistics.fmean(old_prior(r) for r in chosen), 3),
        "predicted": round(statistics.fmean(predicted(r, half, weight) for r in chosen), 3),
        "observed": round(statistics.fmean(r[4] for r in chosen), 3),
    }


# ---- 4. step time ---------------------------------------------------------------------------------------------------
def step_times(
    samples: Sequence[dict[str, list[int]]], rows: int, long_prompt: int, steps: int = 300
) -> tuple[list[float], list[float]]:
    """Seconds of suffix work per step for `rows` rows replaying `samples` (their true tokens committed after each
    run), a request of `long_prompt` tokens joining at the 10th step, outputs into the shared structure: wall
    seconds, and the thread's CPU seconds (what the work costs on a machine other processes share)."""
    shared = SharedSuffixes()
    prices = Prices(row_s=1.0, token_s=0.02, draft_s=0.05)
    texts = [s["prompt"] + s["output"] for s in samples]
    long_ids = [t for _ in range(long_prompt // max(1, sum(map(len, texts))) + 1) for text in texts for t in text]
    queue = iter(range(10**9))

    def join(prompt: list[int], output: list[int]) -> dict[str, Any]:
        drafts = RowDrafts(SuffixAutomaton(), SharedWalk(shared))
        drafts.add(prompt)
        return {"drafts": drafts, "truth": output, "at": 0}

    live = [join(samples[k % len(samples)]["prompt"], samples[k % len(samples)]["output"]) for k in range(rows)]
    wall, cpu = [], []
    for step in range(steps):
        if step == 10:
            live[0] = join(long_ids[:long_prompt], samples[0]["output"])
        started, used = time.perf_counter(), time.thread_time()
        for r, row in enumerate(live):
            truth, at = row["truth"], row["at"]
            pick, _ = best_run(row["drafts"], min(SUFFIX_MAX_RUN, len(truth) - at - 1), prices)
            kept = 0
            while kept < len(pick.drafts) and pick.drafts[kept] == truth[at + kept]:
                kept += 1
            new = truth[at : at + kept + 1]
            row["drafts"].add(new)
            row["at"] = at + len(new)
            if row["at"] >= len(truth):
                shared.add(truth)
                k = next(queue)
                live[r] = join(samples[k % len(samples)]["prompt"], samples[k % len(samples)]["output"])
        shared.settle()
        wall.append(time.perf_counter() - started)
        cpu.append(time.thread_time() - used)
    return wall, cpu


def _percentiles(t: list[float]) -> dict[str, float]:
    """p50, p99 and max of sorted seconds, in ms."""
    return {
        "p50_ms": round(1e3 * t[len(t) // 2], 3),
        "p99_ms": round(1e3 * t[min(len(t) - 1, int(0.99 * len(t)))], 3),
        "max_ms": round(1e3 * t[-1], 3),
    }


def run(args: argparse.Namespace) -> int:
    if args.reuse is not None:
        outputs = json.loads(args.reuse.read_text())["outputs"]
    else:
        import torch

        torch.set_num_threads(args.threads)
        outputs = {
            "code": generate(args.target, code_texts(args.texts), args.max_new_tokens),
            "prose": generate(args.target, prose_texts(args.texts), args.max_new_tokens),
        }
    result: dict[str, Any] = {
        "source": "dflash-trt bench suffix-prior",
        "target": str(args.target),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "kinds": {},
        "outputs": outputs,
    }
    lines = []
    for kind, samples in outputs.items():
        half_n = len(samples) // 2
        fitting = [r for s in samples[:half_n] for r in records(s)]
        held = [r for s in samples[half_n:] for r in records(s)]
        h, w = fit(fitting)
        new = [(predicted(r, h, w), r[4]) for r in held]
        old = [(old_prior(r), r[4]) for r in held]
        coded = [(predicted(r, P.PRIOR_HALF, P.PRIOR_WEIGHT), r[4]) for r in held]
        kind_result: dict[str, Any] = {
            "fitting_texts": half_n,
            "held_out_texts": len(samples) - half_n,
            "fitting_tokens": len(fitting),
            "held_out_tokens": len(held),
            "fit": {"prior_half": h, "prior_weight": w},
            "log_loss": {
                "counts_fitted": log_loss(new),
                "counts_as_coded": log_loss(coded),
                "old_prior": log_loss(old),
            },
            "counts_fitted": buckets(new),
            "old_prior": buckets(old),
            "short_frequent": short_frequent(held, h, w),
        }
        result["kinds"][kind] = kind_result
        lines.append(
            f"\n{kind}: fitted on {half_n} texts ({len(fitting)} run tokens), held out {len(samples) - half_n} "
            f"({len(held)} run tokens); fit PRIOR_HALF={h:g} PRIOR_WEIGHT={w:g}"
        )
        lines.append(
            f"log loss held out: counts {log_loss(new):.3f} (as coded {log_loss(coded):.3f}), old prior "
            f"{log_loss(old):.3f}"
        )
        lines.append(
            "| predicted bucket | tokens | counts: predicted | observed || old prior: tokens | predicted | observed |"
        )
        lines.append("|---|---|---|---||---|---|---|")
        old_rows = {b["bucket"]: b for b in kind_result["old_prior"]}
        new_rows = {b["bucket"]: b for b in kind_result["counts_fitted"]}
        for lo, hi in zip(EDGES, EDGES[1:]):
            name = f"{lo:.1f}-{min(hi, 1.0):.1f}"
            n, o = new_rows.get(name), old_rows.get(name)
            left = f"{n['tokens']} | {n['predicted']:.3f} | {n['observed']:.3f}" if n else "0 | - | -"
            right = f"{o['tokens']} | {o['predicted']:.3f} | {o['observed']:.3f}" if o else "0 | - | -"
            lines.append(f"| {name} | {left} || {right} |")
        sf = kind_result["short_frequent"]
        if sf["tokens"]:
            lines.append(
                f"contexts <= 2 tokens recurring >= 20 times: {sf['tokens']} tokens, old prior {sf['old_prior']:.3f}, "
                f"counts {sf['predicted']:.3f}, observed {sf['observed']:.3f}"
            )
    samples = [s for kind in outputs.values() for s in kind]
    timing = {}
    for rows in args.rows:
        measured = step_times(samples, rows, args.long_prompt)
        wall, cpu = sorted(measured[0]), sorted(measured[1])
        timing[str(rows)] = {
            "steps": len(wall),
            **{f"wall_{k}": v for k, v in _percentiles(wall).items()},
            **{f"cpu_{k}": v for k, v in _percentiles(cpu).items()},
        }
        lines.append(f"suffix work per step, {rows} rows (+ a {args.long_prompt}-token request): {timing[str(rows)]}")
    result["step_time"] = timing
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out / 'results.json'}")
    return 0
