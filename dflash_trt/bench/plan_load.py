"""`dflash-trt plan check-load`: does a plan made from a `plan check` scrape predict the server's tokens/s?

1. measures the demo pair's CPU cost model in this process, as `make bench-load` and the server's adaptive policy
   do (`decoding.cost.measure_costs`): out/cost_model.json;
2. runs a reduced `dflash-trt bench load` (one concurrency, T=0, the dflash-b8 server only, no in-process part)
   and, while aiperf loads that server, `dflash-trt plan check --engine dflash-trt --save out/scrape.json`;
3. plans with `--from-metrics out/scrape.json --cost-model out/cost_model.json` at that concurrency (the cost
   model scaled to the steps the scrape saw served: `plan.inputs.served_step_cost`), on the
   prompts' mean token count and bench-load's output length, and compares the plan's tokens/s for the server's
   fixed block 8 (7 drafted tokens, the unit plan.json keys by) with aiperf's output tokens/s: out/summary.json, printed.

    dflash-trt plan check-load --concurrency 16 --out results/load/plan-check
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dflash_trt.settings import REPO_ROOT

DFLASH_TRT = [sys.executable, "-m", "dflash_trt.cli"]  # this interpreter's `dflash-trt`


def measure_cost_model(out: Path) -> Path:
    import torch

    from dflash_trt.decoding.cost import measure_costs
    from dflash_trt.loading import load_decoder
    from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET

    torch.set_num_threads(2)
    dec = load_decoder(DEMO_TARGET, DEMO_DRAFTER)
    assert dec.drafter is not None
    cost = measure_costs(dec.target, dec.drafter, rows=(1, 4, 16), blocks=(1, 4, 8), context=150, repeats=2)
    path = out / "cost_model.json"
    path.write_text(json.dumps({"target": vars(cost.target), "drafter": vars(cost.drafter)}, indent=1) + "\n")
    return path


def scrape_when_busy(url: str, concurrency: int, window: float, save: Path, result: dict[str, Any]) -> None:
    """Wait until the server runs at least 3/4 of `concurrency` rows, then plan check over `window` seconds."""
    import httpx

    while True:
        text = httpx.get(url + "/metrics", timeout=30).text
        m = re.search(r"^dflash_inflight_requests (\S+)$", text, re.M)
        if m and float(m.group(1)) >= 0.75 * concurrency:
            break
        time.sleep(0.5)
    cmd = [*DFLASH_TRT, "plan", "check", "--engine", "dflash-trt", "--url", url]
    cmd += ["--plan", str(save.parent / "any-plan"), "--window", str(window), "--samples", "4", "--save", str(save)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    result["check"] = done.stdout + done.stderr


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--concurrency", type=int, default=16, help="the one concurrency loaded and planned (default 16)")
    ap.add_argument("--window", type=float, default=20.0, help="plan check's window, seconds (default 20)")
    ap.add_argument(
        "--min-requests", type=int, default=480, help="aiperf requests (default 480: a run that outlasts the window)"
    )
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "load" / "plan-check", help="output folder")


def run(args: argparse.Namespace) -> int:
    out, c = args.out, args.concurrency
    out.mkdir(parents=True, exist_ok=True)
    (out / "scrape.json").unlink(missing_ok=True)  # never plan from an earlier run's scrape
    cost = measure_cost_model(out)
    plan = [*DFLASH_TRT, "plan", "--no-progress", "--concurrency", str(c)]
    small = ["--prompt-len", "fixed:64", "--output-len", "fixed:64", "--min-requests", "8"]
    subprocess.run([*plan, "--out", str(out / "any-plan"), *small], check=True, capture_output=True)
    bench = [*DFLASH_TRT, "bench", "load", "--skip-in-process", "--concurrency", str(c)]
    bench += ["--temperatures", "0", "--modes", "dflash-b8", "--load-repeats", "1", "--out", str(out / "load")]
    bench += ["--min-requests", str(args.min_requests)]
    proc = subprocess.Popen(bench, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result: dict[str, Any] = {}
    scraper = None
    log = []
    assert proc.stdout is not None
    for line in proc.stdout:
        log.append(line)
        print(line, end="", flush=True)
        m = re.search(r"server dflash-b8 up in .*: (http://\S+)", line)
        if m and scraper is None:
            scraper = threading.Thread(
                target=scrape_when_busy, args=(m.group(1), c, args.window, out / "scrape.json", result)
            )
            scraper.start()
    proc.wait()
    if scraper is not None:
        scraper.join()
    print(result.get("check", "no scrape"))
    if not (out / "scrape.json").is_file():
        raise SystemExit("plan check saved no scrape (the load ended before its window?): raise --min-requests")
    measured = next(
        x for x in json.loads((out / "load" / "results.json").read_text())["cells"] if x["mode"] == "dflash-b8"
    )
    from dflash_trt.bench.prompts import held_out_code_prompts
    from dflash_trt.models.target import load_tokenizer
    from dflash_trt.settings import DEMO_TARGET

    tok = load_tokenizer(DEMO_TARGET)
    assert tok is not None, "the demo target ships its tokenizer"
    texts = held_out_code_prompts(32)
    mean_prompt = round(sum(len(tok.encode(t, add_special_tokens=False)) for t in texts) / len(texts))
    flags = ["--from-metrics", str(out / "scrape.json"), "--cost-model", str(cost), "--block-size", "8"]
    flags += ["--prompt-len", f"fixed:{mean_prompt}", "--output-len", "fixed:64", "--seeds", "2"]
    subprocess.run([*plan, "--out", str(out / "plan"), *flags], check=True)
    cell = json.loads((out / "plan" / "plan.json").read_text())["cells"][0]
    predicted = cell["tokens_per_s_by_drafts"]["7"]  # block 8: 7 drafts and the anchor
    summary = {
        "concurrency": c,
        "measured_tokens_per_s": measured["tokens_per_s"],
        "predicted_tokens_per_s_7_drafts": predicted,
        "ratio": predicted / measured["tokens_per_s"],
        "scrape": json.loads((out / "scrape.json").read_text()),
        "mean_prompt_tokens": mean_prompt,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "scrape"}, indent=1))
    return 0
