"""`python3 scripts/gpu_bare.py` (or `make gpu-bare`): the PyTorch engines on a bare GPU host (one GPU, torch +
CUDA and transformers preinstalled, no network, no TensorRT, no make needed). It runs from the repository's files
as they are (it puts the repository root on sys.path itself; torch, transformers and safetensors, which
transformers brings, are all it imports). Every stage (a pair, the cost grid) starts only while --max-minutes
(default 4, so that the whole run ends within 5) leaves it the time it needs (STAGE_SECONDS; else it is recorded
as skipped), runs apart from the others (an error costs only that stage), and is followed by a rewrite of the
files under --out (default $OUT when that variable is set, as on a lent device host, else results/gpu/): a run
killed at any point leaves every finished stage's results ("complete": false until the end). It prints the same
tables:

  summary.json    the host (torch, CUDA, transformers), and per pair (the demo pair; a tiny random pair with 8
                  query / 2 KV heads; tiny random Qwen3.5 (Gated DeltaNet hybrid), Gemma 4 and gpt-oss pairs,
                  which run per row on the host's transformers: runtime/hybrid.py): speculative output == the
                  same target engine alone (greedy, block 1), in float32, and tau and tokens/s of DFlash (the
                  drafter's block), of the server's adaptive policy (its cost model measured on the GPU at
                  start-up, `AdaptiveBlocks.measured`, over 64 rows; the per-row families: 4) and of the target
                  alone at concurrency 1, 16 and 64 (the per-row families: 1 and 4, each row a forward pass of
                  its own) through the batched loop (BatchDecoder); the Qwen3.5 pair's target is steered to
                  agree with its drafter (AGREEING_PAIR), so its rounds accept several drafts and roll back
                  inside the block ("rollbacks_keeping_drafts"). Where the two outputs part,
                  the target's top-2 logit margin there is reported: below NEAR_TIE_SPREAD x the standard
                  deviation of those logits it is a near-tie (cuBLAS picks other kernels for a verify pass's GEMM
                  sizes than for one token's, so float32 sums round differently) and passes, else it fails;
  cost_grid.json  the GPU's pass times of a target and its 5-layer DFlash drafter (random weights built on the
                  GPU in bfloat16, nothing downloaded; the target's shape: Llama-3-8B's, or --grid-target DIR's
                  config.json) by rows x tokens per row x context length, with the identity it was measured on
                  (target shape, dtype, engine, tp, GPU; dflash_trt/costgrid.py): the input of `dflash-trt
                  trtllm-serve-config --cost-table` (which refuses it for another target) and of the serving
                  simulation's calibration ({"identity": {...}, "target": [{rows, tokens_per_row, context,
                  seconds}], "drafter": [...]}), rewritten after every cell measured, so a run cut short
                  keeps each cell it finished;
  README.md       the same as tables.

Exit status 1 when speculative output differs from the target alone beyond a near-tie, or a pair errs or is
skipped for time (untested is not a pass); 0 otherwise. Without CUDA it prints SKIP with the reason, writes
nothing and exits 0. --device cpu --quick runs every part at toy sizes (the tests do).

    python3 scripts/gpu_bare.py [--out DIR] [--max-minutes 4] [--grid-target DIR] [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tiny-model factory (tests/tiny_models.py travels with it)

# What the bare host needs, relative to the repository root (the package, this script, the demo pair, the factory).
CARRY = [
    "Makefile",
    "dflash_trt",
    "scripts/gpu_bare.py",
    "tests/tiny_models.py",
    "models/target/config.json",
    "models/target/generation_config.json",
    "models/target/model.safetensors",
    "models/target/tokenizer.json",
    "models/target/tokenizer_config.json",
    "models/drafter/config.json",
    "models/drafter/model.safetensors",
]
CARRY_LIMIT = 64 * 1024 * 1024
RESULT_FILES = ("summary.json", "cost_grid.json", "README.md")
PROMPTS = [
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\n\ndef walk(path):\n",
    "def quicksort(items):\n",
    "def parse_args():\n    parser = argparse.ArgumentParser(",
    "class LinkedList:\n",
    "def read_json(path):\n",
    "def is_prime(n):\n",
]
# Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json) and a DFlash drafter of 5 layers at its width: the grid's
# default target shape.
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


# What a stage needs to start (seconds left on the clock): a pair loads, warms up and checks equality; the grid
# times at least its first context.
STAGE_SECONDS = {"pair": 30.0, "grid": 60.0}
# Where speculative and target-alone float32 outputs part, the target's top-2 margin there is a near-tie below
# this fraction of the logits' standard deviation: float32 keeps 24 bits, so sums of other orders differ by
# about 1e-6 of the logits' scale per layer; a real fault parts at a margin drawn from the logits' own spread,
# which falls below 1e-3 of it about once in a thousand.
NEAR_TIE_SPREAD = 1e-3
# The tiny random pairs of the families that run per row (runtime/hybrid.py), built from their configs.
FAMILY_PAIRS = ("qwen3_5", "gemma4", "gpt_oss")
# The per-row pair whose target is steered to agree with its random drafter (models/tiny.py steer_to_agree): its
# rounds accept several drafts and then reject one, so the verify pass is rolled back inside the block, Gated
# DeltaNet state included, on the device (random weights alone accept almost nothing and never get there).
AGREEING_PAIR = "qwen3_5"
AGREEING_TOKEN = 7
# Rows of a per-row family's adaptive start-up measurement and its largest concurrency: each row is its own
# forward pass there, so 64 rows cost 64 passes a step (minutes of the budget, leaving none for the cost grid).
PER_ROW_ROWS = 4


def carry_files(root: Path = ROOT) -> list[Path]:
    files: list[Path] = []
    for rel in CARRY:
        p = root / rel
        files += sorted(f for f in p.rglob("*.py")) if p.is_dir() else [p]
    return files


def carry_bytes(root: Path = ROOT) -> int:
    return sum(f.stat().st_size for f in carry_files(root))


class Clock:
    def __init__(self, minutes: float):
        self.t0, self.limit = time.perf_counter(), minutes * 60

    def left(self) -> float:
        return self.limit - (time.perf_counter() - self.t0)


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def environment(device: str) -> dict[str, Any]:
    import torch
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "device": device,
    }
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    return env


# ---- pairs ---------------------------------------------------------------------------------------------------
def demo_pair(device: str):
    import torch

    from dflash_trt.models.drafter import DFlashDrafter
    from dflash_trt.models.target import load_target, load_tokenizer
    from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET

    model = load_target(DEMO_TARGET, torch.float32, device)
    drafter = DFlashDrafter.from_pretrained(DEMO_DRAFTER, torch.float32).to(device).eval()
    tok = load_tokenizer(DEMO_TARGET)
    prompts = [tok.encode(p) for p in PROMPTS] if tok is not None else [[1, 2, 3]] * len(PROMPTS)
    return model, drafter, prompts


def tiny_pair(device: str):
    import torch
    from tiny_models import make_tiny_drafter, make_tiny_target

    model = make_tiny_target(
        None, vocab_size=512, layers=4, hidden=256, num_attention_heads=8, num_key_value_heads=2
    ).to(device)
    drafter = make_tiny_drafter(model.config, None, layers=1, block_size=8).to(device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (5, 9, 13, 17, 21, 25, 29, 33)]
    return model, drafter, prompts


def family_pair(family: str):
    """A maker of a tiny random `family` pair (the factory's short sliding windows included) on `device`."""

    def make(device: str):
        import torch
        from tiny_models import make_tiny_drafter, make_tiny_target

        model = make_tiny_target(None, family=family, vocab_size=512, layers=4, hidden=128, seed=0).to(device)
        drafter = make_tiny_drafter(model.config, None, layers=1, block_size=8).to(device)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in (5, 11, 17, 23)]
        if family == AGREEING_PAIR:
            from dflash_trt.models.tiny import steer_to_agree

            steer_to_agree(model, prompts, AGREEING_TOKEN)
        return model, drafter, prompts

    return make


