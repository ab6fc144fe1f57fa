"""TensorRT drafter build and runtime against a FAKE `tensorrt` module (tests/fake_tensorrt.py):
no TensorRT or GPU exists here. These check our call sequence only: a profile for every dynamic
input, FP16 handled per major version (10: BuilderFlag.FP16 or strongly typed; 11: strongly typed
only), the manifest, and every tensor bound by name to the buffer that carries it."""

import json
import sys

import pytest
import torch
from fake_tensorrt import FAKE_CONTEXT_MEMORY, FILL, make

from dflash_trt.builders import trt_drafter
from dflash_trt.formats import DrafterGraphMeta
from dflash_trt.runtime.base import EngineUnavailable

META = DrafterGraphMeta(
    block_size=8,
    mask_token_id=95,
    feature_layer_ids=(1, 2),
    feature_size=128,
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=96,
    max_context=512,
)


@pytest.fixture
def graph_dir(tmp_path):
    d = tmp_path / "onnx"
    d.mkdir()
    for name in ("drafter.onnx", "drafter.onnx.data", "drafter_fp16.onnx", "drafter_fp16.onnx.data"):
        (d / name).write_bytes(name.encode())
    (d / "drafter.json").write_text(META.to_json())
    return d


def install(monkeypatch, version, io=None):
    calls = []
    monkeypatch.setitem(sys.modules, "tensorrt", make(version, calls, io))
    return calls


