"""CLI: export-drafter, build-drafter, build-target, engines. Light at import (torch etc. load inside commands)."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import NoReturn


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    _register_export_drafter(sub)
    _register_build_drafter(sub)
    _register_build_target(sub)
    _register_engines(sub)


def _register_export_drafter(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .options import add_model_args

    p = sub.add_parser(
        "export-drafter",
        help="export the drafter round (with the target's embedding and lm_head) to ONNX",
        description="Write drafter.onnx (fp32), drafter_fp16.onnx (fp16 math, fp32 inputs/outputs), their .data "
        "weight files and drafter.json into OUT. One graph: block token ids -> embedding -> drafter layers -> "
        "target lm_head -> argmax, with the drafter's context KV cache as explicit inputs and outputs.",
    )
    add_model_args(p, dtype=False)  # the target supplies the embedding table and lm_head
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--no-fp16", action="store_true", help="skip the fp16 graph")
    p.set_defaults(func=cmd_export_drafter)


def _register_build_drafter(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .options import positive_int

    p = sub.add_parser(
        "build-drafter",
        help="build a TensorRT FP16 plan from an exported drafter (needs TensorRT and a GPU)",
        description="Build drafter.plan + drafter.plan.json (TensorRT version, GPU, profile shapes, input hashes) "
        "from the folder `export-drafter` wrote. TensorRT 10: the strongly typed fp16 graph, its norms in fp32 "
        "(default), or weak typing with FP16 kernels; TensorRT 11: strongly typed only.",
    )
    p.add_argument("--onnx", type=Path, required=True, help="folder written by export-drafter")
    p.add_argument("--out", type=Path, required=True, help="output folder for the plan")
    p.add_argument(
        "--typing",
        choices=["weak", "strong"],
        default=None,
        help="strong (default): the fp16 graph, whose casts keep the RMS norms in fp32; weak: fp32 graph + "
        "BuilderFlag.FP16 (TensorRT 10 only; TensorRT may run the norms' squares in fp16, which overflow on "
        "large activations)",
    )
    p.add_argument(
        "--max-context",
        type=positive_int,
        default=None,
        help="largest cache length T in the profile (default: the drafter's max positions)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        help="largest n (new context tokens per call; the prefill passes the whole prompt) (default: max context)",
    )
    p.set_defaults(func=cmd_build_drafter)


def _register_build_target(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ..builders.trtllm_target import FAMILIES, PYTORCH_BACKEND_ONLY
    from .options import add_model_args, positive_int

    refused = sorted({k.removesuffix("_text") for k in PYTORCH_BACKEND_ONLY})

    p = sub.add_parser(
        "build-target",
        help="convert + build a tensor-parallel TensorRT-LLM target engine (needs TensorRT-LLM 1.2)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "HF checkpoint -> TensorRT-LLM checkpoint (one rank file per GPU) -> trtllm-build engine (TensorRT-LLM "
            "1.2 engine path) whose model class marks the drafter's feature layers and the final hidden state as outputs. "
            "Built without --gather_context_logits and without speculative-decoding flags, so the runtime keeps KV block "
            "reuse on; every rank is built by one process (--workers 1). --dry-run prints the plan and the launch line "
            f"without running anything. Target families: {', '.join(sorted(FAMILIES))}. Families TensorRT-LLM 1.2 "
            f"cannot build as an engine ({', '.join(refused)}) are refused with the route that serves them: "
            "TensorRT-LLM's native DFlash after 1.2 (trtllm-serve-config) or the PyTorch engines (serve).",
            100,
        ),
        epilog="launch (tp = N > 1: one process per GPU; rank 0 runs the loop and HTTP, the others the engine):\n"
        "  mpirun -n N --allow-run-as-root dflash-trt serve --engines engines --host 0.0.0.0\n"
        "tp = 1:\n  dflash-trt serve --engines engines\n"
        "(engines/ as written by `make engines` with tp = N in engines.toml). Not run on real hardware in this project.",
    )
    add_model_args(p, dtype=False)  # the drafter gives the feature layers and the block size
    p.add_argument(
        "--tp", type=positive_int, choices=[1, 2, 4, 8], default=1, help="tensor-parallel size = GPUs (default 1)"
    )
    p.add_argument(
        "--gpus-per-node",
        type=positive_int,
        default=None,
        help="GPUs of one node the ranks run on, recorded in the engine (default: tp, one node); the TensorRT-LLM "
        "Executor runs rank r on GPU r %% gpus-per-node, so two 4-GPU nodes serving tp 8 need 4",
    )
    p.add_argument("--out", type=Path, required=True, help="output folder (checkpoint/ and engine/ inside)")
    p.add_argument("--block-size", type=positive_int, default=None, help="default: the drafter's trained block size")
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16", help="engine dtype (default float16)")
    p.add_argument("--max-batch-size", type=positive_int, default=8, help="default 8")
    p.add_argument(
        "--max-seq-len",
        type=positive_int,
        default=4096,
        help="longest sequence, prompt + output (default 4096); the engine accepts max_seq_len - 1 tokens "
        "per request when --max-num-tokens >= it",
    )
    p.add_argument(
        "--max-num-tokens",
        type=positive_int,
        default=None,
        help="tokens per engine pass (default: --max-seq-len, so a whole context fits one pass); the "
        "engine's context limit is min(max_seq_len - 1, max_num_tokens)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan and the launch line only")
    p.set_defaults(func=cmd_build_target)


def _register_engines(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ..settings import REPO_ROOT
    from .options import positive_int

    p = sub.add_parser(
        "engines",
        help="build every engine this machine supports from one config file (what `make engines` runs)",
        description="Read the engines config (TOML or JSON: target, drafter, output, tp, block_size, precision, "
        "max_batch_size, max_input_len, max_seq_len), build the ONNX drafter always, the TensorRT plan and the "
        "TensorRT-LLM target where TensorRT / TensorRT-LLM and GPUs exist, write OUTPUT/manifest.json and report "
        "what was built, what was up to date and what was skipped and why. Unchanged inputs: nothing is rebuilt. The "
        "drafter's ONNX graphs come from the export cache when the same checkpoints were exported before "
        "($DFLASH_TRT_CACHE, default ~/.cache/dflash-trt; off turns it off).",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=REPO_ROOT / "engines.toml",
        help="engines config file (default: engines.toml at the repo root)",
    )
    p.add_argument("--target", type=Path, default=None, help="override the config's target checkpoint")
    p.add_argument("--drafter", type=Path, default=None, help="override the config's drafter checkpoint")
    p.add_argument("--out", type=Path, default=None, help="override the config's output folder")
    p.add_argument(
        "--tp",
        type=positive_int,
        choices=[1, 2, 4, 8],
        default=None,
        help="override the config's tensor-parallel size (1, 2, 4 or 8)",
    )
    p.set_defaults(func=cmd_engines)


def _fail(e: Exception) -> NoReturn:
    from .options import CliError

    raise CliError(str(e)) from None


def cmd_export_drafter(args: argparse.Namespace) -> int:
    from ..builders.onnx_drafter import export_from_checkpoints
    from ..config import ConfigError

    for role, path in (("drafter", args.drafter), ("target", args.target)):
        if not path.is_dir():
            _fail(FileNotFoundError(f"{role} directory not found: {path}"))
    try:
        files = export_from_checkpoints(args.drafter, args.target, args.out, fp16=not args.no_fp16)
    except (ConfigError, FileNotFoundError, ValueError, OSError) as e:
        _fail(e)
    for name, path in files.items():
        print(f"{name}: {path}")
    return 0


def cmd_build_drafter(args: argparse.Namespace) -> int:
    from ..builders.trt_drafter import build_drafter_plan
    from ..runtime.base import EngineUnavailable

    try:
        plan = build_drafter_plan(
            args.onnx, args.out, typing=args.typing, max_context=args.max_context, max_new_tokens=args.max_new_tokens
        )
    except (EngineUnavailable, FileNotFoundError, ValueError) as e:
        _fail(e)
    print(f"plan: {plan}")
    return 0


def cmd_build_target(args: argparse.Namespace) -> int:
    import shlex

    from ..builders.trtllm_target import (
        TargetBuildError,
        launch_command,
        plan_target_build,
        run_plan,
        spec_from_checkpoints,
    )
    from ..config import ConfigError
    from ..runtime.base import EngineUnavailable

    try:
        for role, path in (("target", args.target), ("drafter", args.drafter)):
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"{role} checkpoint not found: {path}")
        plan = plan_target_build(
            spec_from_checkpoints(
                args.target,
                args.drafter,
                args.out,
                args.tp,
                args.block_size,
                dtype=args.dtype,
                max_batch_size=args.max_batch_size,
                max_seq_len=args.max_seq_len,
                max_num_tokens=args.max_num_tokens,
                gpus_per_node=args.gpus_per_node,
            )
        )
        print(plan.describe())
        print("checkpoint files: " + ", ".join(plan.checkpoint_files))
        print("engine files:     " + ", ".join(plan.engine_files))
        print("engine outputs:   " + ", ".join(plan.outputs) + f"; max context {plan.spec.max_context} tokens")
        print(
            "launch: "
            + shlex.join(launch_command("engines", args.tp, ["serve"]) + ["--host", "0.0.0.0"])
            + "   (engines/ from `make engines` with this tp)"
        )
        if not args.dry_run:
            run_plan(plan)
    except (TargetBuildError, ConfigError, EngineUnavailable, FileNotFoundError) as e:
        _fail(e)
    return 0


def cmd_engines(args: argparse.Namespace) -> int:
    import time

    from ..builders.engines import EnginesConfigError, EnginesDependencyError, build_engines, read_config
    from ..config import ConfigError
    from ..settings import REPO_ROOT

    t0 = time.perf_counter()
    try:
        cfg = read_config(
            args.config if args.config.is_file() or args.config != REPO_ROOT / "engines.toml" else None,
            REPO_ROOT,
            {"target": args.target, "drafter": args.drafter, "output": args.out, "tp": args.tp},
        )
        manifest, report = build_engines(cfg)
    except (EnginesConfigError, EnginesDependencyError, ConfigError, FileNotFoundError, ValueError) as e:
        _fail(e)
    for line in report.lines():
        print(line)
    serve = manifest["serve"]
    print(
        f"serving: drafter {serve['drafter']}, target {serve['target']}; manifest {cfg.output / 'manifest.json'} "
        f"({time.perf_counter() - t0:.1f} s)"
    )
    return 0
