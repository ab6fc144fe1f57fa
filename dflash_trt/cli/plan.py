"""CLI: plan (the best draft length per concurrency, simulated, written as TensorRT-LLM / vLLM / SGLang configs)."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..plan import tune
    from ..plan.inputs import Acceptance, Cost

DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64"

DESCRIPTION = """\
Plan which draft length to serve at which batch size, for a drafter's measured acceptance on a GPU, and write
it for three servers. The serving simulator (dflash_trt/sim: the real batched loop on simulated engines, pass
times from measured GPU profiles) runs every draft length 0..B-1 (0: the target alone; B: the drafter's block,
its drafted tokens and the anchor) at every concurrency, closed loop; the best length per concurrency is the
tuned table, which becomes TensorRT-LLM's draft_len_schedule, and that schedule is simulated again: its figures
are the predictions. Every file counts drafted tokens (the anchor excluded), as TensorRT-LLM's max_draft_len and
vLLM's num_speculative_tokens do; SGLang's --speculative-num-draft-tokens, which counts the anchor, is the one
flag that says drafts + 1, and its file says so.

Into --out it writes trtllm-serve.yaml (trtllm-serve --config: DFlashDecodingConfig with max_draft_len and
draft_len_schedule or max_concurrency; above the schedule's largest key TensorRT-LLM drafts nothing, so plan up
to your largest batch), vllm-speculative-config.json (vllm serve --speculative-config, with
num_speculative_tokens_per_batch_size, no range at 0 drafts; vllm-speculative-config-fixed.json: one length, for
where vLLM drops the schedule; vllm-args.txt: --max-num-seqs at the largest concurrency and that config),
sglang-args.txt (SGLang drafts one length at every batch: the best single length), plan.json (every
figure, every input labelled measured or assumed) and plan.png; it prints the table: per concurrency the tuned
and scheduled drafts, predicted tokens/s, its ratio to the target alone and to the tuned table, TTFT and ITL.

