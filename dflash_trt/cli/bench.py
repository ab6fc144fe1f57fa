"""`dflash-trt bench`: DFlash against the target alone and the classic speculative-decoding peers; and, as actions
under it, the project's other benchmarks (`dflash-trt bench ACTION --help`): the serving simulation, aiperf load and
serve runs, the soak, a round's parts, the proposers side by side, prefill stalls, a multi-turn session, and the two
steps that make a run an input of the code (suffix-trace, measured-inputs). Each action's module in dflash_trt/bench/
has `add_arguments(parser)` and `run(args) -> exit status`; its docstring is its --help."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

# Flags whose default depends on --smoke (argparse default None = "not given").
DEFAULTS = dict(
    prompts_per_set=3,
    long_prompts_per_set=1,
    max_new_tokens=[128, 512],
    block_sizes=[4, 8, 16],
    repeats=1,
    timing_reps=20,
    prompt_sets=None,  # every set (cmd_bench fills it from PROMPT_SETS)
)
# A smoke run's targets may be tiny, with short contexts: only the sets of short prompts (in-file's run to
# thousands of tokens)
SMOKE = dict(
    prompts_per_set=1,
    long_prompts_per_set=1,
    max_new_tokens=[16],
    block_sizes=[2, 4],
    repeats=1,
    timing_reps=3,
    prompt_sets=["code", "repetitive", "free"],
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .options import add_device_args

    p = sub.add_parser(
        "bench",
        help="benchmark DFlash against the target alone, HF generate, assisted generation and prompt lookup",
        description="Measure, on the same target, prompts and settings, in one run with interleaved repetitions: "
        "the target alone (our loop, block size 1; the baseline), Hugging Face generate(), DFlash with the "
        "PyTorch and the ONNX Runtime drafter at several block sizes, HF assisted generation with a small "
        "autoregressive draft model, and HF prompt-lookup decoding. Reports tokens/s, speedup over the baseline "
        "(median of per-prompt ratios, min-max), mean acceptance length, target/draft/other time split, peak "
        "memory and the theoretical ceiling; checks greedy outputs equal the baseline's (exit 1 on a mismatch). "
        "Writes a Markdown table to stdout, results.json and PNG plots to --out.",
    )
    _model_args(p)
    _workload_args(p)
    add_device_args(p)
    _peer_args(p)
    _run_args(p)
    p.set_defaults(func=cmd_bench)
    _register_actions(p)


def _register_actions(bench: argparse.ArgumentParser) -> None:
    """The benchmarks that are not the method comparison, as optional actions: `dflash-trt bench` alone stays the
    comparison, `dflash-trt bench ACTION` runs the action (whose own flags follow its name)."""
    from ..bench import (
        forced,
        grammar_libs,
        load,
        parts,
        prefill,
        proposers,
        serve,
        session,
        soak,
        structured,
        suffix_prior,
        suffix_trace,
    )
    from . import bench_sim
    from .options import add_model_args

    # the actions that measure a target and drafter take them as every command does (options.add_model_args)
    measure_a_pair = (load, serve, soak, parts, proposers)
    modules: dict[str, tuple[ActionModule, str]] = {  # action -> (its module, its --help line)
        "load": (
            load,
            "aiperf against the server at several concurrencies, beside HF batched generate() (make bench-load)",
        ),
        "serve": (
            serve,
            "a short aiperf run against `dflash-trt serve`, as a new user would measure it (make bench-serve)",
        ),
        "soak": (soak, "thousands of requests in waves: fails unless the server's memory stays flat (make bench-soak)"),
        "parts": (
            parts,
            "a round's parts timed beside z-lab's reference; the loop's host work per step (make bench-parts)",
        ),
        "proposers": (proposers, "the target alone, DFlash, suffix, the hybrid and prompt lookup side by side"),
        "prefill": (prefill, "chunked against separate prefill on two servers: the stall a long prompt causes"),
        "session": (session, "a multi-turn session through servers of several proposers, outputs compared"),
        "suffix-trace": (suffix_trace, "record the suffix proposer's rounds on the demo pair, for the simulator"),
        "suffix-prior": (
            suffix_prior,
            "the suffix proposer's predicted against observed acceptance, held out; a step's suffix work timed",
        ),
        "structured": (structured, "JSON-schema-constrained requests through the server, each output validated"),
        "forced": (forced, "structured outputs with and without drafting the tokens their grammar forces"),
        "grammar-libs": (grammar_libs, "llguidance and xgrammar: install size, schema compile and mask times"),
    }
    actions = bench.add_subparsers(
        dest="bench_action",
        metavar="ACTION",
        required=False,
        title="other benchmarks (dflash-trt bench ACTION --help)",
    )
    sim = actions.add_parser(
        "sim",
        help="serving simulated from measured GPU profiles: the real loop and block-size policies (make bench-sim)",
        description=bench_sim.ABOUT,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    bench_sim.add_arguments(sim)
    sim.set_defaults(func=_own_arguments(sim, functools.partial(bench_sim.cmd_sim, sim)))
    for name, (module, help_line) in modules.items():
        a = actions.add_parser(
            name, help=help_line, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        if module in measure_a_pair:
            add_model_args(a, dtype=False, none_for=getattr(module, "NO_DRAFTER_MEANS", ""))
        module.add_arguments(a)
        a.set_defaults(func=_own_arguments(a, module.run))
    m = actions.add_parser(
        "measured-inputs",
        help="copy the sections of a benchmark's results.json the package reads into data/measured/",
        description="Make a benchmark's run an input of the code: copy the sections of its results.json that the "
        "package reads into data/measured/ (dflash_trt/sim/measured.py says which, and why this is a step of its "
        "own: commit it saying why the new figures should stand).",
    )
    from ..sim.measured import INPUTS

    m.add_argument(
        "name", choices=sorted(INPUTS), help="the input: " + "; ".join(f"{k}: {v[1]}" for k, v in INPUTS.items())
    )
    m.add_argument("results_json", metavar="RESULTS", type=Path, help="the benchmark's results.json")
    m.set_defaults(func=cmd_measured_inputs)


class ActionModule(Protocol):
    """A `dflash-trt bench` action's module (dflash_trt/bench/<action>.py)."""

    __doc__: str | None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _own_arguments(
    action: argparse.ArgumentParser, run: Callable[[argparse.Namespace], int]
) -> Callable[[argparse.Namespace], int]:
    """`run` on the action's own arguments only: the namespace also holds every `dflash-trt bench` default, which
    an action that records its settings (results.json) must not take for its own, and the command's function,
    which a run that hands its arguments to worker processes could not pickle."""
    own = {a.dest for a in action._actions if a.dest != argparse.SUPPRESS}
    return lambda args: run(argparse.Namespace(**{k: v for k, v in vars(args).items() if k in own}))


