"""`dflash-trt bench suffix-prior`: how well the suffix proposer's probabilities predict what a target accepts,
held out; and the time a step's suffix work takes.

1. Outputs: a target (default SmolLM2-135M-Instruct, `make models`) answers chat requests (its chat template)
   about code (`rewrite` and `in-file` prompts, dflash_trt/bench/workloads.py: "complete the last function") and
   prose (paragraphs of the project's docs/, which no model here was trained on: "say it in plainer words"),
   greedy, with Hugging Face `generate` (the target alone). A chat request, not a bare continuation: a small
   instruct model continuing a bare paragraph loops on its own sentences, which measures the loop, not the
   proposer. Greedy, a drafted token is accepted exactly when it is the target's next token, so the output says
   what every run would have kept.
2. Replay: at every output position, the request's suffix structure over the prompt and the output so far
   proposes its run (no MIN_TOKEN_PROB cut, no length cap: every token the run offers, up to SUFFIX_MAX_RUN);
   each token reached (those before it right) is a record: its context's length and counts, its old prior
   (1 - PRIOR_HALF / (PRIOR_HALF + length + hits - 1), the rule before the counts) and whether it was right.
3. Held out: each kind's texts are split in two. PRIOR_HALF, PRIOR_WEIGHT and MAX_PRIOR are fitted (log loss,
   on a grid) on the first halves of both kinds together: what proposers.py codes is meant to be that fit. The
   table compares predicted with observed acceptance by bucket of predicted probability on the second halves,
   for the constants as coded, beside the old prior's buckets on the same tokens; the fit and its held-out log
   loss are printed beside, so a coded constant that drifted from the fit shows.
4. Step time: ROWS rows decode the recorded outputs (each round: the proposer's run, the true tokens committed,
   finished rows' outputs into the shared structure, a request of LONG_PROMPT tokens joining), and the suffix
   work of each step (every row's pick and commit, the shared structure's settle) is timed: p50 / p99 / max.

    dflash-trt bench suffix-prior --target .cache/models/smollm2-135m-instruct
    dflash-trt bench suffix-prior --reuse results/suffix-prior/results.json   # replay without generating
"""

from __future__ import annotations

import argparse
import gc
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
from dflash_trt.decoding.suffix import SharedSuffixes, SharedWalk, StepBudget, SuffixAutomaton
from dflash_trt.settings import REPO_ROOT

# a run token reached in the replay: (context length, seen, agreed, the match's hits, right, its place in the run)
Record = tuple[int, int, int, int, int, int]
HALVES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
WEIGHTS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
CAPS = (0.9, 0.95, 0.98, 0.99, 0.995)
# what each kind's request asks of the text (a chat request to an instruct model)
ASK = {
    "code": "Complete the last function of this code. Answer with the code only.\n\n{text}",
    "prose": "Say this paragraph again in plainer words.\n\n{text}",
}
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