def engines(model, drafter):
    from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine

    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    return target, TorchDrafterEngine.for_target(drafter, target)


def run_batch(
    target, drafter, prompts, max_new: int, block_size: int | None, device: str, dec=None
) -> tuple[list, float]:
    """`prompts` through a fresh BatchDecoder (block_size 1: the same target engine alone), or through `dec`."""
    from dflash_trt.decoding import BatchDecoder, GenerationConfig

    dec = dec or BatchDecoder(target, drafter)
    sync(device)
    t0 = time.perf_counter()
    out = dec.generate(prompts, GenerationConfig(max_new_tokens=max_new, block_size=block_size))
    sync(device)
    return out, time.perf_counter() - t0


def top2(model, ids: list[int]) -> tuple[float, float]:
    """(the gap between the two largest next-token logits after `ids`, the standard deviation of those logits)."""
    import torch

    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1]), float(logits.std())


def parting(model, prompt: list[int], spec: list[int], alone: list[int]) -> dict[str, Any] | None:
    """None when the outputs are equal; else where they part, the target's top-2 margin there and whether that
    is a near-tie (margin < NEAR_TIE_SPREAD x the logits' standard deviation; later tokens follow other
    contexts and are not compared)."""
    if spec == alone:
        return None
    n = min(len(spec), len(alone))
    first = next((i for i in range(n) if spec[i] != alone[i]), n)
    margin, spread = top2(model, prompt + alone[:first])
    limit = NEAR_TIE_SPREAD * spread
    return {"token": first, "margin": margin, "near_tie_below": limit, "near_tie": margin < limit}