def cmd_measured_inputs(args: argparse.Namespace) -> int:
    from ..sim.measured import promote
    from .options import CliError

    try:
        print(f"wrote {promote(args.name, args.results_json)}")
    except (OSError, ValueError) as e:  # a missing or unreadable file, not JSON, not that benchmark's results
        raise CliError(str(e)) from None
    return 0


def _model_args(p: argparse.ArgumentParser) -> None:
    """The target, the drafter and the peers' draft models."""
    from ..settings import DEMO_DIR
    from .options import add_model_args

    add_model_args(p, dtype=False, none_for="for --methods without dflash-*")
    p.add_argument(
        "--ar-draft",
        type=Path,
        default=DEMO_DIR / "ar-draft",
        help=f"small autoregressive draft model for HF assisted generation, same tokenizer "
        f"(default {DEMO_DIR / 'ar-draft'})",
    )
    p.add_argument(
        "--onnx-drafter",
        type=Path,
        default=None,
        metavar="DIR",
        help="an exported ONNX drafter folder (e.g. engines/drafter-onnx); default: export the "
        "drafter into a scratch folder at start",
    )


def _workload_args(p: argparse.ArgumentParser) -> None:
    """What runs: output folder, methods, block sizes, sampling, prompts and repetitions."""
    from ..bench.prompts import PROMPT_SETS
    from ..bench.runner import FAMILIES
    from .options import add_proposer_arg, finite_float, positive_int

    p.add_argument("--out", type=Path, default=Path("results/bench"), help="results folder (default results/bench)")
    p.add_argument(
        "--methods",
        nargs="+",
        choices=FAMILIES,
        default=list(FAMILIES),
        help="method families to run (default: all; the baseline always runs)",
    )
    p.add_argument(
        "--block-sizes",
        nargs="+",
        type=positive_int,
        default=None,
        help="DFlash block sizes (default 4 8 16; sizes above the drafter's trained size are skipped)",
    )
    add_proposer_arg(p, many=True, extra="; one method per proposer and block size, <family>-<proposer>-b<B>")
    p.add_argument(
        "--temperatures",
        nargs="+",
        type=finite_float,
        default=[0.0, 1.0],
        help="sampling temperatures (default 0 1; 0 = greedy, checked against the baseline)",
    )
    p.add_argument(
        "--max-new-tokens",
        nargs="+",
        type=positive_int,
        default=None,
        help="new tokens per run (default 128 512); every run makes exactly this many (EOS ignored)",
    )
    p.add_argument(
        "--prompt-sets",
        nargs="+",
        choices=list(PROMPT_SETS),
        default=None,
        help="prompt sets (default: all: held-out stdlib code, repetitive text, free text, and from installed "
        "packages function bodies, a function inside its file, a rewrite given the earlier version; with "
        "--smoke: code repetitive free)",
    )
    p.add_argument(
        "--prompts-per-set", type=positive_int, default=None, help="prompts per set for lengths <= 128 (default 3)"
    )
    p.add_argument(
        "--long-prompts-per-set",
        type=positive_int,
        default=None,
        help="prompts per set for lengths > 128 (default 1: the 512-token runs dominate the time)",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help="repetitions per prompt; method order rotates per prompt and repeat (default 1)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="CPU threads for torch and onnxruntime (default: torch's choice)",
    )


def _peer_args(p: argparse.ArgumentParser) -> None:
    """The HF peers' own settings: prompt lookup and assisted generation."""
    from .options import positive_int

    p.add_argument(
        "--prompt-lookup-tokens",
        type=positive_int,
        default=10,
        help="prompt_lookup_num_tokens for prompt-lookup decoding (default 10)",
    )
    p.add_argument(
        "--max-ngram",
        type=positive_int,
        default=2,
        help="max_matching_ngram_size for prompt-lookup decoding (default 2, HF's)",
    )
    p.add_argument(
        "--assistant-tokens",
        type=positive_int,
        default=None,
        help="num_assistant_tokens for assisted generation (default: HF's default and schedule)",
    )


def _run_args(p: argparse.ArgumentParser) -> None:
    """The ceiling's timing, the equality check, the time budget, output and the profile mode."""
    from .options import finite_float, positive_int

    p.add_argument(
        "--timing-reps",
        type=positive_int,
        default=None,
        help="repetitions of each pass timed for the ceiling (default 20)",
    )
    p.add_argument(
        "--tie-tolerance",
        type=finite_float,
        default=1e-3,
        help="greedy outputs that first differ where the target's two logits are within this are a "
        "numerical tie, reported but not a failure (default 1e-3)",
    )
    p.add_argument(
        "--corrupt-method",
        default=None,
        metavar="NAME",
        help="self-test of the equality check: corrupt NAME's greedy outputs (e.g. dflash-torch-b4); "
        "the run must then exit 1",
    )
    p.add_argument(
        "--max-minutes",
        type=finite_float,
        default=None,
        help="time budget: start no new prompt group after this many minutes (prompts run in order of "
        "index across all sets and settings, so a cut run still covers every cell); default: none",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a CI-sized run: 1 prompt per set, 16 new tokens, block sizes 2 4, 3 timing reps "
        "(explicit flags still apply to temperatures, methods and sets)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="instead of the benchmark: profile DFlash rounds (target verify, drafter, acceptance, "
        "rollback, Python overhead), write profile.json to --out and print it",
    )
    p.add_argument("--profile-tokens", type=positive_int, default=128, help="new tokens in the profiled run")


def cmd_bench(args: argparse.Namespace) -> int:
    from ..bench.report import markdown, plot, write_json
    from ..bench.runner import BenchError, BenchSettings, run_benchmark
    from ..config import ConfigError
    from ..settings import DEMO_MODELS_HINT, NO_DRAFTER
    from .options import CliError

    for key, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.prompt_sets is None:
        from ..bench.prompts import PROMPT_SETS

        args.prompt_sets = list(PROMPT_SETS)
    if not args.target.is_dir():
        raise CliError(
            f"target directory not found: {args.target} (the demo models come from "
            f"`{DEMO_MODELS_HINT}`; or pass --target/--drafter/--ar-draft)"
        )
    wants_drafter = args.profile or {"dflash-torch", "dflash-ort"} & set(args.methods)
    if args.drafter == NO_DRAFTER:
        if wants_drafter:
            raise CliError("--drafter none: leave dflash-torch and dflash-ort out of --methods (and no --profile)")
        args.drafter = None
    elif wants_drafter and not args.drafter.is_dir():
        raise CliError(f"drafter directory not found: {args.drafter} (leave dflash-* out of --methods to skip DFlash)")
    if not args.profile and "hf-assisted" in args.methods and not (args.ar_draft / "config.json").is_file():
        raise CliError(
            f"hf-assisted needs a small autoregressive draft model: {args.ar_draft} has no config.json "
            "(pass --ar-draft, or leave hf-assisted out of --methods)"
        )
    if args.profile:
        from ..bench.profile import print_profile, profile_rounds

        try:
            prof = profile_rounds(
                args.target,
                args.drafter,
                args.out,
                args.profile_tokens,
                args.threads,
                args.block_sizes,
                args.dtype,
                args.device,
            )
        except (BenchError, ConfigError, ValueError, OSError) as e:
            raise CliError(str(e)) from None
        print_profile(prof)
        return 0
    settings = BenchSettings(
        target=args.target,
        drafter=args.drafter,
        ar_draft=args.ar_draft,
        out=args.out,
        methods=tuple(dict.fromkeys(["baseline", *args.methods])),
        block_sizes=tuple(args.block_sizes),
        proposers=tuple(dict.fromkeys(args.proposer)),
        temperatures=tuple(args.temperatures),
        max_new_tokens=tuple(args.max_new_tokens),
        prompt_sets=tuple(args.prompt_sets),
        prompts_per_set=args.prompts_per_set,
        long_prompts_per_set=args.long_prompts_per_set,
        repeats=args.repeats,
        threads=args.threads,
        dtype=args.dtype,
        device=args.device,
        drafter_dtype=args.drafter_dtype,
        onnx_drafter=args.onnx_drafter,
        prompt_lookup_tokens=args.prompt_lookup_tokens,
        max_ngram=args.max_ngram,
        assistant_tokens=args.assistant_tokens,
        timing_reps=args.timing_reps,
        tie_tolerance=args.tie_tolerance,
        corrupt_method=args.corrupt_method,
        max_minutes=args.max_minutes,
        plots=not args.no_plots,
        progress=not args.no_progress,
    )
    if any(t < 0 for t in settings.temperatures):
        raise CliError("temperatures must be >= 0")
    try:
        report = run_benchmark(settings)
    except (BenchError, ConfigError, FileNotFoundError, ValueError, OSError) as e:
        raise CliError(str(e)) from None
    path = write_json(report, settings.out)
    plots = plot(report, settings.out) if settings.plots else []
    print(markdown(report))
    print(f"wrote {path}" + "".join(f", {p}" for p in plots), file=sys.stderr)
    eq = report["equality"]
    if not eq["passed"]:
        for m in eq["mismatches"]:
            print(
                f"MISMATCH: {m['method']} on {m['prompt_set']}#{m['prompt']} ({m['max_new_tokens']} tokens, repeat "
                f"{m['repeat']}): position {m['position']}, baseline token {m['baseline_token']}, method token "
                f"{m['method_token']}, logit gap {m['logit_gap']}",
                file=sys.stderr,
            )
        print("dflash-trt bench: error: greedy outputs differ from the target alone (see above)", file=sys.stderr)
        return 1
    return 0