def test_tensorrt_missing_is_a_clear_error(monkeypatch, graph_dir, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import raises ImportError
    with pytest.raises(EngineUnavailable, match="needs the `tensorrt` package"):
        trt_drafter.build_drafter_plan(graph_dir, tmp_path / "plan")


def test_build_sequence_trt10_weak_typing(monkeypatch, graph_dir, tmp_path):
    calls = install(monkeypatch, "10.14.1.48")
    plan = trt_drafter.build_drafter_plan(
        graph_dir, tmp_path / "plan", typing="weak", max_context=256, max_new_tokens=128
    )
    kinds = [c[0] for c in calls]
    # order: network (no strong typing flag) -> parse the fp32 graph from file -> FP16 flag -> profile -> build
    assert ("create_network", 0) in calls
    assert ("parse_from_file", str(graph_dir / "drafter.onnx")) in calls
    assert ("set_flag", "FP16") in calls
    assert kinds.index("parse_from_file") < kinds.index("profile.set_shape") < kinds.index("build_serialized_network")
    shapes = {c[1]: c[2:] for c in calls if c[0] == "profile.set_shape"}
    assert set(shapes) == {"block_ids", "features", "past_k", "past_v"}  # every dynamic input
    assert shapes["block_ids"] == ((1, 2), (1, 8), (1, 8))
    assert shapes["features"] == ((1, 1, 128), (1, 8, 128), (1, 128, 128))
    assert shapes["past_k"] == ((2, 1, 2, 0, 16), (2, 1, 2, 128, 16), (2, 1, 2, 256, 16))  # T = 0: first round
    assert shapes["past_v"] == shapes["past_k"]
    assert ("add_optimization_profile", ["block_ids", "features", "past_k", "past_v"]) in calls
    assert plan.read_bytes() == b"FAKE-PLAN"
    manifest = json.loads((tmp_path / "plan" / "drafter.plan.json").read_text())
    assert manifest["tensorrt_version"] == "10.14.1.48" and manifest["typing"] == "weak"
    assert set(manifest["input_sha256"]) == {"drafter.onnx", "drafter.onnx.data", "drafter.json"}
    assert manifest["profile"]["past_k"]["max"] == [2, 1, 2, 256, 16]
    # the built plan is loaded once to record each execution context's activation memory (the executor's plan)
    assert kinds.index("build_serialized_network") < kinds.index("deserialize_cuda_engine")
    assert manifest["context_device_memory"] == FAKE_CONTEXT_MEMORY


def test_trt10_strongly_typed_uses_fp16_graph_and_no_flag(monkeypatch, graph_dir, tmp_path):
    calls = install(monkeypatch, "10.14.1.48")
    trt_drafter.build_drafter_plan(graph_dir, tmp_path / "plan", typing="strong")
    assert ("create_network", 1 << 1) in calls
    assert ("parse_from_file", str(graph_dir / "drafter_fp16.onnx")) in calls
    assert not [c for c in calls if c[0] == "set_flag"]


def test_trt10_defaults_to_strong_typing(monkeypatch, graph_dir, tmp_path):
    """The fp16 graph keeps its norms in fp32 and a strongly typed build follows its casts; weak typing would let
    TensorRT choose fp16 for the norms' squares."""
    calls = install(monkeypatch, "10.14.1.48")
    trt_drafter.build_drafter_plan(graph_dir, tmp_path / "plan")
    assert ("create_network", 1 << 1) in calls
    assert ("parse_from_file", str(graph_dir / "drafter_fp16.onnx")) in calls
    assert json.loads((tmp_path / "plan" / "drafter.plan.json").read_text())["typing"] == "strong"


def test_trt11_is_strongly_typed_only(monkeypatch, graph_dir, tmp_path):
    calls = install(monkeypatch, "11.0.0")
    trt_drafter.build_drafter_plan(graph_dir, tmp_path / "plan")
    assert ("parse_from_file", str(graph_dir / "drafter_fp16.onnx")) in calls
    assert not [c for c in calls if c[0] == "set_flag"]  # BuilderFlag.FP16 does not exist in 11
    with pytest.raises(ValueError, match="strongly typed"):
        trt_drafter.build_drafter_plan(graph_dir, tmp_path / "plan2", typing="weak")


def test_trt8_is_refused(monkeypatch, graph_dir, tmp_path):
    install(monkeypatch, "8.6.1")
    with pytest.raises(EngineUnavailable, match="TensorRT 8.x is not supported"):
        trt_drafter.build_drafter_plan(graph_dir, tmp_path / "plan")


def test_runtime_binds_every_tensor_by_name(monkeypatch, graph_dir, tmp_path):
    L, H, D = META.num_layers, META.num_kv_heads, META.head_dim
    io = {
        "block_ids": (True, "int64", None),
        "features": (True, "float32", None),
        "past_k": (True, "float32", None),
        "past_v": (True, "float32", None),
        "logits": (False, "float32", lambda s: (1, s["block_ids"][1] - 1, META.vocab_size)),
        "draft_tokens": (False, "int64", lambda s: (1, s["block_ids"][1] - 1)),
        "present_k": (False, "float32", lambda s: (L, 1, H, s["past_k"][3] + s["features"][1], D)),
        "present_v": (False, "float32", lambda s: (L, 1, H, s["past_v"][3] + s["features"][1], D)),
    }
    calls = install(monkeypatch, "10.14.1.48")
    trt_drafter.build_drafter_plan(graph_dir, tmp_path / "plan", max_context=100)
    calls = install(monkeypatch, "10.14.1.48", io)
    from dflash_trt.runtime.rows import PerRowDrafter
    from dflash_trt.runtime.trt_backend import TrtDrafterEngine, TrtDrafterSequence

    engine = TrtDrafterEngine(tmp_path / "plan", device="cpu")  # cpu: the fake writes through host addresses
    assert ("deserialize_cuda_engine", b"FAKE-PLAN") in calls
    assert engine.max_context == 100  # the profile's largest cache length: the loop refuses longer requests
    rows = engine.new_session()  # one execution context per row
    assert isinstance(rows, PerRowDrafter)
    session = rows.sequences[rows.add_row()]
    assert isinstance(session, TrtDrafterSequence)
    for n_new, expected_ctx in ((5, 5), (2, 7)):
        calls.clear()
        draft = session.draft(torch.randn(n_new, 128), last_token=3, block_size=6)
        shapes = {c[1]: c[2] for c in calls if c[0] == "set_input_shape"}
        assert shapes == {
            "block_ids": (1, 6),
            "features": (1, n_new, 128),
            "past_k": (L, 1, H, expected_ctx - n_new, D),
            "past_v": (L, 1, H, expected_ctx - n_new, D),
        }
        bound = [c[1] for c in calls if c[0] == "set_tensor_address"]
        assert sorted(bound) == sorted(io)  # every input and output, by name
        assert [c[0] for c in calls][-1] == "execute_async_v3"
        # outputs were read from the buffers bound to their own names
        assert draft.tokens.tolist() == [FILL["draft_tokens"]] * 5
        assert draft.logits.shape == (5, 96) and torch.all(draft.logits == FILL["logits"])
        assert session.context_length == expected_ctx
        assert torch.all(session.past_k == FILL["present_k"]) and torch.all(session.past_v == FILL["present_v"])


def test_runtime_refuses_plan_from_another_version(monkeypatch, graph_dir, tmp_path):
    install(monkeypatch, "10.14.1.48")
    trt_drafter.build_drafter_plan(graph_dir, tmp_path / "plan")
    install(monkeypatch, "10.13.0.35", {})
    from dflash_trt.runtime.trt_backend import TrtDrafterEngine

    with pytest.raises(EngineUnavailable, match="built with TensorRT 10.14.1.48.*rebuild"):
        TrtDrafterEngine(tmp_path / "plan", device="cpu")


def test_runtime_refuses_a_shape_outside_the_profile_and_converts_fp16_outputs(monkeypatch, graph_dir, tmp_path):
    """An fp16 plan: features, cache and logits in float16 (the real runtime's buffers), profile up to 12 cached
    tokens. The session hands the loop float32 logits, keeps its cache in float16, and a round whose cache
    would leave the profile fails with the reason instead of running on stale shapes."""
    L, H, D = META.num_layers, META.num_kv_heads, META.head_dim
    cache = ((L, 1, H, 0, D), (L, 1, H, 12, D))
    io = {
        "block_ids": (True, "int64", ((1, 1), (1, 16))),
        "features": (True, "float16", ((1, 1, 128), (1, 12, 128))),
        "past_k": (True, "float16", cache),
        "past_v": (True, "float16", cache),
        "logits": (False, "float16", lambda s: (1, s["block_ids"][1] - 1, META.vocab_size)),
        "draft_tokens": (False, "int64", lambda s: (1, s["block_ids"][1] - 1)),
        "present_k": (False, "float16", lambda s: (L, 1, H, s["past_k"][3] + s["features"][1], D)),
        "present_v": (False, "float16", lambda s: (L, 1, H, s["past_v"][3] + s["features"][1], D)),
    }
    install(monkeypatch, "10.14.1.48")
    trt_drafter.build_drafter_plan(graph_dir, tmp_path / "plan", max_context=12)
    calls = install(monkeypatch, "10.14.1.48", io)
    from dflash_trt.runtime.trt_backend import TrtDrafterEngine

    engine = TrtDrafterEngine(tmp_path / "plan", device="cpu")
    rows = engine.new_session()
    session = rows.sequences[rows.add_row()]
    draft = session.draft(torch.randn(8, 128), last_token=3, block_size=6)
    assert draft.logits.dtype == torch.float32 and torch.all(draft.logits == FILL["logits"])
    assert session.past_k.dtype == torch.float16 and torch.all(session.past_k == FILL["present_k"])
    fed = [c for c in calls if c[0] == "set_input_shape" and c[1] == "past_k"]
    assert fed[-1][2][3] == 0
    session.draft(torch.randn(6, 128), last_token=3, block_size=6)  # a cache of 8 is within the profile
    assert session.context_length == 14  # present = past + features: the next round's cache is 14 > 12
    with pytest.raises(ValueError, match=r"TensorRT refused past_k of shape .*outside the plan's optimization"):
        session.draft(torch.randn(1, 128), last_token=3, block_size=6)