def generate(target: Path, texts: Sequence[str], ask: str, max_new: int) -> list[dict[str, list[int]]]:
    """Each text's prompt ids (the request `ask` holding the text, through the target's chat template) and the
    target's greedy output ids (Hugging Face generate, the target alone)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)  # in eval mode as loaded
    out = []
    for text in texts:
        messages = [{"role": "user", "content": ask.format(text=text)}]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.eos_token_id)
        out.append({"prompt": ids[0].tolist(), "output": gen[0, ids.shape[1] :].tolist()})
    return out


# ---- 2. replay ----------------------------------------------------------------------------------------------------
def records(sample: dict[str, list[int]]) -> list[Record]:
    """The `Record` of every run token reached, at every output position."""
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
                found.append((match.length + j, seen, agreed, match.hits, right, j))
                if not right:
                    break
        drafts.add([out[i]])
    return found


def predicted(rec: Record, half: float, weight: float, cap: float) -> float:
    length, seen, agreed = rec[:3]
    return P.continuation_prob(seen, agreed, length, half, weight, cap)


CODED = (P.PRIOR_HALF, P.PRIOR_WEIGHT, P.MAX_PRIOR)


def old_prior(rec: Record) -> float:
    """The rule before the counts: one alpha for the run from its match length and recurrences (PRIOR_HALF 4)."""
    length, hits = rec[0], rec[3]
    return min(0.95, 1.0 - 4.0 / (4.0 + length + hits - 1))


def log_loss(pairs: Sequence[tuple[float, int]]) -> float:
    eps = 1e-6
    return -sum(math.log(max(eps, p if y else 1 - p)) for p, y in pairs) / max(1, len(pairs))


def fit(recs: Sequence[Record]) -> tuple[float, float, float]:
    """The (PRIOR_HALF, PRIOR_WEIGHT, MAX_PRIOR) of least log loss on `recs`, on the grid."""
    grid = [(h, w, c) for h in HALVES for w in WEIGHTS for c in CAPS]
    return min(grid, key=lambda hwc: log_loss([(predicted(r, *hwc), r[4]) for r in recs]))


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


def by_match_length(recs: Sequence[Record]) -> list[dict[str, Any]]:
    """A run's first token by its match's length (what MIN_MATCH cuts): tokens and the share right, for every
    match and for matches whose context recurred 20 times or more (the review's frequent short contexts)."""
    rows = []
    for lo, hi in ((1, 1), (2, 2), (3, 3), (4, 7), (8, 10**9)):
        first = [r for r in recs if r[5] == 0 and lo <= r[0] <= hi]
        frequent = [r for r in first if r[3] >= 20]
        rows.append(
            {
                "match_length": str(lo) if lo == hi else f"{lo}+" if hi > 1000 else f"{lo}-{hi}",
                "tokens": len(first),
                "observed": round(statistics.fmean(r[4] for r in first), 3) if first else None,
                "frequent_tokens": len(frequent),
                "frequent_observed": round(statistics.fmean(r[4] for r in frequent), 3) if frequent else None,
            }
        )
    return rows


def short_frequent(recs: Sequence[Record], *coded: float) -> dict[str, Any]:
    """The review's case: contexts of <= 2 tokens that recurred 20 times or more."""
    chosen = [r for r in recs if r[0] <= 2 and r[3] >= 20]
    if not chosen:
        return {"tokens": 0}
    return {
        "tokens": len(chosen),
        "old_prior": round(statistics.fmean(old_prior(r) for r in chosen), 3),
        "predicted": round(statistics.fmean(predicted(r, *coded) for r in chosen), 3),
        "observed": round(statistics.fmean(r[4] for r in chosen), 3),
    }


# ---- 4. step time ---------------------------------------------------------------------------------------------------
def step_times(
    samples: Sequence[dict[str, list[int]]], rows: int, long_prompt: int, steps: int = 300
) -> tuple[list[float], list[float]]:
    """Seconds of suffix work per step for `rows` rows replaying `samples` (their true tokens committed after each
    run), a request of `long_prompt` tokens joining at the 10th step, outputs into the shared structure, the rows'
    intake bounded per step as the loop bounds it (`StepBudget`): wall
    seconds, and the thread's CPU seconds (what the work costs on a machine other processes share)."""
    shared, budget = SharedSuffixes(), StepBudget()
    prices = Prices(row_s=1.0, token_s=0.02, draft_s=0.05)
    texts = [s["prompt"] + s["output"] for s in samples]
    long_ids = [t for _ in range(long_prompt // max(1, sum(map(len, texts))) + 1) for text in texts for t in text]
    queue = iter(range(10**9))

    def join(prompt: list[int], output: list[int]) -> dict[str, Any]:
        drafts = RowDrafts(SuffixAutomaton(), SharedWalk(shared), budget=budget)
        drafts.add(prompt)
        return {"drafts": drafts, "truth": output, "at": 0}

    live = [join(samples[k % len(samples)]["prompt"], samples[k % len(samples)]["output"]) for k in range(rows)]
    wall, cpu = [], []
    gc.collect()
    gc.freeze()  # as `serve` freezes its start-up heap (server.serving.freeze_heap), thawed below
    try:
        for step in range(steps):
            if step == 10:
                live[0] = join(long_ids[:long_prompt], samples[0]["output"])
            started, used = time.perf_counter(), time.thread_time()
            budget.renew()  # as the loop does at the start of each step
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
    finally:
        gc.unfreeze()
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
            "code": generate(args.target, code_texts(args.texts), ASK["code"], args.max_new_tokens),
            "prose": generate(args.target, prose_texts(args.texts), ASK["prose"], args.max_new_tokens),
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
    fitting = {kind: [r for s in samples[: len(samples) // 2] for r in records(s)] for kind, samples in outputs.items()}
    held = {kind: [r for s in samples[len(samples) // 2 :] for r in records(s)] for kind, samples in outputs.items()}
    fitted = fit([r for recs in fitting.values() for r in recs])
    result["fit"] = dict(zip(("prior_half", "prior_weight", "max_prior"), fitted))
    result["coded"] = dict(zip(("prior_half", "prior_weight", "max_prior"), CODED))
    lines.append(
        f"fit on the first halves ({sum(map(len, fitting.values()))} run tokens): PRIOR_HALF={fitted[0]:g} "
        f"PRIOR_WEIGHT={fitted[1]:g} MAX_PRIOR={fitted[2]:g}; coded: PRIOR_HALF={CODED[0]:g} "
        f"PRIOR_WEIGHT={CODED[1]:g} MAX_PRIOR={CODED[2]:g}"
    )
    for kind, samples in outputs.items():
        recs = held[kind]
        coded = [(predicted(r, *CODED), r[4]) for r in recs]
        old = [(old_prior(r), r[4]) for r in recs]
        kind_result: dict[str, Any] = {
            "fitting_texts": len(samples) // 2,
            "held_out_texts": len(samples) - len(samples) // 2,
            "fitting_tokens": len(fitting[kind]),
            "held_out_tokens": len(recs),
            "observed": round(statistics.fmean(r[4] for r in recs), 3) if recs else None,
            "log_loss": {
                "counts_as_coded": round(log_loss(coded), 4),
                "counts_fitted": round(log_loss([(predicted(r, *fitted), r[4]) for r in recs]), 4),
                "old_prior": round(log_loss(old), 4),
            },
            "counts_as_coded": buckets(coded),
            "old_prior": buckets(old),
            "short_frequent": short_frequent(recs, *CODED),
            "by_match_length": by_match_length(recs),
        }
        result["kinds"][kind] = kind_result
        loss = kind_result["log_loss"]
        lines.append(
            f"\n{kind}, held out: {kind_result['held_out_texts']} texts, {len(recs)} run tokens reached, "
            f"{kind_result['observed']} of them right; log loss: counts as coded {loss['counts_as_coded']:.3f} "
            f"(as fitted {loss['counts_fitted']:.3f}), old prior {loss['old_prior']:.3f}"
        )
        lines.append(
            "| predicted bucket | counts: tokens | predicted | observed || old prior: tokens | predicted | observed |"
        )
        lines.append("|---|---|---|---||---|---|---|")
        old_rows = {b["bucket"]: b for b in kind_result["old_prior"]}
        new_rows = {b["bucket"]: b for b in kind_result["counts_as_coded"]}
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
        lines.append(
            "a run's first token by match length: "
            + ", ".join(
                f"{b['match_length']}: {b['observed']} of {b['tokens']} (recurring >= 20: {b['frequent_observed']} of "
                f"{b['frequent_tokens']})"
                for b in kind_result["by_match_length"]
            )
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
