"""Export the drafter round to ONE ONNX graph.

Inputs:  block_ids [1, B] int64 ([last token, MASK x (B-1)]), features [1, n, F] float32
         (target features of the n tokens committed since the last round), past_k / past_v
         [layers, 1, kv_heads, T, head_dim] float32 (the drafter's context cache).
Outputs: logits [1, B-1, V] float32, draft_tokens [1, B-1] int64 (argmax), present_k /
         present_v [layers, 1, kv_heads, T+n, head_dim]; a DFlash 2 drafter's graph adds candidates
         [1, B-1, k] and step_scores [1, B-1, k, k] (formats.SELECTOR_OUTPUTS).

DFlash 2's candidate selector sits half inside the graph, half beside it: the graph computes the top-k
candidates and the score of every (predecessor, candidate) pair (models/selector.py), the runtime walks the
path through them (greedy, or sampled at T > 0) on the host or GPU next to the graph. The walk is B-1 steps
of k numbers each, data-dependent and sequential; outside the graph it stays one graph for greedy and
sampled decoding, and the same walk serves ONNX Runtime and the TensorRT plan (built from this graph).

The embedding table and lm_head are the TARGET's (the drafter checkpoint has neither). The
cache is explicit, so one round costs O(n + B) drafter compute whatever the context length.
Beside the graph we write `drafter.json` (dflash_trt.formats.DrafterGraphMeta): what a runtime needs to
drive it without torch (block size, mask token, feature layers, cache geometry).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

import torch
from torch import nn

from ..formats import DRAFTER_INPUTS, DRAFTER_OUTPUTS, GRAPH_FILES, META_FILE, DrafterGraphMeta
from ..models.drafter import DFlashDrafter

if TYPE_CHECKING:
    import onnx

# Example sizes for tracing: all >= 2 and distinct, or the exporter fixes the axis (0/1 specialise).
EXAMPLE_NEW, EXAMPLE_PAST = 3, 5
RoundModule = TypeVar("RoundModule", bound=nn.Module)


class DrafterRound(nn.Module):
    """drafter + the target's embedding and lm_head + argmax: exactly what one round computes."""

    embed_weight: torch.Tensor  # buffers (registered in __init__)
    lm_head_weight: torch.Tensor

    def __init__(self, drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        self.drafter = drafter.eval()
        # Copies as buffers so the graph owns them (the target may tie or shard its own).
        self.register_buffer("embed_weight", embed_weight.detach().clone(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach().clone(), persistent=False)

    def forward(
        self, block_ids: torch.Tensor, features: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        d = self.drafter
        hidden, present_k, present_v = d(features, d.embed_block(block_ids, self.embed_weight), past_k, past_v)
        return round_outputs(d, hidden[:, 1:], block_ids[:, 0], self.lm_head_weight, present_k, present_v)


def round_outputs(
    d: DFlashDrafter,
    hidden: torch.Tensor,
    anchor: torch.Tensor,
    lm_head_weight: torch.Tensor,
    present_k: torch.Tensor,
    present_v: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """A round graph's outputs in order: logits, draft_tokens, present_k, present_v (+ DFlash 2's selector)."""
    logits, tokens, candidates, scores = d.block_outputs(hidden, anchor, lm_head_weight, walk=False)
    if candidates is None or scores is None:
        return logits, tokens, present_k, present_v
    return logits, tokens, present_k, present_v, candidates, scores


def graph_meta(drafter: DFlashDrafter, vocab_size: int) -> DrafterGraphMeta:
    return DrafterGraphMeta(
        block_size=drafter.spec.block_size,
        mask_token_id=drafter.spec.mask_token_id,
        feature_layer_ids=tuple(drafter.spec.target_layer_ids),
        feature_size=drafter.feature_size,
        num_layers=len(drafter.layers),
        num_kv_heads=drafter.n_kv_heads,
        head_dim=drafter.head_dim,
        vocab_size=vocab_size,
        max_context=int(drafter.config.max_position_embeddings),
        selector_top_k=drafter.spec.selector_top_k,
    )


def example_inputs(
    meta: DrafterGraphMeta, new: int = EXAMPLE_NEW, past: int = EXAMPLE_PAST, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    block = block or meta.block_size
    g = torch.Generator().manual_seed(0)
    ids = torch.full((1, block), meta.mask_token_id, dtype=torch.long)
    ids[0, 0] = 1
    return (
        ids,
        torch.randn(1, new, meta.feature_size, generator=g),
        torch.randn(meta.cache_shape(past), generator=g) * 0.1,
        torch.randn(meta.cache_shape(past), generator=g) * 0.1,
    )


def export_round(module: DrafterRound, meta: DrafterGraphMeta, path: Path) -> Path:
    """torch.onnx.export (dynamo) with dynamic B, n, T; weights go to `<path>.data`."""
    Dim = torch.export.Dim
    # Block of 2 tokens at least (1 draft); T from 0 (first round): the exporter is given
    # min=0 but traces at T=5 so it does not specialise; T=0 is checked at run time by tests.
    b = Dim("block", min=2, max=max(meta.block_size, 2))
    n = Dim("new_tokens", min=1, max=meta.max_context)
    t = Dim("cache_len", min=0, max=meta.max_context)
    dynamic_shapes = {
        "block_ids": {1: b},
        "features": {1: n},
        "past_k": {3: t},
        "past_v": {3: t},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            example_inputs(meta),
            dynamic_shapes=dynamic_shapes,
            input_names=list(DRAFTER_INPUTS),
            output_names=list(meta.output_names(DRAFTER_OUTPUTS)),
            dynamo=True,
            external_data=True,
            optimize=True,
            verbose=False,
        )
        assert program is not None  # dynamo=True returns the program
        program.save(str(path), external_data=True)
    return path


def to_fp16(src: Path, dst: Path) -> Path:
    """fp16 weights and math, fp32 inputs/outputs (so callers and caches stay fp32), and every RMS norm's
    arithmetic in fp32 (norm_node_names): a norm squares its input, and the target's hidden states, which the
    drafter's first norm receives through `fc`, reach hundreds to thousands on 7B-70B targets (single "massive
    activations" too): a square above 65,504 is inf in fp16, and the mean of the squares of a row whose RMS is
    above 256 is too, whatever the kernel accumulates in. The norm's output (x / RMS(x), times its weight) is of
    order one and goes back to fp16."""
    import onnx
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    model = onnx.load(str(src), load_external_data=True)
    half = convert_float_to_float16(
        model, keep_io_types=True, op_block_list=DEFAULT_OP_BLOCK_LIST, node_block_list=norm_node_names(model.graph)
    )
    _join_fp32_casts(half.graph)
    _sort_nodes(half.graph)  # the converter appends its input casts at the end of the node list
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(
        half, str(dst), save_as_external_data=True, all_tensors_to_one_file=True, location=dst.name + ".data"
    )
    return dst


NORM_CHAIN_OPS = ("Add", "Sqrt", "Reciprocal")  # mean(x^2) + eps -> sqrt -> 1 / ...: the exporter's rsqrt


def norm_node_names(graph: onnx.GraphProto) -> list[str]:
    """The nodes of every RMS norm's arithmetic, as the dynamo exporter writes Qwen3RMSNorm / LlamaRMSNorm
    (x.pow(2).mean(-1) + eps, rsqrt, x * that): Pow -> ReduceMean -> Add -> Sqrt -> Reciprocal -> Mul. Found by
    that shape (a ReduceMean of a Pow, then its chain to the Mul that scales x), not by name."""
    producer = {out: n for n in graph.node for out in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for name in n.input:
            consumers.setdefault(name, []).append(n)
    names: list[str] = []
    for mean in (n for n in graph.node if n.op_type == "ReduceMean"):
        square = producer.get(mean.input[0])
        if square is None or square.op_type != "Pow":
            continue
        chain, node = [square, mean], mean
        while len(users := consumers.get(node.output[0], [])) == 1 and users[0].op_type in NORM_CHAIN_OPS:
            node = users[0]
            chain.append(node)
        chain += [u for u in consumers.get(node.output[0], []) if u.op_type in ("Mul", "Div")]
        names += [n.name for n in chain]
    return names


def _join_fp32_casts(graph: onnx.GraphProto) -> None:
    """Between two fp32 (blocked) nodes the converter writes Cast(to fp16) -> Cast(to fp32): the square that was
    kept in fp32 would overflow in that round trip. The second cast is made to read the first one's input (a cast
    to fp32 of fp32: exact); first casts nobody reads any more are dropped."""
    import onnx

    producer = {out: n for n in graph.node for out in n.output}

    def cast_to(node: onnx.NodeProto | None) -> int | None:
        if node is None or node.op_type != "Cast":
            return None
        return next((a.i for a in node.attribute if a.name == "to"), None)

    for node in graph.node:
        first = producer.get(node.input[0]) if node.input else None
        if cast_to(node) == onnx.TensorProto.FLOAT and first is not None and cast_to(first) == onnx.TensorProto.FLOAT16:
            node.input[0] = first.input[0]
    read = {name for n in graph.node for name in n.input} | {o.name for o in graph.output}
    unread = [n for n in graph.node if cast_to(n) == onnx.TensorProto.FLOAT16 and n.output[0] not in read]
    for n in unread:
        graph.node.remove(n)
    # An initializer only fp32 nodes read stays fp32 (the converter's rule) while the converter's value_info
    # still calls it fp16: ONNX type inference (and a strict checker) refuse the graph for that contradiction.
    initializers = {t.name for t in graph.initializer}
    stale = [v for v in graph.value_info if v.name in initializers]
    for v in stale:
        graph.value_info.remove(v)


def _sort_nodes(graph: onnx.GraphProto) -> None:
    """Topological order of graph.node (ONNX requires it; ORT tolerates it, the checker does not)."""
    ready = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        rest = []
        for node in pending:
            # names from outer scopes used inside subgraphs count as ready; only direct inputs gate a node
            if all(name in ready for name in node.input):
                ordered.append(node)
                ready.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):
            raise ValueError(f"graph has a cycle or a dangling input at node {rest[0].name!r}")
        pending = rest
    nodes = [type(n)() for n in ordered]
    for fresh, node in zip(nodes, ordered):
        fresh.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(nodes)


def check_graph(path: Path) -> None:
    import onnx

    onnx.checker.check_model(str(path), full_check=False)  # path form: works with external data


def export_drafter(
    drafter: DFlashDrafter,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    out_dir: str | Path,
    fp16: bool = True,
) -> dict[str, Path]:
    """Write drafter.onnx (+ .data), optionally drafter_fp16.onnx, and drafter.json into out_dir.

    The caller's drafter is left as it was: the graph is traced from an fp32 copy (callers such as the
    benchmark pass a live bf16/fp16 engine's drafter, which `.float()` / `.eval()` would change in place).
    """
    return write_graphs(drafter, embed_weight, lm_head_weight, out_dir, fp16, DrafterRound, export_round, GRAPH_FILES)


def write_graphs(
    drafter: DFlashDrafter,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    out_dir: str | Path,
    fp16: bool,
    make_round: Callable[[DFlashDrafter, torch.Tensor, torch.Tensor], RoundModule],
    export: Callable[[RoundModule, DrafterGraphMeta, Path], Path],
    names: Mapping[str, str],
) -> dict[str, Path]:
    """Trace `make_round` (over an fp32 copy of the drafter) with `export` into out_dir/names["fp32"], check it,
    optionally convert it to names["fp16"], and write drafter.json; returns the paths by precision (+ "meta")."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = graph_meta(drafter, int(lm_head_weight.shape[0]))
    module = make_round(copy.deepcopy(drafter).float(), embed_weight.float(), lm_head_weight.float())
    files = {"fp32": export(module, meta, out / names["fp32"])}
    check_graph(files["fp32"])
    if fp16:
        files["fp16"] = to_fp16(files["fp32"], out / names["fp16"])
        check_graph(files["fp16"])
    (out / META_FILE).write_text(meta.to_json())
    files["meta"] = out / META_FILE
    return files


def export_from_checkpoints(
    drafter_dir: str | Path, target_dir: str | Path, out_dir: str | Path, fp16: bool = True
) -> dict[str, Path]:
    """Load both checkpoints (fp32), validate the pair, export. Only the target's embedding and lm_head are kept."""
    from ..config import validate_against_target
    from ..models.target import load_target

    target = load_target(target_dir, torch.float32)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch.float32)
    validate_against_target(drafter.config, drafter.spec, target.config)
    embed = cast(torch.Tensor, target.get_input_embeddings().weight)
    head: torch.Tensor = target.get_output_embeddings().weight  # type: ignore[no-untyped-call]  # unannotated
    return export_drafter(drafter, embed, head, out_dir, fp16=fp16)
