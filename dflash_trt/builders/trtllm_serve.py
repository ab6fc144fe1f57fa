"""`dflash-trt trtllm-serve-config`: the `trtllm-serve --config` YAML for TensorRT-LLM's native DFlash.

TensorRT-LLM releases after 1.2 run DFlash in their PyTorch backend (no engine build): `trtllm-serve TARGET
--config FILE` with FILE's `speculative_config` parsed as `DFlashDecodingConfig`
(tensorrt_llm/llmapi/llm_args.py, NVIDIA/TensorRT-LLM main at commit 0004396720054fd8e205cbf616f21f0b57c6b412,
a post-1.2 development snapshot). What we write and why:

  * decoding_type: DFlash (its Literal discriminator);
  * max_draft_len: block_size - 1. The draft block's slot 0 holds the anchor (bonus) token and slots 1..K
    predict the K drafts (tensorrt_llm/_torch/speculative/dflash.py, dflash_draft_slot_ids), so a drafter
    trained on blocks of B tokens drafts at most B - 1;
  * speculative_model: the drafter folder, as it is (see `drafter_problems` for what the loader reads);
  * target_layer_ids, mask_token_id: from the drafter's `dflash_config` (the loader would read the same there;
    written out so the config says what it serves);
  * max_concurrency or draft_len_schedule, only from a measured cost table (`schedule_from_costs`): the two are
    mutually exclusive (DecodingBaseConfig's validator), the schedule's smallest batch size must map to
    max_draft_len and no draft length may exceed it (validate_draft_len_schedule_and_sort). A schedule {b: k}
    means batch sizes up to b draft k tokens; above its largest key speculation is off.

DFlash 2 drafters (z-lab's `DFlash2DraftModel`) take the same speculative_config: TensorRT-LLM's DFlash 2 code
(NVIDIA/TensorRT-LLM pull request 18155, "[TRTLLM-15788][feat] Add dflash 2 support": in
tensorrt_llm/_torch/models/modeling_dflash.py as that pull request leaves it, `_is_dflash2_architecture`,
`_validate_dflash2_config`, `_load_dflash2_weights`) keys DFlash 2 off the draft checkpoint, not off a decoding_type,
so what differs is what the folder must hold (`dflash2_problems`). Target families (qwen3_5,
qwen3_5_moe, gpt_oss, gemma4 beside qwen3 / llama ...) are TensorRT-LLM's own PyTorch models: the config needs
nothing per family, but the drafter's target_layer_ids and fc width must fit the target's text model
(`target_problems`, which reads `text_config` where multimodal wrappers keep it).

Attention: DFlashForCausalLM's block decode defaults to its VANILLA backend, which imports `flash_attn_with_kvcache`
from the flash-attn package (tensorrt_llm/_torch/speculative/dflash_attention.py, get_dflash_flash_attention:
"DFlash VANILLA attention requires the flash-attn package"); the TRTLLM backend (`attention_backend: TRTLLM`) needs
SM100 / SM103 (Blackwell) and FlashInfer there (DFlashDecodingConfig.attention_backend's description). So on GPUs
before Blackwell, install flash-attn next to TensorRT-LLM (`ATTENTION_NOTE`).

The 1.2 engine path (`dflash-trt build-target`, TensorRT-LLM 1.2 in Triton's 26.03-26.07 images) is the other
way to serve on a GPU: see docs/gpu.md for which fits which container. NOT RUN against a real TensorRT-LLM here
(none in this workplace): the field list and the loader's expectations are checked in tests against the sources.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..costgrid import TRTLLM_ENGINE, CostGridMismatch, check_grid_matches, config_dtype, read_target_config

# DFlashDecodingConfig.attention_backend's field description (llm_args.py, same snapshot): TRTLLM runs on
# SM100 / SM103 and needs FlashInfer there
ATTENTION_NOTE = (
    "TensorRT-LLM's default DFlash attention backend (VANILLA) needs the flash-attn package "
    "(pip install flash-attn) on GPUs before Blackwell; on Blackwell (SM100 / SM103) --attention-backend TRTLLM "
    "needs no flash-attn but needs FlashInfer"
)
ATTENTION_BACKENDS = ("VANILLA", "TRTLLM")  # DFlashDecodingConfig.attention_backend (llm_args.py, same snapshot)
# z-lab's DFlash 2 recipe, read from dflash_config only by TensorRT-LLM (_validate_dflash2_config: all four >= 1,
# selector_top_k >= 2)
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
SELECTOR_WEIGHTS = ("predecessor_codebook", "successor_codebook", "hidden_projection.weight")


class ServeConfigError(ValueError):
    """The drafter or the cost table cannot give a valid trtllm-serve DFlash config (the message says why)."""


def _drafter_config(drafter_dir: Path) -> dict[str, Any]:
    path = drafter_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"drafter checkpoint not found: {path}")
    cfg: dict[str, Any] = json.loads(path.read_text())
    return cfg


def _weight_shapes(drafter_dir: Path) -> dict[str, list[int]]:
    """Every tensor's name and shape, from the safetensors headers (no weights read)."""
    import struct

    shapes: dict[str, list[int]] = {}
    for f in sorted(drafter_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        shapes.update({k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


def _weight_keys(drafter_dir: Path) -> list[str]:
    return list(_weight_shapes(drafter_dir))


def is_dflash2(cfg: dict[str, Any]) -> bool:
    """TensorRT-LLM's test (modeling_dflash.py): "dflash2" in an architecture name, or a DFlash 2 field set."""
    dflash = cfg.get("dflash_config") or {}
    archs = [str(a).lower().replace("_", "").replace("-", "") for a in cfg.get("architectures") or []]
    return any("dflash2" in a for a in archs) or any(
        int(dflash.get(k) or 0) > 0 for k in ("conv_kernel_size", "selector_rank")
    )


def block_size_of(cfg: dict[str, Any]) -> Any:
    """The drafter's block size as TensorRT-LLM's DFlash 2 code reads it: dflash_config first, then the top level."""
    return (cfg.get("dflash_config") or {}).get("block_size", cfg.get("block_size"))


def dflash2_problems(cfg: dict[str, Any], shapes: dict[str, list[int]]) -> list[str]:
    """What TensorRT-LLM's DFlash 2 loader (`_validate_dflash2_config`, `_load_dflash2_weights`) would refuse."""
    dflash = cfg.get("dflash_config") or {}
    problems = []
    for name in DFLASH2_FIELDS:
        if not int(dflash.get(name) or 0) >= 1:
            where = " (it is at the top level; TensorRT-LLM reads dflash_config only)" if cfg.get(name) else ""
            problems.append(f"no dflash_config.{name}{where}")
    if problems:
        return problems
    taps, group, rank = (int(dflash[k]) for k in DFLASH2_FIELDS[:3])
    hidden = int(cfg.get("hidden_size", 0))
    if int(dflash["selector_top_k"]) < 2:
        problems.append("dflash_config.selector_top_k < 2 leaves the selector nothing to choose between")
    if not hidden or hidden % group:
        return problems + [f"conv_group_size {group} does not divide hidden_size {hidden}"]
    want = {"base_kernel": [2, taps, hidden], "kernel_projection.weight": [2 * taps * hidden // group, hidden]}
    for layer in range(int(cfg.get("num_hidden_layers", 0))):
        for conv in ("attention_conv", "mlp_conv"):
            for name, shape in want.items():
                problems += _shape_problem(shapes, f"layers.{layer}.{conv}.{name}", shape)
    vocab = int(cfg.get("vocab_size", 0))
    for name, shape in zip(SELECTOR_WEIGHTS, ([vocab, rank], [vocab, rank], [rank, hidden])):
        problems += _shape_problem(shapes, f"candidate_selector.{name}", shape)
    return problems


def _shape_problem(shapes: dict[str, list[int]], key: str, shape: list[int]) -> list[str]:
    if key not in shapes:
        if key + ".weight" in shapes:  # what the reference's save_pretrained writes for its nn.Embedding codebooks
            return [
                f"weight {key}.weight must be named {key} (the published spelling, which TensorRT-LLM's loader and the "
                "reference's from_pretrained key_mapping read)"
            ]
        return [f"weights lack {key} (DFlash 2)"]
    return [] if shapes[key] == shape else [f"weight {key} has shape {shapes[key]}, the loader expects {shape}"]


LAYER_KEY = re.compile(r"^(model\.)?layers\.(\d+)\.")


def drafter_problems(drafter_dir: str | Path) -> list[str]:
    """What TensorRT-LLM's DFlash draft loader would trip on in this folder (empty: it loads as it is).

    The loader's expectations (tensorrt_llm/_torch/models/modeling_dflash.py, DFlashForCausalLM, same snapshot):
      * the backbone class from `architectures`, else from `model_type` ("qwen3" -> Qwen3ForCausalLM), so a
        model_type must be there;
      * `dflash_config.mask_token_id` (else `mask_token_id`, else vocab_size: a token the embedding lacks) and
        `dflash_config.target_layer_ids`; `block_size` (dflash_config's first, then the top level's);
      * weights: `fc.weight`, `hidden_norm.weight`, `norm.weight` and `layers.N.*` (a `model.` prefix is
        accepted), no embed_tokens / lm_head needed (shared from the target); one num_key_value_heads for
        every layer (the fused context K/V); a layer count matching num_hidden_layers;
      * a DFlash 2 drafter: its recipe and weights (`dflash2_problems`).
    """
    drafter_dir = Path(drafter_dir)
    cfg = _drafter_config(drafter_dir)
    problems = []
    if not cfg.get("model_type"):
        problems.append("config.json has no model_type (the loader picks the backbone class from it)")
    dflash = cfg.get("dflash_config")
    if not isinstance(dflash, dict):
        problems.append("config.json has no dflash_config object")
        dflash = {}
    if not isinstance(dflash.get("mask_token_id", cfg.get("mask_token_id")), int):
        problems.append("no dflash_config.mask_token_id: the loader would use vocab_size, outside the embedding")
    ids = dflash.get("target_layer_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
        problems.append("no dflash_config.target_layer_ids (the target layers whose hidden states are captured)")
    if not isinstance(block_size_of(cfg), int):
        problems.append("no block_size (the loader reads dflash_config.block_size, else the top-level block_size)")
    if (
        isinstance(cfg.get("num_key_value_heads_per_layer"), list)
        and len(set(cfg["num_key_value_heads_per_layer"])) > 1
    ):
        problems.append("num_key_value_heads differs between layers (the fused context K/V needs one)")
    shapes = _weight_shapes(drafter_dir)
    keys = list(shapes)
    if not keys:
        problems.append(f"no *.safetensors weights in {drafter_dir}")
        return problems
    dflash2 = is_dflash2(cfg)
    if dflash2:
        problems += dflash2_problems(cfg, shapes)
    for needed in ("fc.weight", "hidden_norm.weight"):
        if needed not in keys:
            problems.append(f"weights lack {needed} (the projection of the target's hidden states)")
    if "norm.weight" not in keys and "model.norm.weight" not in keys:
        problems.append("weights lack norm.weight (the drafter's final norm)")
    layers = set()
    for k in keys:
        m = LAYER_KEY.match(k)
        if m:
            layers.add(int(m.group(2)))
        elif k not in ("fc.weight", "hidden_norm.weight", "norm.weight", "model.norm.weight") and not k.startswith(
            ("model.embed_tokens.", "lm_head.", "embed_tokens.", *(("candidate_selector.",) if dflash2 else ()))
        ):
            problems.append(f"weight {k!r} has no place in the DFlash draft model")
    if layers != set(range(int(cfg.get("num_hidden_layers", -1)))):
        problems.append(
            f"weights hold layers {sorted(layers)}, config.json says num_hidden_layers {cfg.get('num_hidden_layers')}"
        )
    return problems


def target_problems(target_dir: str | Path, drafter_dir: str | Path) -> list[str]:
    """Whether the drafter fits this target as TensorRT-LLM reads both: the feature layers inside the target's text
    model (multimodal wrappers such as qwen3_5 and gemma4 keep it under text_config), fc as wide as those layers'
    features together, the mask token inside the target's vocabulary (the drafter shares its embedding)."""
    text = read_target_config(target_dir)
    cfg = _drafter_config(Path(drafter_dir))
    ids = [int(i) for i in cfg["dflash_config"]["target_layer_ids"]]
    layers, hidden, vocab = (int(text.get(k, 0)) for k in ("num_hidden_layers", "hidden_size", "vocab_size"))
    problems = []
    outside = [i for i in ids if not 0 <= i < layers]
    if outside:
        problems.append(f"target_layer_ids {outside} outside the target's {layers} layers")
    fc = _weight_shapes(Path(drafter_dir)).get("fc.weight")
    if fc is not None and fc[1] != len(ids) * hidden:
        problems.append(f"fc takes {fc[1]} features, the target gives {len(ids)} layers x hidden_size {hidden}")
    mask = cfg["dflash_config"].get("mask_token_id", cfg.get("mask_token_id"))
    if isinstance(mask, int) and not 0 <= mask < vocab:
        problems.append(f"mask_token_id {mask} outside the target's vocabulary ({vocab})")
    return problems


def _solve_alpha(tau: float, block: int) -> float:
    """The per-position acceptance alpha whose expected committed tokens at `block` equal tau (bisection)."""
    from ..decoding.estimates import expected_tokens

    if not 1.0 <= tau <= block:
        raise ServeConfigError(f"tau {tau} outside [1, block size {block}]")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, block) < tau else (lo, mid)
    return (lo + hi) / 2


def read_cost_table(path: str | Path, context: int | None = None) -> tuple[Any, Any, int]:
    """(target EngineCost, drafter EngineCost, context) from a cost-grid JSON (scripts/gpu_bare.py writes one).

    Format: {"target": [{"rows", "tokens_per_row", "context", "seconds"}...], "drafter": [...same...]}; the
    entries at the context nearest `context` (default: the largest measured) are fitted, tokens = rows x
    tokens_per_row."""
    from ..decoding.cost import EngineCost

    raw = json.loads(Path(path).read_text())
    try:
        contexts = sorted({int(e["context"]) for e in raw["target"]})
        chosen = max(contexts) if context is None else min(contexts, key=lambda c: abs(c - context))
        fits = []
        for kind in ("target", "drafter"):
            samples = [
                (int(e["rows"]), int(e["rows"]) * int(e["tokens_per_row"]), float(e["seconds"]))
                for e in raw[kind]
                if int(e["context"]) == chosen
            ]
            fits.append(EngineCost.fit(samples))
    except (KeyError, TypeError, ValueError) as e:
        raise ServeConfigError(f"{path} is not a cost grid ({type(e).__name__}: {e})") from None
    return fits[0], fits[1], chosen


def schedule_from_costs(
    target: Any, drafter: Any, alpha: float, block_size: int, batch_sizes: Sequence[int]
) -> dict[int, int]:
    """Per batch size b, the draft length k (0..block_size-1) that maximises committed tokens per second:
    b x E(alpha, k + 1) / (target(b, b (k + 1)) + [k > 0] drafter(b, b x block_size)). The drafter runs its whole
    block whatever k is (one pass over the mask slots)."""
    from ..decoding.estimates import expected_tokens

    best: dict[int, int] = {}
    for b in sorted(set(batch_sizes)):
        rates = []
        for k in range(block_size):
            seconds = target(b, b * (k + 1)) + (drafter(b, b * block_size) if k else 0.0)
            rates.append((b * expected_tokens(alpha, k + 1) / seconds if seconds > 0 else 0.0, k))
        best[b] = max(rates)[1]
    return best


def speculation_limits(best: dict[int, int]) -> dict[str, Any]:
    """The DecodingBaseConfig keys for a per-batch-size choice: max_draft_len, plus max_concurrency (drafting
    at one length up to a batch size, then off) or draft_len_schedule (keys: the last batch size of each run
    of equal lengths; values <= max_draft_len, the smallest key's = max_draft_len)."""
    sizes = sorted(best)
    first = best[sizes[0]]
    if first == 0:
        raise ServeConfigError("drafting pays at no measured batch size: serve the target alone")
    out: dict[str, Any] = {"max_draft_len": first}
    lengths = [min(best[b], first) for b in sizes]
    if all(k in (first, 0) for k in lengths):
        on = [b for b, k in zip(sizes, lengths) if k]
        # on stays a prefix when drafting stops paying past a size; otherwise a schedule says it exactly
        if on == sizes[: len(on)]:
            if len(on) < len(sizes):
                out["max_concurrency"] = on[-1]
            return out
    schedule: dict[int, int] = {}
    for i, (b, k) in enumerate(zip(sizes, lengths)):
        if i + 1 < len(sizes) and lengths[i + 1] == k:
            continue
        schedule[b] = k
    schedule = {b: k for b, k in schedule.items() if k > 0} or {sizes[0]: first}
    if schedule[min(schedule)] != first:
        schedule[sizes[0]] = first
        schedule = dict(sorted(schedule.items()))
    out["draft_len_schedule"] = schedule
    return out


def serve_config(
    drafter_dir: str | Path,
    *,
    cost_table: str | Path | None = None,
    tau: float | None = None,
    context: int | None = None,
    target_dir: str | Path | None = None,
    tp: int = 1,
    attention_backend: str | None = None,
) -> dict[str, Any]:
    """The trtllm-serve --config mapping for this drafter (raises ServeConfigError when it would not load, or does
    not fit `target_dir`). A cost table must have been measured on this target (`target_dir`'s shape) at this `tp`,
    on TensorRT-LLM in the checkpoint's dtype (dflash_trt.costgrid). attention_backend: DFlashDecodingConfig's
    (None: TensorRT-LLM's default, VANILLA)."""
    drafter_dir = Path(drafter_dir)
    problems = drafter_problems(drafter_dir)
    if target_dir is not None and not problems:
        problems = target_problems(target_dir, drafter_dir)
    if problems:
        raise ServeConfigError(f"{drafter_dir} would not load as a TensorRT-LLM DFlash drafter: " + "; ".join(problems))
    cfg = _drafter_config(drafter_dir)
    block = int(block_size_of(cfg))
    spec: dict[str, Any] = {
        "decoding_type": "DFlash",
        "max_draft_len": block - 1,
        "speculative_model": str(drafter_dir.resolve()),
        "target_layer_ids": [int(i) for i in cfg["dflash_config"]["target_layer_ids"]],
        "mask_token_id": int(cfg["dflash_config"].get("mask_token_id", cfg.get("mask_token_id"))),
    }
    if attention_backend is not None:
        if attention_backend not in ATTENTION_BACKENDS:
            raise ServeConfigError(f"attention backend {attention_backend!r}: one of {', '.join(ATTENTION_BACKENDS)}")
        spec["attention_backend"] = attention_backend
    if cost_table is not None:
        if tau is None:
            raise ServeConfigError("a cost table needs --tau (the drafter's measured mean acceptance length)")
        if target_dir is None:
            raise ServeConfigError("a cost table needs the target it was measured on (--target)")
        target, drafter, _ = read_cost_table(cost_table, context)
        raw = json.loads(Path(cost_table).read_text())
        try:
            config = read_target_config(target_dir)
            # trtllm-serve runs the target on TensorRT-LLM, in the checkpoint's dtype (its dtype "auto")
            check_grid_matches(
                raw, config, tp, source=f"cost table {cost_table}", engine=TRTLLM_ENGINE, dtype=config_dtype(config)
            )
        except CostGridMismatch as e:
            raise ServeConfigError(str(e)) from None
        sizes = sorted({int(e["rows"]) for e in raw["target"]})
        best = schedule_from_costs(target, drafter, _solve_alpha(tau, block), block, sizes)
        spec.update(speculation_limits(best))
    return {"speculative_config": spec}


def to_yaml(mapping: dict[str, Any], indent: int = 0) -> str:
    """Block-style YAML for what serve_config returns (nested mappings, scalars, lists of scalars)."""
    lines = []
    pad = " " * indent
    for key, value in mapping.items():
        if isinstance(value, dict):
            lines.append(f"{pad}{key}:")
            lines.append(to_yaml(value, indent + 2).rstrip("\n"))
        else:
            lines.append(f"{pad}{key}: {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def serve_command(target_dir: str | Path, config_file: str | Path) -> list[str]:
    """How to start it: trtllm-serve takes the target as its model argument and the YAML as --config."""
    return ["trtllm-serve", str(Path(target_dir).resolve()), "--backend", "pytorch", "--config", str(config_file)]
