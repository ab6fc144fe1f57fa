"""`dflash-trt bench suffix-trace`: record the suffix proposer's rounds on the demo pair, for the simulator's replay
(dflash_trt/sim/suffix.py).

Runs the `rewrite`, `long` and `bodies` workloads (`dflash_trt/bench/workloads.py`: text no model here was trained
on; `bodies`, plain completions, is the control where little repeats)
through the server's decoder with `proposer="suffix"`, greedy, one request at a time, the shared structure emptied
before each (a request's own matches only), and keeps each request's `--trace` rounds in the compact form the
simulator reads: [drafted, accepted] per round (drafted 0: the proposer offered no run, the target alone; no token
ids: the simulator makes its own tokens). Suffix alone is recorded, not the hybrid: every round then says whether a run was there to take,
which a round the hybrid gave to DFlash would not.

    dflash-trt bench suffix-trace   # writes data/measured/suffix-trace.json

`--target` records another target's rounds (no drafter is loaded: suffix drafting needs none), its chat workloads
(`workloads.CHAT_WORKLOADS`) through its chat template; `--half a|b` takes every other prompt of twice as many, so
that two recordings hold disjoint prompts (one to fit the simulator's prior on, one to replay:
`dflash-trt bench sim --suffix-prior-from`).
"""

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from dflash_trt.decoding import GenerationConfig
from dflash_trt.decoding.proposers import NO_DRAFT_NAME, SuffixProposer
from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET
from dflash_trt.sim.measured import SUFFIX_TRACE
from dflash_trt.sim.suffix import rounds_of


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workloads",
        nargs="+",
        default=["rewrite:6", "long:3", "bodies:4"],
        help="NAME:PROMPTS items (default: %(default)s)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--target", type=Path, default=None, help="target checkpoint (default: the demo pair's)")
    p.add_argument("--half", choices=("a", "b"), default=None, help="every other prompt of twice as many")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens a request (default: the workload's)")
    p.add_argument(
        "--out", type=Path, default=SUFFIX_TRACE, help="the trace written (default: the one the simulator reads)"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from dflash_trt.loading import load_decoder
    from dflash_trt.server.context import ServerSettings, batch_decoder

    torch.set_num_threads(args.threads)
    from dflash_trt.bench.proposers import ALL_WORKLOADS, prompt_ids

    loaded = load_decoder(args.target, None) if args.target else load_decoder(DEMO_TARGET, DEMO_DRAFTER)
    decoder = batch_decoder(loaded, ServerSettings())
    out: dict[str, Any] = {
        "source": f"dflash-trt bench suffix-trace: {args.target or 'the demo pair'}, proposer suffix, greedy, one "
        "request at a time" + (f", prompts of half {args.half}" if args.half else ""),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "format": "per workload, per request: its rounds in order after the prefill's token, [drafted, accepted] each "
        "(drafted 0: no suffix run, the target alone)",
        "workloads": {},
    }
    for item in args.workloads:
        name, _, n = item.partition(":")
        count = int(n or 4)
        w = ALL_WORKLOADS[name](2 * count if args.half else count)
        if args.max_new_tokens:
            w = dataclasses.replace(w, max_new_tokens=args.max_new_tokens)
        picked = range("ab".index(args.half), 2 * count, 2) if args.half else range(count)
        requests = []
        for i in picked:
            label = w.labels[i]
            decoder.forget_finished_outputs()
            ids = prompt_ids(decoder, w, i)
            [res] = decoder.generate(
                [ids], GenerationConfig(max_new_tokens=w.max_new_tokens, proposer=SuffixProposer.name)
            )
            trace = res.stats.trace()
            assert all(r["proposer"] in (SuffixProposer.name, NO_DRAFT_NAME) for r in trace), (
                "a suffix-only run's rounds"
            )
            rounds = rounds_of(trace)
            requests.append({"source": label, "prompt_tokens": len(ids), "rounds": rounds})
            print(name, label, len(res.token_ids), "tokens,", sum(d > 0 for d, _ in rounds), "suffix rounds")
        out["workloads"][name] = {"max_new_tokens": w.max_new_tokens, "sources": w.sources, "requests": requests}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    return 0