def equality(model, prompts, spec, alone, adapted) -> dict[str, Any]:
    """Speculative (the drafter's block, the adaptive policy) against the same engine alone, prompt by prompt."""
    parts = {
        kind: {i: parting(model, prompts[i], s.token_ids, a.token_ids) for i, (s, a) in enumerate(zip(out, alone))}
        for kind, out in (("dflash", spec), ("adaptive", adapted))
    }
    differ = {kind: {i: p for i, p in found.items() if p is not None} for kind, found in parts.items()}
    return {
        "prompts": len(prompts),
        "differ": sorted(differ["dflash"]),
        "differ_adaptive": sorted(differ["adaptive"]),
        "near_ties": [{"run": k, "prompt": i, **p} for k, d in differ.items() for i, p in d.items() if p["near_tie"]],
        "not_near_ties": [
            {"run": k, "prompt": i, **p} for k, d in differ.items() for i, p in d.items() if not p["near_tie"]
        ],
        "pass": all(p["near_tie"] for d in differ.values() for p in d.values()),
    }


def stage_sizes(per_row: bool, quick: bool) -> dict[str, Any]:
    """A pair stage's sizes: new tokens per prompt, rows of the adaptive start-up measurement (what `serve
    --max-active` would hold) and the concurrencies timed. --quick: a CPU's dry run. A per-row family runs each
    row as its own forward pass: PER_ROW_ROWS rows, not 64."""
    if quick:
        return {"max_new": 8, "rows": 4, "levels": (1, 2)}
    if per_row:
        return {"max_new": 48, "rows": PER_ROW_ROWS, "levels": (1, PER_ROW_ROWS)}
    return {"max_new": 96, "rows": 64, "levels": (1, 16, 64)}


def rollbacks_keeping_drafts(results, block_size: int) -> int:
    """Rounds that accepted at least two drafts and rejected a later one: the verify pass's cache was rolled
    back to a point inside the block that keeps several of its tokens (acceptance lengths count the bonus)."""
    return sum(1 for r in results for n in r.stats.acceptance_lengths if 3 <= n < block_size)


