"""CLI: `plan check` (an engine's own metrics against a plan's assumptions; exit 3 when its gain no longer holds) and
`plan check-load` (that check on the demo pair under load, against what the server measured)."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

CHECK_DESCRIPTION = """\
Scrape a serving engine's metrics over a window and check the plan in --plan against them: tau at the drafts
per round the engine ran, per-position acceptance where the engine gives it (vLLM, dflash-trt), the running
batch sizes against the planned concurrencies, and the plan's predicted gain over the target alone at that
batch recomputed at the acceptance seen (at a fixed batch and draft length a round costs the same whatever
the acceptance, so tokens/s scale with tau). It prints which assumptions held, which did not and by how much,
and the draft length per planned concurrency that the acceptance seen would choose.

Exit status: 0 the plan holds; 3 it does not (tau or the gain fell by more than --tolerance, the gain fell to
1x or less, or the batch ran above the planned range); 1 an error (unreachable URL, no speculative round in
the window, or a metric the check reads missing from the engine's: the error names it). The running batch is
judged per engine: each data-parallel engine (vLLM) or scheduler (SGLang) runs its own. Usable from CI or cron;
deploy/k8s/base/prometheusrule.yaml does the same check in a cluster.

Engines and what is read (dflash_trt/plan/metrics.py cites each engine's source):
  vllm        /metrics: vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens /
              _num_accepted_tokens_per_pos, vllm:num_requests_running, vllm:generation_tokens
  sglang      /metrics (--enable-metrics): sglang:spec_accept_length, sglang:spec_num_draft_tokens (or,
              where absent, sglang:spec_accept_rate by the formula its HELP names), sglang:num_running_reqs
              (gauges, averaged over the scrapes: use --samples 5 or more)
  trtllm      trtllm-serve /metrics (enable_iter_perf_stats: true): iteration statistics with
              specDecodingStats; each call drains them, so the first scrape only starts the window
  dflash-trt  this project's server: the vLLM names plus its batch rows and generated tokens

--save FILE writes what the window saw as JSON: `dflash-trt plan --from-metrics FILE` plans from it.

--serve-metrics PORT (with --engine trtllm; no --plan) checks nothing: it runs the exporter sidecar instead,
which polls trtllm-serve's /metrics JSON and serves its totals as Prometheus text under vLLM's names
(vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens, vllm:generation_tokens,
vllm:num_requests_running / _waiting) on PORT's /metrics, so the cluster's rules, the autoscaler and
`plan check --engine vllm --url http://SIDECAR:PORT` read trtllm-serve as they read vLLM. It must be the only
reader of trtllm-serve's /metrics: each read drains the engine's queue (dflash_trt/plan/exporter.py)."""


def register_check(plan_parser: argparse.ArgumentParser) -> None:
    from ..bench import plan_load
    from ..plan.metrics import ENGINES
    from .options import positive_int

    actions = plan_parser.add_subparsers(dest="plan_action", metavar="check|check-load|overlay", required=False)
    c = actions.add_parser(
        "check",
        help="check a plan against an engine's own metrics (exit 3 when its predicted gain no longer holds)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent(CHECK_DESCRIPTION),
    )
    c.add_argument("--engine", required=True, choices=ENGINES, help="the engine serving the plan")
    c.add_argument("--url", required=True, help="the engine's base URL (or its metrics URL), e.g. http://host:8000")
    c.add_argument("--plan", type=Path, default=None, help="the plan's folder (its plan.json) or plan.json")
    c.add_argument("--window", type=float, default=60.0, help="seconds between the first and last scrape (60)")
    c.add_argument("--samples", type=positive_int, default=2, help="scrapes over the window, at least 2 (default 2)")
    c.add_argument(
        "--tolerance", type=float, default=0.1, help="how far tau or the gain may fall below the plan (0.1 = 10 %%)"
    )
    c.add_argument("--save", type=Path, default=None, help="write the window's figures as JSON (for --from-metrics)")
    c.add_argument(
        "--serve-metrics",
        type=int,
        default=None,
        metavar="PORT",
        help="run the exporter sidecar on PORT instead of checking (--engine trtllm; see above)",
    )
    c.add_argument("--host", default="0.0.0.0", help="address the exporter binds (default 0.0.0.0)")
    c.add_argument(
        "--poll", type=float, default=2.0, help="exporter: seconds between polls of trtllm-serve (default 2)"
    )
    c.add_argument(
        "--max-stats-len",
        type=int,
        default=1000,
        metavar="N",
        help="--engine trtllm: the max_stats_len of trtllm-serve's YAML (TensorRT-LLM's default 1000; -1 keeps "
        "every record). An engine that numbers its records (statsSequence, statsDroppedFrames) says exactly what was "
        "dropped or read by another reader; for one that does not, a scrape or exporter poll of max_stats_len + 1 "
        "records, the most its executor keeps, may have lost older ones (reported, and counted by the exporter)",
    )
    c.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help="the API key's file: a check sends it (`Authorization: Bearer KEY`, as the ServiceMonitor does), the "
        "exporter asks every /metrics scrape for it",
    )
    c.set_defaults(func=cmd_check)
    o = actions.add_parser(
        "overlay",
        help="fill a trtllm-serve overlay from a plan: its YAML with the pod's drafter path, its alert thresholds",
        description=(
            "Write trtllm-serve.yaml (the plan's, speculative_model set to the drafter folder as the pod mounts it, "
            "checked against the LLM arguments TensorRT-LLM accepts at the pinned commit) and plan-alerts.env (the "
            "plan's alert thresholds, which the overlay's kustomize replacements read) into an overlay folder, e.g. "
            "deploy/k8s/trtllm-serve. Both are generated, never committed: without them the overlay does not render."
        ),
    )
    o.add_argument("--plan", type=Path, required=True, help="the folder `dflash-trt plan --out` wrote")
    o.add_argument("--out", type=Path, required=True, help="the overlay folder (deploy/k8s/trtllm-serve, ...)")
    o.add_argument(
        "--drafter-path",
        default="/checkpoints/drafter",
        help="the drafter folder inside the pod (/checkpoints/drafter)",
    )
    o.set_defaults(func=cmd_overlay)
    load = actions.add_parser(
        "check-load",
        help="does a plan from a `plan check` scrape predict the server's tokens/s? (the demo pair under aiperf)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=plan_load.__doc__,
    )
    plan_load.add_arguments(load)
    load.set_defaults(func=plan_load.run)


def cmd_overlay(args: argparse.Namespace) -> int:
    from ..plan import overlay
    from .options import CliError

    try:
        paths = overlay.write(args.plan, args.out, args.drafter_path)
    except overlay.OverlayError as e:
        raise CliError(str(e)) from None
    for path in paths:
        print(f"wrote {path}")
    return 0


def cmd_serve_metrics(args: argparse.Namespace) -> int:
    from ..plan import exporter
    from .options import CliError

    if args.engine != "trtllm":
        raise CliError("--serve-metrics exports trtllm-serve's iteration statistics: use it with --engine trtllm")
    if args.plan is not None:
        raise CliError("--serve-metrics checks no plan: leave out --plan (check the sidecar with --engine vllm)")
    if args.poll < 0:
        raise CliError("--poll: seconds, 0 (poll only at scrapes) or more")
    try:
        key = exporter.read_key(args.api_key_file)
    except (OSError, ValueError) as e:
        raise CliError(f"--api-key-file: {e}") from None
    # SIGTERM (the kubelet's stop, scancel's) ends the server and exits 0. A handler is required, not a nicety: as a
    # container's first process (PID 1 of its PID namespace) the default action of SIGTERM is to ignore it, and the
    # pod would wait out its whole grace period for the SIGKILL.
    import signal
    import threading

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    exporter.serve(args.url, args.host, args.serve_metrics, args.poll, key, stop=stop, max_stats_len=args.max_stats_len)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    import json
    import sys

    from ..plan import check, exporter, metrics
    from .options import CliError

    if args.max_stats_len < -1:
        raise CliError("--max-stats-len: trtllm-serve's max_stats_len, -1 or more (llm_args.py: ge=-1)")
    if args.serve_metrics is not None:
        return cmd_serve_metrics(args)
    if args.plan is None:
        raise CliError("--plan is required (the plan to check), unless --serve-metrics runs the exporter")
    path = args.plan / "plan.json" if args.plan.is_dir() else args.plan
    if args.samples < 2:
        raise CliError("--samples: a window needs 2 scrapes at least")
    try:
        key = exporter.read_key(args.api_key_file)
    except (OSError, ValueError) as e:
        raise CliError(f"--api-key-file: {e}") from None
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CliError(f"cannot read the plan {path}: {e}") from None
    if not isinstance(doc, dict):
        raise CliError(f"{path} is not a plan.json (a JSON object)")
    try:
        notice = check.upgrade(doc)
        if notice:  # a plan written before drafted tokens became plan.json's one unit still checks
            print(f"{path}: {notice}", file=sys.stderr)
        check.cells(doc), check.planned_rates(doc)  # a plan the check cannot read fails before the window
        obs = metrics.scrape(
            args.engine,
            args.url,
            args.window,
            args.samples,
            get=lambda u: metrics.fetch(u, key=key),
            max_stats_len=args.max_stats_len,
        )
        report = check.check(doc, obs, args.tolerance)
    except (metrics.MetricsError, check.PlanDocError) as e:
        raise CliError(str(e)) from None
    if args.save is not None:  # the window (what --from-metrics reads) and the verdict (for CI or cron)
        verdict = {"holds": report.holds, "lines": report.lines, "advice": report.advice}
        verdict["drafts_by_concurrency"] = {str(c): k for c, k in report.schedule.items()}
        args.save.write_text(json.dumps({**obs.to_json(), "check": verdict}, indent=1) + "\n")
    print(f"{args.engine} at {obs.url}: {obs.source}")
    print(report.text())
    return check.HOLDS if report.holds else check.FAILS
