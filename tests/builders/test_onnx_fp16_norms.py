"""The fp16 drafter graph keeps every RMS norm's arithmetic in fp32 (builders/onnx_drafter.to_fp16), so the
activations real targets hand the drafter do not overflow its squares. Real onnxruntime sessions.

The drafter's first norm (`hidden_norm`) reads fc(target features). Hidden states of 7B-70B targets have L2 norms
of hundreds to thousands per token, and single "massive activations" of about 2,000-3,000 in a few fixed
channels (Sun et al., "Massive Activations in Large Language Models", 2024: LLaMA2-7B's reach 2,622): a square
above 65,504 (|x| > 256) is inf in fp16. The test scales random features so that the norm's input carries such
channels, and compares the fp16 graph with the fp32 graph of the same drafter."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import make_tiny_pair

from dflash_trt.builders.onnx_drafter import example_inputs, export_drafter, norm_node_names
from dflash_trt.formats import DRAFTER_INPUTS, FP16_GRAPH_FILE, GRAPH_FILE, DrafterGraphMeta

MASSIVE = 2500.0  # the largest entry of the first norm's input: a massive activation's size (see above)
TYPICAL_RMS = 60.0  # the other channels: an L2 norm of about 60 * sqrt(hidden) per token (thousands at 4096)


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    target, drafter = make_tiny_pair(family="qwen3", vocab_size=96, layers=4, drafter_layers=2, block_size=8)
    out = tmp_path_factory.mktemp("onnx-fp16-norms")
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    export_drafter(drafter, embed, head, out, fp16=True)
    sessions = {
        p: ort.InferenceSession(str(out / f), providers=["CPUExecutionProvider"])
        for p, f in (("fp32", GRAPH_FILE), ("fp16", FP16_GRAPH_FILE))
    }
    return out, drafter, sessions


def target_sized_features(drafter, n: int, seed: int) -> torch.Tensor:
    """Features whose projection fc(features), the first norm's input, has channels of RMS TYPICAL_RMS and two
    massive channels of +-MASSIVE (least-squares preimage through fc: the drafter's own fc decides the rest)."""
    g = torch.Generator().manual_seed(seed)
    hidden = drafter.fc.out_features
    wanted = torch.randn(n, hidden, generator=g) * TYPICAL_RMS
    wanted[:, 3], wanted[:, hidden // 2] = MASSIVE, -MASSIVE
    weight = drafter.fc.weight.detach().double()  # [hidden, features]
    feats = torch.linalg.lstsq(weight, wanted.double().T).solution.T  # fc(feats) = wanted (fc has no bias)
    return feats.float()


def run(session, meta, ids, feats, pk, pv):
    return session.run(None, dict(zip(DRAFTER_INPUTS, (ids.numpy(), feats.numpy()[None], pk.numpy(), pv.numpy()))))


def test_features_reach_the_norm_at_target_scale(graphs):
    """The premise: the first norm's input is what the docstring says (so a graph whose squares were fp16
    would see inf)."""
    _, drafter, _ = graphs
    x = drafter.fc(target_sized_features(drafter, 5, seed=0))
    assert x.abs().max() > 2000 and (x.float() ** 2).max() > np.finfo(np.float16).max


@pytest.mark.parametrize("seed", range(4))
def test_fp16_graph_matches_fp32_at_target_activations(graphs, seed):
    out, drafter, sessions = graphs
    meta = DrafterGraphMeta.read(out)
    ids, _, pk, pv = example_inputs(meta, new=4, past=6)
    ids[0, 0] = 7 + seed
    feats = target_sized_features(drafter, 4, seed)
    ref = run(sessions["fp32"], meta, ids, feats, pk, pv)
    got = run(sessions["fp16"], meta, ids, feats, pk, pv)
    for name, b in zip(("logits", "draft_tokens", "present_k", "present_v"), got):
        assert np.isfinite(b.astype(np.float64)).all(), f"fp16 graph: {name} not finite"
    scale = np.abs(ref[0]).max()
    assert np.abs(got[0] - ref[0]).max() <= 0.05 * scale, "fp16 logits are not the fp32 graph's within fp16 rounding"
    top2 = np.sort(ref[0][0], axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.05 * scale  # positions whose top-1 is no near-tie
    np.testing.assert_array_equal(got[1][0][clear], ref[1][0][clear])
    np.testing.assert_allclose(got[2], ref[2], atol=0.05, rtol=0.02)  # the context cache (after the norms)


INTEGER_TYPES = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)


def test_norm_arithmetic_is_fp32_in_the_fp16_graph(graphs):
    """Every node of every norm reads and writes fp32 in the fp16 graph (types as ONNX infers them): what a
    strongly typed TensorRT build (which follows the graph's casts) keeps too."""
    out, _, _ = graphs
    fp32 = onnx.load(str(out / GRAPH_FILE), load_external_data=False)
    half = onnx.shape_inference.infer_shapes(onnx.load(str(out / FP16_GRAPH_FILE), load_external_data=False))
    names = set(norm_node_names(fp32.graph))
    # every ReduceMean of this drafter is a norm's (2 layers x input, post-attention, q and k norms, hidden_norm,
    # the final norm...): each found with its 6 nodes, Pow to the scaling Mul
    norms = sum(n.op_type == "ReduceMean" for n in fp32.graph.node)
    assert norms >= 2 * 4 + 2 and len(names) == 6 * norms
    types = {v.name: v.type.tensor_type.elem_type for v in (*half.graph.value_info, *half.graph.input)}
    types.update({t.name: t.data_type for t in half.graph.initializer})
    for node in half.graph.node:
        if node.name in names:
            for tensor in (*node.input, *node.output):
                if types.get(tensor) in INTEGER_TYPES:  # a ReduceMean's axes (an input from opset 18), not arithmetic
                    continue
                assert types.get(tensor) == onnx.TensorProto.FLOAT, (node.name, tensor, types.get(tensor))
    assert {n.name for n in half.graph.node} >= names


def test_fp16_graph_as_written_stays_finite(graphs):
    """ONNX's reference evaluator runs each node in the dtypes the graph gives it (numpy, node by node), as a
    strictly typed fp16 runtime does (TensorRT builds the fp16 graph strongly typed). ONNX Runtime's CPU provider
    cannot show an fp16 overflow: it runs the ops it has no fp16 kernel for in fp32 and removes the casts between
    them (its InsertCastTransformer), which is why the sessions above agree with or without the fp32 norms."""
    from onnx.reference import ReferenceEvaluator

    out, drafter, sessions = graphs
    meta = DrafterGraphMeta.read(out)
    ids, _, pk, pv = example_inputs(meta, new=3, past=4)
    feats = target_sized_features(drafter, 3, seed=11)
    feeds = dict(zip(DRAFTER_INPUTS, (ids.numpy(), feats.numpy()[None], pk.numpy(), pv.numpy())))
    ref = sessions["fp32"].run(None, feeds)
    with np.errstate(over="ignore", invalid="ignore"):
        got = ReferenceEvaluator(str(out / FP16_GRAPH_FILE)).run(None, feeds)
    assert np.isfinite(got[0]).all(), "the fp16 graph overflows at target-sized activations"
    # an overflowed square makes the mean inf, 1 / sqrt 0 and the normed row 0: finite logits, the wrong ones
    assert np.abs(got[0] - ref[0]).max() <= 0.05 * np.abs(ref[0]).max(), "fp16 logits are not the fp32 graph's"
    top2 = np.sort(ref[0][0], axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.05 * np.abs(ref[0]).max()
    np.testing.assert_array_equal(got[1][0][clear], ref[1][0][clear])