def pair_stage(name: str, make, device: str, clock: Clock, quick: bool) -> dict[str, Any]:
    """Equality (speculative == the same engine alone, up to near-ties) and tau / tokens/s at each concurrency."""
    import torch

    from dflash_trt.decoding import AdaptiveBlocks, BatchDecoder
    from dflash_trt.runtime.base import pass_clock

    torch.backends.cuda.matmul.allow_tf32 = False  # equality at full float32 precision
    torch.backends.cudnn.allow_tf32 = False
    model, drafter, prompts = make(device)
    target, draft = engines(model, drafter)
    per_row = target.per_row_reason is not None
    sizes = stage_sizes(per_row, quick)
    max_new = sizes["max_new"]
    if quick:
        prompts = prompts[:2]
    result: dict[str, Any] = {"pair": name, "max_new_tokens": max_new, "dtype": "float32"}
    if per_row:
        result["per_row"] = target.per_row_reason
    run_batch(target, draft, prompts[:2], 4, None, device)  # warm-up: kernels, allocator
    run_batch(target, draft, prompts[:2], 4, 1, device)
    spec, _ = run_batch(target, draft, prompts, max_new, None, device)
    alone, _ = run_batch(target, draft, prompts, max_new, 1, device)
    taus = [r.stats.mean_acceptance_length for r in spec if r.stats.acceptance_lengths]
    result["tau"] = round(sum(taus) / len(taus), 3) if taus else None
    result["rollbacks_keeping_drafts"] = rollbacks_keeping_drafts(spec, drafter.spec.block_size)
    # the server's adaptive policy, its cost model measured here at start-up (on CUDA: the token curve, knees,
    # 4-row probes, every timing after the device is done), as `dflash-trt serve --max-active 64` would
    t0 = time.perf_counter()
    timer = pass_clock(target, draft)
    rows = sizes["rows"]
    adaptive = BatchDecoder(target, draft, policy=AdaptiveBlocks.measured(target, draft, rows, timer), clock=timer)
    result["adaptive_start_up_s"], result["adaptive_rows"] = round(time.perf_counter() - t0, 2), rows
    adapted, _ = run_batch(target, draft, prompts, max_new, None, device, adaptive)
    result["equal"] = equality(model, prompts, spec, alone, adapted)
    result["throughput"] = throughput(target, draft, adaptive, prompts, max_new, sizes["levels"], device, clock)
    del model, drafter, target, draft
    return result


def throughput(target, draft, adaptive, prompts, max_new: int, levels, device: str, clock: Clock) -> list[dict]:
    """tau and tokens/s of DFlash, the adaptive policy and the target alone at each concurrency in `levels`."""
    rows: list[dict[str, Any]] = []
    for c in levels:
        if clock.left() < 30:
            rows.append({"concurrency": c, "skipped": "time limit"})
            continue
        batch = [prompts[i % len(prompts)] for i in range(c)]
        cell: dict[str, Any] = {"concurrency": c}
        for label, block, dec in (("dflash", None, None), ("adaptive", None, adaptive), ("target_alone", 1, None)):
            out, seconds = run_batch(target, draft, batch, max_new, block, device, dec)
            new = sum(len(r.token_ids) for r in out)
            cell[label] = {"tokens_per_s": round(new / seconds, 1), "seconds": round(seconds, 3)}
            if block is None:
                taus = [r.stats.mean_acceptance_length for r in out if r.stats.acceptance_lengths]
                cell[label]["tau"] = round(sum(taus) / len(taus), 3) if taus else None
        cell["speedup"] = round(cell["dflash"]["tokens_per_s"] / cell["target_alone"]["tokens_per_s"], 3)
        cell["adaptive_speedup"] = round(cell["adaptive"]["tokens_per_s"] / cell["target_alone"]["tokens_per_s"], 3)
        rows.append(cell)
    return rows