Acceptance: --profile demo (default: the demo pair's tau per code prompt, measured by make bench-load), paper,
mixed or a benchmark name (the paper's published tau, per-position shape assumed); or --trace FILE: the output of
`dflash-trt generate --json --trace` (one or more, JSON or JSON lines) or the server's per-request statistics
("spec_decode_metrics": "detailed"), every round pooled per position; or --from-metrics FILE: what a serving
engine measured (`dflash-trt plan check --save FILE`). Cost: Vidur's profiles (--gpu, --model, --tp; --target DIR
picks the profiled shape nearest its config.json), --cost-grid FILE measured on your GPU by scripts/gpu_bare.py,
or --cost-model FILE, a CPU server's measured cost model (make bench-load). The workload's lengths are assumed
(--prompt-len, --output-len).

Run time: a run costs about its committed rounds. The default (7 concurrencies x 9 runs, 3 x C requests, at
least 24, one seed) is sized to stay short on one core (docs/gpu.md gives a measured time); every --seeds adds
as much again, --check-seed about as much again, and larger concurrencies cost in proportion to C."""


def _ints(text: str) -> list[int]:
    try:
        values = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,4,16, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ..settings import drafter_path
    from .options import positive_int

    p = sub.add_parser(
        "plan",
        help="simulate every draft length at every concurrency; write the best as TensorRT-LLM / vLLM / SGLang configs",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent(DESCRIPTION),
    )
    p.add_argument(
        "--out", type=Path, default=None, help="folder the plan's seven files are written to (created; required)"
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--profile", default="demo", help="named acceptance: demo (default), paper, mixed, a benchmark")
    src.add_argument(
        "--trace", type=Path, default=None, help="measured rounds: generate --json --trace or server stats"
    )
    src.add_argument(
        "--from-metrics",
        type=Path,
        default=None,
        metavar="FILE",
        help="acceptance an engine served with: a `dflash-trt plan check --save FILE` scrape",
    )
    p.add_argument(
        "--drafter",
        type=drafter_path,
        default=None,
        help="drafter folder written into the configs (demo: models/drafter). The plan chooses DFlash draft "
        "lengths: `none` is refused (a target without a drafter has none to plan; `dflash-trt serve --drafter none` "
        "serves it with suffix and ngram drafts)",
    )
    p.add_argument(
        "--block-size",
        type=positive_int,
        default=None,
        help="largest block to plan, in the drafter's unit (drafts + 1: the anchor included), at most 16, the "
        "simulated drafter's (default: the drafter's, capped at 16); the files say drafts (this - 1 at most)",
    )
    _cost_flags(p)
    p.add_argument(
        "--concurrency",
        type=_ints,
        default=_ints(DEFAULT_CONCURRENCY),
        help=f"concurrencies (batch sizes) to plan, comma-separated; TensorRT-LLM's schedule ends at the largest "
        f"(default {DEFAULT_CONCURRENCY})",
    )
    _workload_flags(p)
    p.add_argument(
        "--check-seed",
        type=int,
        default=None,
        help="also re-tune on this seed's requests (not the plan's) at the planned concurrencies and the ones "
        "between them, and report the schedule against each one's best draft length (held_out in plan.json); about as "
        "much time again as one seed's plan, more where the added concurrencies are large",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_plan)
    from .plan_check import register_check

    register_check(p)


def _workload_flags(p: argparse.ArgumentParser) -> None:
    """The simulated requests: how many a run, how many request sets, their lengths (assumed)."""
    from .options import positive_int

    p.add_argument("--requests-per-row", type=positive_int, default=3, help="requests per run: this x C (default 3)")
    p.add_argument("--min-requests", type=positive_int, default=24, help="requests per run at least (default 24)")
    p.add_argument("--seeds", type=positive_int, default=1, help="request sets per run, averaged (default 1)")
    p.add_argument(
        "--prompt-len", default="lognormal:512,0.6,32-4096", help="prompt lengths (fixed:N, uniform:A-B, lognormal:...)"
    )
    p.add_argument("--output-len", default="lognormal:192,0.5,32-1024", help="output lengths, same forms")


def _cost_flags(p: argparse.ArgumentParser) -> None:
    """The pass-cost inputs: a Vidur profile, a measured GPU grid, or a CPU server's own cost model."""
    from ..sim.profiles import GPUS, MODELS
    from .options import positive_int

    p.add_argument("--gpu", default="a100", help=f"Vidur GPU profile: {', '.join(sorted(GPUS))} (default a100)")
    p.add_argument(
        "--model",
        default=None,
        help=f"Vidur model profile: {', '.join(MODELS)} where --gpu has one (default: the shape nearest "
        "--target, else the first profiled on --gpu)",
    )
    p.add_argument(
        "--tp", type=positive_int, default=1, help="tensor-parallel size the Vidur profile is priced at (default 1)"
    )
    p.add_argument(
        "--target", type=Path, default=None, help="target folder: its shape picks the profile, checks a grid"
    )
    p.add_argument("--cost-grid", type=Path, default=None, help="cost_grid.json from scripts/gpu_bare.py (measured)")
    p.add_argument(
        "--cost-model",
        type=Path,
        default=None,
        help="a CPU server's measured cost model (make bench-load's results.json, in_process.cost_model), priced "
        "in that server's step budget (--step-tokens); with --from-metrics of that server, scaled to the steps it "
        "served (their wall time over its passes': the loop's, HTTP's and the client's share the grid never sees)",
    )
    p.add_argument(
        "--step-tokens", type=positive_int, default=None, help="with --cost-model: the server's --step-tokens"
    )
    p.add_argument(
        "--context", type=positive_int, default=None, help="the grid's context length to use (default: largest)"
    )


def _trained_block(drafter: Path) -> int:
    """The drafter folder's block as the YAML written from it states it (trtllm-serve-config's max_draft_len + 1,
    read where TensorRT-LLM reads it); a folder that would not load is refused here, before the simulation."""
    from ..builders.trtllm_serve import ServeConfigError, serve_config
    from ..plan.inputs import PlanInputError

    try:
        return int(serve_config(drafter)["speculative_config"]["max_draft_len"]) + 1
    except (ServeConfigError, FileNotFoundError) as e:
        raise PlanInputError(str(e)) from None


def _inputs(args: argparse.Namespace) -> tuple[Acceptance, Cost, Path | None, int]:
    """(acceptance, cost, drafter folder, largest block to plan) from the flags."""
    from ..plan import inputs
    from ..settings import DEMO_DRAFTER, NO_DRAFTER
    from .options import CliError

    if args.drafter == NO_DRAFTER:
        raise CliError(
            "--drafter none: the plan chooses DFlash draft lengths per batch size, and a target without a drafter "
            "has none to choose; serve it with `dflash-trt serve --target DIR --drafter none` (suffix and ngram "
            "drafts, priced per round by the server itself)"
        )
    drafter = args.drafter
    if drafter is None and args.trace is None and args.from_metrics is None and args.profile == "demo":
        drafter = DEMO_DRAFTER
    trained = _trained_block(drafter) if drafter is not None else None
    if args.block_size is not None and args.block_size > inputs.MAX_POSITIONS + 1:
        raise inputs.PlanInputError(
            f"--block-size {args.block_size}: the simulated drafter drafts at most {inputs.MAX_POSITIONS} tokens "
            f"(block {inputs.MAX_POSITIONS + 1})"
        )
    if args.block_size is not None and trained is not None and args.block_size > trained:
        raise inputs.PlanInputError(
            f"--block-size {args.block_size}: the drafter {drafter} drafts blocks of {trained}; plan up to that or less"
        )
    block = args.block_size or trained
    if args.trace:
        acc = inputs.read_trace(args.trace, block)
    elif args.from_metrics:
        acc = inputs.metrics_acceptance(args.from_metrics, block)
    else:
        acc = inputs.named_acceptance(args.profile)
    target_config = None
    if args.target is not None:
        from ..costgrid import CostGridMismatch, read_target_config

        try:
            target_config = read_target_config(args.target)
        except CostGridMismatch as e:
            raise inputs.PlanInputError(str(e)) from None
    if args.cost_model is not None:
        cost = inputs.cost_model(args.cost_model, args.step_tokens)
        if args.from_metrics:  # a dflash-trt server's scrape: its served steps scale the passes' costs
            cost = inputs.served_step_cost(cost, args.from_metrics)
    elif args.cost_grid is not None:
        cost = inputs.grid_cost(args.cost_grid, args.context, target_config, args.tp)
    else:
        cost = inputs.vidur_cost(args.gpu, args.model, args.tp, target_config)
    return acc, cost, drafter, min(block or acc.block_size, inputs.MAX_POSITIONS + 1)


def cmd_plan(args: argparse.Namespace) -> int:

    import torch

    from ..plan import outputs, tune
    from ..plan.inputs import PlanInputError
    from ..sim.policies import sim_step_tokens
    from ..sim.serving import Workload, length_sampler
    from .options import CliError

    if args.out is None:
        raise CliError("--out is required (the folder the plan is written to)")
    torch.set_num_threads(1)  # the simulated engines' tensors are tiny; one core is faster and shares the machine
    try:
        acc, cost, drafter, block = _inputs(args)
        length_sampler(args.prompt_len), length_sampler(args.output_len)
    except (PlanInputError, ValueError) as e:
        raise CliError(str(e)) from None
    work = Workload(acc.name, acc.profiles, (1.0,) * len(acc.profiles), args.prompt_len, args.output_len)

    def requests(c: int) -> int:
        return tune.requests_for(c, args.min_requests, args.requests_per_row)

    budget = getattr(cost.cost, "step_tokens", None) or sim_step_tokens(cost.cost)
    result = tune.plan(cost.cost, work, block, args.concurrency, requests, range(args.seeds), not args.no_progress)
    settings = {
        "concurrency": args.concurrency,
        "requests": {str(c): requests(c) for c in args.concurrency},
        "seeds": args.seeds,
        "max_drafts": block - 1,
        "workload": (
            f"prompts {args.prompt_len}, outputs {args.output_len}, closed loop, greedy; prompts enter in chunks "
            f"of at most {budget} tokens a step ("
            + ("the CPU server's --step-tokens" if args.cost_model else "vLLM's default for the GPU")
            + ")"
        ),
        "step_tokens": budget,
    }
    held_out = None
    if args.check_seed is not None:
        between = [round((a * b) ** 0.5) for a, b in zip(args.concurrency, args.concurrency[1:])]
        checked = sorted(set(args.concurrency) | {c for c in between if c not in args.concurrency})
        held_out = tune.holdout(result, cost.cost, work, args.check_seed, checked, requests, not args.no_progress)
    try:
        doc = outputs.write(result, acc, cost, settings, args.out, drafter, held_out)
    except ImportError as e:
        raise CliError(f"plan.png needs matplotlib ({e}); pip install matplotlib") from None
    print(f"acceptance: {acc.source}\ncost: {cost.source}\nworkload (assumed): {settings['workload']}")
    print(outputs.table(result))
    worst = min(result.cells, key=lambda c: c.ratio)
    print(
        f"schedule vs tuned table: worst {worst.ratio:.4f} at C={worst.concurrency}; wrote {', '.join(outputs.FILES)} to {args.out}"
    )
    _print_after(result, doc, args, held_out, drafter)
    return 0


def _print_after(
    result: tune.Plan, doc: dict[str, Any], args: argparse.Namespace, held_out: Any, drafter: Path | None
) -> None:
    """What the plan's files need beside them: alert thresholds, the held-out check, the schedule, the notes."""
    import sys

    from ..plan import outputs

    print(
        f"alert thresholds (deploy/k8s/base/prometheusrule.yaml): tau below {doc['alerts']['tau_floor']}, "
        f"running batch above {doc['alerts']['batch_above']}; check a serving engine with `dflash-trt plan check`"
    )
    if held_out:
        c_min = min(held_out, key=lambda c: held_out[c]["ratio"])
        print(
            f"held out (seed {args.check_seed}, {len(held_out)} concurrencies): schedule vs best draft length worst "
            f"{held_out[c_min]['ratio']:.4f} at C={c_min}"
        )
    if result.limits is not None:  # the YAML's schedule, as docs/gpu.md quotes it
        print(f"trtllm-serve.yaml: {', '.join(f'{k}: {v}' for k, v in result.limits.items())} (drafts)")
    for note in outputs.VLLM_NOTES:
        print(f"vllm-speculative-config.json: {note}")
    if result.limits is None:  # vLLM's ranges are floored at 1 draft (outputs.vllm_ranges): say where 0 was best
        print(
            "vllm-speculative-config.json: the target alone is best at the smallest planned concurrency and no range "
            "drafts 0 (floored at 1): where drafting does not pay, serve without --speculative-config",
            file=sys.stderr,
        )
    if drafter is None:
        print("no --drafter: fill in the drafter folder at " + "; ".join(outputs.TO_FILL) + " (plan.json to_fill)")
    if result.limits is None:
        print(f"trtllm-serve.yaml: {outputs.no_schedule_note(result)}", file=sys.stderr)
