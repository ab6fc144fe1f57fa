"""CLI: trtllm-serve-config (TensorRT-LLM's native DFlash, PyTorch backend, releases after 1.2)."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .options import add_model_args, positive_int

    p = sub.add_parser(
        "trtllm-serve-config",
        help="write the trtllm-serve --config YAML that serves this pair with TensorRT-LLM's native DFlash",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "Write the YAML for `trtllm-serve TARGET --backend pytorch --config FILE` on a TensorRT-LLM release "
            "with native DFlash (PyTorch backend, after 1.2; no engine build): speculative_config with "
            "decoding_type DFlash, max_draft_len (the drafter's block size - 1), speculative_model (the drafter "
            "folder as it is), target_layer_ids and mask_token_id. The drafter folder is checked against what "
            "TensorRT-LLM's DFlash loader reads first. With --cost-table (a measured GPU cost grid, e.g. "
            "results/gpu/cost_grid.json from scripts/gpu_bare.py) and --tau, also max_concurrency or "
            "draft_len_schedule: per batch size the draft length that maximises committed tokens per second. "
            "DFlash 2 drafters (DFlash2DraftModel) take the same config: TensorRT-LLM picks DFlash 2 from the "
            "checkpoint, whose dflash_config recipe and selector / convolution weights are checked too; targets of "
            "every family TensorRT-LLM's PyTorch backend serves (qwen3_5, qwen3_5_moe, gpt_oss, gemma4, ...) are "
            "checked against the drafter's feature layers. Attention: TensorRT-LLM's default DFlash attention backend "
            "(VANILLA) needs the flash-attn package on GPUs before Blackwell; --attention-backend TRTLLM needs "
            "Blackwell (SM100 / SM103) and FlashInfer. For TensorRT-LLM 1.2 (the engine path) use build-target instead; docs/gpu.md "
            "says which fits which container.",
            100,
        ),
    )
    add_model_args(p, dtype=False)
    p.add_argument("--out", type=Path, default=None, help="YAML file to write (default: print it)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size for the printed command line")
    p.add_argument(
        "--cost-table",
        type=Path,
        default=None,
        help="measured cost grid JSON (target and drafter), measured on this target at this --tp, on TensorRT-LLM "
        "in the checkpoint's dtype: a grid recording another shape, tp, engine or dtype is refused",
    )
    p.add_argument(
        "--tau", type=float, default=None, help="measured mean acceptance length at the drafter's block size"
    )
    p.add_argument(
        "--context", type=positive_int, default=None, help="context length of the cost grid to use (default: largest)"
    )
    p.add_argument(
        "--attention-backend",
        choices=["VANILLA", "TRTLLM"],
        default=None,
        help="DFlashDecodingConfig.attention_backend (default: not written, so TensorRT-LLM's VANILLA, which needs "
        "the flash-attn package); TRTLLM: Blackwell only, with FlashInfer",
    )
    p.set_defaults(func=cmd_trtllm_serve_config)


def cmd_trtllm_serve_config(args: argparse.Namespace) -> int:
    import shlex

    from ..builders.trtllm_serve import ATTENTION_NOTE, ServeConfigError, serve_command, serve_config, to_yaml
    from .options import CliError

    try:
        if not (args.target / "config.json").is_file():
            raise FileNotFoundError(f"target checkpoint not found: {args.target}")
        cfg = serve_config(
            args.drafter,
            cost_table=args.cost_table,
            tau=args.tau,
            context=args.context,
            target_dir=args.target,
            tp=args.tp,
            attention_backend=args.attention_backend,
        )
    except (ServeConfigError, FileNotFoundError, ValueError) as e:
        raise CliError(str(e)) from None
    text = to_yaml(cfg)
    cmd = serve_command(args.target, args.out or "FILE")
    if args.tp > 1:
        cmd += ["--tp_size", str(args.tp)]
    trtllm = "attention_backend TRTLLM needs Blackwell (SM100 / SM103) and FlashInfer there"
    note = f"\n# note: {trtllm if args.attention_backend == 'TRTLLM' else ATTENTION_NOTE}"
    if args.out is None:
        print(text, end="")
        print("# serve with: " + shlex.join(cmd) + note)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}; serve with: {shlex.join(cmd)}" + note)
    return 0