# ---- cost grid -----------------------------------------------------------------------------------------------
def shape_models(device: str, quick: bool, grid_target: Path | None = None):
    """A Llama-3-8B-shaped target (or one of `grid_target`'s architecture and shape, read from its config.json,
    no weights) and a 5-layer DFlash drafter, random weights built on the device (bfloat16 on CUDA); --quick: the
    same structure at toy width."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    from dflash_trt.config import build_target_layer_ids
    from dflash_trt.models.drafter import DFlashDrafter

    config = None
    if grid_target is not None:
        config = AutoConfig.from_pretrained(grid_target, local_files_only=True)
        config = getattr(config, "text_config", None) or config
    shape = dict(LLAMA3_8B) if config is None else {k: getattr(config, k, LLAMA3_8B[k]) for k in LLAMA3_8B}
    shape["num_key_value_heads"] = shape["num_key_value_heads"] or shape["num_attention_heads"]
    if quick and config is None:  # a --grid-target keeps its own shape (the tests pass a tiny one)
        shape.update(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    layers, width = shape["num_hidden_layers"], shape["hidden_size"]
    head_dim = getattr(config, "head_dim", None) or width // shape["num_attention_heads"]
    drafter_cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": width,
        "intermediate_size": shape["intermediate_size"],
        "num_hidden_layers": 5,
        "num_attention_heads": shape["num_attention_heads"],
        "num_key_value_heads": shape["num_key_value_heads"],
        "head_dim": head_dim,
        "vocab_size": shape["vocab_size"],
        "rms_norm_eps": shape["rms_norm_eps"],
        "rope_theta": shape["rope_theta"],
        "max_position_embeddings": shape["max_position_embeddings"],
        "block_size": 16,
        "num_target_layers": layers,
        "dflash_config": {
            "mask_token_id": shape["vocab_size"] - 1,
            "target_layer_ids": build_target_layer_ids(int(layers), 5),
        },
    }
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config or LlamaConfig(**shape)).eval()
            drafter = DFlashDrafter.from_config(drafter_cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype), drafter.to(dtype), shape


def cost_grid_stage(
    device: str, clock: Clock, quick: bool, grid_target: Path | None = None, on_cell=None
) -> dict[str, Any]:
    """The cost grid, cell by cell: `on_cell(grid)` after every cell appended (the caller writes it out)."""
    import torch

    from dflash_trt.costgrid import grid_identity
    from dflash_trt.runtime.base import DraftRequest

    model, drafter, shape = shape_models(device, quick, grid_target)
    target, draft = engines(model, drafter)
    rows_grid = (1, 2) if quick else (1, 4, 16, 64)
    tokens_grid = (1, 4) if quick else (1, 4, 8, 16)
    blocks_grid = (4, 8) if quick else (4, 8, 16)
    contexts = (16,) if quick else (512, 2048)
    repeats = 1 if quick else 3
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    gpu = environment(device).get("gpu", device)
    name = "toy" if quick else str(grid_target) if grid_target else "Llama-3-8B"
    grid: dict[str, Any] = {
        # what the grid was measured on: trtllm-serve-config --cost-table refuses it for another target or tp
        "identity": grid_identity(shape, dtype=dtype, engine="torch", tp=1, gpu=gpu),
        "shape": {"target": name, **shape, "drafter_layers": 5},
        "dtype": dtype,
        "device": gpu,
        "repeats": repeats,
        "note": "seconds: the fastest of `repeats` passes, synchronised; tokens = rows x tokens_per_row",
        "target": [],
        "drafter": [],
        "skipped": [],
    }
    vocab, feature_dim = shape["vocab_size"], 5 * shape["hidden_size"]
    g = torch.Generator().manual_seed(0)

    def timed(fn) -> float:
        best = float("inf")
        for rep in range(repeats + 1):  # pass 0 warms up
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            if rep:
                best = min(best, time.perf_counter() - t0)
        return best

    for context in contexts:
        for rows in rows_grid:
            if clock.left() < 45:
                grid["skipped"].append({"context": context, "rows": rows, "why": "time limit"})
                continue
            sess = target.new_session()
            handles = [sess.add_row() for _ in range(rows)]
            for i in range(0, rows, 8):  # prefill in groups: bounded attention masks and activations
                part = handles[i : i + 8]
                sess.forward(
                    part, [torch.randint(0, vocab, (context,), generator=g) for _ in part], last_logits_only=True
                )
            for t in tokens_grid:
                ids = [torch.randint(0, vocab, (t,), generator=g) for _ in handles]

                def one_pass(ids=ids, sess=sess, handles=handles) -> None:
                    sess.forward(handles, ids, features=True)
                    for h in handles:
                        sess.rollback(h, context)

                entry = {"rows": rows, "tokens_per_row": t, "context": context, "seconds": timed(one_pass)}
                grid["target"].append(entry)
                if on_cell is not None:
                    on_cell(grid)
            del sess
            dsess = draft.new_session()
            dh = [dsess.add_row() for _ in range(rows)]
            dev = next(model.parameters()).device
            for i in range(0, rows, 8):
                part = dh[i : i + 8]
                feats = [
                    torch.randn(context, feature_dim, device=dev, dtype=next(model.parameters()).dtype) for _ in part
                ]
                dsess.draft([DraftRequest(h, f, 1, 2) for h, f in zip(part, feats)])
            one = torch.randn(1, feature_dim, device=dev, dtype=next(model.parameters()).dtype)
            for b in blocks_grid:
                seconds = timed(lambda b=b, dsess=dsess, dh=dh: dsess.draft([DraftRequest(h, one, 1, b) for h in dh]))
                # each timed call adds one feature per row: the context grows by repeats + 1 tokens, noted here
                grid["drafter"].append({"rows": rows, "tokens_per_row": b, "context": context, "seconds": seconds})
                if on_cell is not None:
                    on_cell(grid)
            del dsess
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
    del model, drafter, target, draft
    return grid


# ---- report --------------------------------------------------------------------------------------------------
def equal_cell(p: dict[str, Any]) -> str:
    """The README's verdict for a pair: yes, yes up to near-ties (with their margins), or NO."""
    eq = p["equal"]
    ties = ", ".join(f"{t['run']} prompt {t['prompt']} token {t['token']}: {t['margin']:.2g}" for t in eq["near_ties"])
    if not eq["pass"]:
        return f"NO (prompts {eq['differ']}, adaptive {eq['differ_adaptive']})"
    return f"yes, up to near-ties ({ties})" if ties else "yes"


def readme(summary: dict[str, Any], grid: dict[str, Any] | None) -> str:
    env = summary["environment"]
    state = "" if summary.get("complete") else " (partial: the run had not ended when this was written)"
    lines = [
        "# scripts/gpu_bare.py results",
        "",
        f"Host: {env.get('gpu', env['device'])}, torch {env['torch']} (CUDA {env['cuda']}), "
        f"transformers {env['transformers']}; {summary['seconds']:.0f} s{state}.",
        "",
        "| pair | speculative == target alone | concurrency | DFlash tok/s | tau | adaptive tok/s | tau "
        "| target alone tok/s | speedup | adaptive speedup |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in summary["pairs"]:
        if "error" in p or "skipped" in p:
            what = f"error: {p['error']}" if "error" in p else f"skipped: {p['skipped']}"
            lines.append(f"| {p['pair']} | {what} | | | | | | | | |")
            continue
        eq = equal_cell(p)
        for c in p["throughput"]:
            if "skipped" in c:
                lines.append(f"| {p['pair']} | {eq} | {c['concurrency']} | skipped ({c['skipped']}) | | | | | | |")
                continue
            d, ad, a = c["dflash"], c["adaptive"], c["target_alone"]
            lines.append(
                f"| {p['pair']} | {eq} | {c['concurrency']} | {d['tokens_per_s']} | {d['tau']} | "
                f"{ad['tokens_per_s']} | {ad['tau']} | {a['tokens_per_s']} | {c['speedup']}x | {c['adaptive_speedup']}x |"
            )
    for key in ("cost_grid_error", "cost_grid_skipped"):
        if key in summary:
            lines += ["", f"Cost grid: {summary[key]}"]
    if grid is not None:
        lines += ["", f"Cost grid ({grid['shape']['target']} shape, {grid['dtype']}), ms per pass:", ""]
        lines += ["| engine | context | rows | tokens per row | ms |", "|---|---|---|---|---|"]
        for kind in ("target", "drafter"):
            for e in grid[kind]:
                lines.append(
                    f"| {kind} | {e['context']} | {e['rows']} | {e['tokens_per_row']} | {e['seconds'] * 1e3:.2f} |"
                )
    return "\n".join(lines) + "\n"


def write_results(out: Path, summary: dict[str, Any], grid: dict[str, Any] | None, clock: Clock) -> str:
    """(Re)write the result files now: after every stage, so a run killed later keeps what it measured."""
    summary["seconds"] = round(clock.limit - clock.left(), 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if grid is not None:
        (out / "cost_grid.json").write_text(json.dumps(grid, indent=1) + "\n")
    report = readme(summary, grid)
    (out / "README.md").write_text(report)
    return report


def time_left_for(stage: str, clock: Clock) -> str | None:
    """Why `stage` ("pair" or "grid") may not start now (None: it may)."""
    need, left = STAGE_SECONDS[stage], clock.left()
    if left >= need:
        return None
    return f"time limit: {max(left, 0.0):.0f} s left of --max-minutes, a {stage} stage needs {need:.0f} s"


def run_pairs(names: list[str], args, clock: Clock, summary: dict[str, Any]) -> None:
    """Each pair apart (its error or its skip costs only itself), the files rewritten after each."""
    makers = {"demo": ("demo", demo_pair), "tiny": ("tiny-8q-2kv", tiny_pair)}
    makers.update({f: (f"tiny-{f}", family_pair(f)) for f in FAMILY_PAIRS})
    for name, make in (makers[key] for key in names):
        why = time_left_for("pair", clock)
        if why is not None:
            result: dict[str, Any] = {"pair": name, "skipped": why}
        else:
            try:
                result = pair_stage(name, make, args.device, clock, args.quick)
            except Exception as e:  # noqa: BLE001 - a host check reports, it does not crash
                result = {"pair": name, "error": f"{type(e).__name__}: {e}"}
        summary["pairs"].append(result)
        print(json.dumps(result), flush=True)
        write_results(args.out, summary, None, clock)


def run_grid(args, clock: Clock, summary: dict[str, Any]) -> dict[str, Any] | None:
    """The cost grid, its files rewritten after every cell (a run killed or failing mid-grid keeps the cells it
    measured); on an error, the cells measured before it and the error."""
    if args.no_grid:
        return None
    why = time_left_for("grid", clock)
    if why is not None:
        summary["cost_grid_skipped"] = why
        return None
    latest: list[dict[str, Any]] = []

    def written(grid: dict[str, Any]) -> None:
        latest[:] = [grid]
        write_results(args.out, summary, grid, clock)

    try:
        return cost_grid_stage(args.device, clock, args.quick, args.grid_target, written)
    except Exception as e:  # noqa: BLE001
        summary["cost_grid_error"] = f"{type(e).__name__}: {e}"
        return latest[0] if latest else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "results" / "gpu"
    p.add_argument("--out", type=Path, default=out, help="results folder (default $OUT when set, else results/gpu)")
    p.add_argument(
        "--max-minutes", type=float, default=4.0, help="start no stage that cannot finish by then (default 4)"
    )
    p.add_argument(
        "--grid-target",
        type=Path,
        default=None,
        help="time the cost grid on this target's architecture and shape (its config.json; random weights) "
        "instead of Llama-3-8B's: the grid trtllm-serve-config accepts for that target",
    )
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --quick: the tests' dry run)")
    p.add_argument("--quick", action="store_true", help="toy sizes for every part (a dry run of the script)")
    p.add_argument("--no-grid", action="store_true", help="skip the cost grid")
    known = ["demo", "tiny", *FAMILY_PAIRS]
    p.add_argument(
        "--pairs",
        default=",".join(known),
        help="comma-separated, each run apart: demo (models/), tiny (random 8/2 heads), and tiny random pairs of "
        f"the families that run per row on the host's transformers ({', '.join(FAMILY_PAIRS)}) (default all)",
    )
    p.add_argument("--list-carry", action="store_true", help="print the files the host needs and their size, exit")
    args = p.parse_args(argv)
    args.pair_names = [k for k in args.pairs.split(",") if k]
    unknown = [k for k in args.pair_names if k not in known]
    if unknown:
        p.error(f"unknown pair {unknown[0]!r} (known: {', '.join(known)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_carry:
        for f in carry_files():
            print(f.relative_to(ROOT))
        print(f"# {carry_bytes() / 2**20:.1f} MiB of {CARRY_LIMIT / 2**20:.0f} MiB", file=sys.stderr)
        return 0
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"SKIP gpu-bare: no CUDA GPU visible to torch {torch.__version__}; nothing written")
        return 0
    clock = Clock(args.max_minutes)
    summary: dict[str, Any] = {"environment": environment(args.device), "complete": False, "pairs": []}
    print("environment: " + json.dumps(summary["environment"]), flush=True)
    run_pairs(args.pair_names, args, clock, summary)
    grid = run_grid(args, clock, summary)
    summary["complete"] = True
    report = write_results(args.out, summary, grid, clock)
    print(report, flush=True)  # a host whose files do not come back still shows its results in the log
    tested = [p for p in summary["pairs"] if "equal" in p]
    ok = len(tested) == len(summary["pairs"]) and all(p["equal"]["pass"] for p in tested)
    untested = [p["pair"] for p in summary["pairs"] if "equal" not in p]
    print(
        f"gpu-bare: speculative == target alone: {'PASS' if ok else 'FAIL'}"
        + (f" (not tested: {', '.join(untested)})" if untested else "")
        + f"; wrote {args.out}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
