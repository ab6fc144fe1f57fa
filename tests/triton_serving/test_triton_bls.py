"""The BLS engine adapters and dflash_target's session table, in this process: the same code the
Triton models run (dflash_trt.triton.remote), with the transport swapped for a direct call. The real
transport (tritonserver) is covered by test_triton_server.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import HfSequenceTarget, SequenceTargetEngine, generate_one, make_text_models

from dflash_trt.builders.onnx_drafter import export_from_checkpoints
from dflash_trt.decoding import BatchDecoder, GenerationConfig
from dflash_trt.formats import DrafterGraphMeta
from dflash_trt.loading import load_decoder
from dflash_trt.models.target import load_target, load_tokenizer
from dflash_trt.runtime.ort_backend import OrtDrafterEngine
from dflash_trt.runtime.torch_backend import TorchTargetEngine
from dflash_trt.triton.remote import RemoteDrafterEngine, RemoteTargetEngine, TargetSessions, serve_target

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-bls")
    target_dir, drafter_dir = make_text_models(root)
    export_from_checkpoints(drafter_dir, target_dir, root / "onnx", fp16=False)
    ort_drafter = OrtDrafterEngine(root / "onnx")
    target_engine = TorchTargetEngine(load_target(target_dir), ort_drafter.feature_layer_ids)
    return target_dir, drafter_dir, root / "onnx", ort_drafter, target_engine


def remote_decoder(parts, clock=None):
    """BatchDecoder over RemoteTargetEngine / RemoteDrafterEngine, whose `infer` calls the
    target model's handler and the drafter graph directly. Returns (decoder, the target's sessions)."""
    target_dir, _, onnx_dir, ort_drafter, target_engine = parts
    sessions = TargetSessions(target_engine, ttl_s=60, **({"clock": clock} if clock else {}))
    calls = []

    def infer(model, inputs, outputs):
        calls.append(model)
        if model == "dflash_target":
            out = serve_target(sessions, inputs)
        else:
            out = dict(zip(outputs, ort_drafter.session.run(outputs, inputs)))
        return {name: out[name] for name in outputs}

    meta = DrafterGraphMeta.read(onnx_dir)
    target = RemoteTargetEngine(infer, "dflash_target", meta.vocab_size, 2048, meta.feature_layer_ids)
    drafter = RemoteDrafterEngine(infer, "dflash_drafter", json.loads(meta.to_json()))
    decoder = BatchDecoder(target, drafter, load_tokenizer(target_dir))
    decoder.calls = calls
    return decoder, sessions


def test_remote_engines_equal_the_local_ones(parts):
    """Greedy over the remote adapters == the target alone, with the same drafts (acceptance) as the
    in-process ONNX Runtime drafter: RemoteDrafterEngine reuses ort_backend.RoundGraphSequence's round."""
    target_dir, _, _, ort_drafter, target_engine = parts
    decoder, sessions = remote_decoder(parts)
    config = GenerationConfig(max_new_tokens=16)
    ids = decoder.encode(PROMPT)
    row = decoder.add(ids, config)
    decoder.step()
    assert len(sessions) == 1
    decoder.run()
    remote = row.result()
    local = generate_one(BatchDecoder(target_engine, ort_drafter, decoder.tokenizer), ids, config)
    alone = generate_one(load_decoder(target_dir, None), ids, config)
    assert remote.token_ids == alone.token_ids == local.token_ids
    assert remote.stats.acceptance_lengths == local.stats.acceptance_lengths
    assert decoder.drafter.dtype == ort_drafter.dtype == "float32"  # the fp32 graph's
    assert "dflash_drafter" in decoder.calls
    assert len(sessions) == 0  # the loop released the finished row's session (what the BLS relies on)


def _started(decoder, rounds=2):
    row = decoder.add(decoder.encode(PROMPT), GenerationConfig(max_new_tokens=16))
    for _ in range(rounds):
        decoder.step()
    return row


def test_released_session_is_an_error_not_a_restart(parts):
    """Before the fix, an unknown id silently got a fresh (empty) cache and wrong logits."""
    decoder, sessions = remote_decoder(parts)
    row = _started(decoder)
    assert decoder.target_session.length(row.target_row) > 0
    sessions.release(decoder.target_session.rows[row.target_row][0])  # the row's session id
    with pytest.raises(LookupError, match="session expired"):
        decoder.step()
    assert len(sessions) == 0  # and it was not re-created


def test_idle_session_evicted_after_ttl_is_an_error(parts):
    now = [0.0]
    decoder, sessions = remote_decoder(parts, clock=lambda: now[0])
    _started(decoder)
    now[0] += 61  # past ttl_s=60
    with pytest.raises(LookupError, match=r"session expired: \d+ was idle longer than session_ttl_s=60 s"):
        decoder.step()


def test_target_checks_the_callers_cache_length(parts):
    *_, target_engine = parts
    sessions = TargetSessions(target_engine, ttl_s=60)

    def call(sid, tokens, cache_length=None, **flags):
        inputs = {
            "session_id": np.array([sid], np.uint64),
            "token_ids": np.array(tokens, np.int64),
            **{k: np.array([v]) for k, v in flags.items()},
        }
        if cache_length is not None:
            inputs["cache_length"] = np.array([cache_length], np.int64)
        return serve_target(sessions, inputs)

    with pytest.raises(ValueError, match="cache_length is required"):
        call(7, [1, 2, 3])
    assert len(sessions) == 0
    assert int(call(7, [1, 2, 3], 0)["length"][0]) == 3  # 0 starts the session
    assert int(call(7, [4], 3)["length"][0]) == 4
    with pytest.raises(ValueError, match="holds 4 cached tokens but its caller expects 2"):
        call(7, [5], 2)
    assert int(call(7, [5], 2, rollback_to=2)["length"][0]) == 3  # a rollback to 2, then one token
    with pytest.raises(LookupError, match="session expired: 8 "):
        call(8, [1], 5)
    call(7, [], release=True)
    with pytest.raises(LookupError, match="session expired: 7 "):
        call(7, [6], 3)


def _batch_infer(parts, sessions, calls):
    _, _, _, ort_drafter, _ = parts

    def infer(model, inputs, outputs):
        calls.append((model, np.asarray(inputs.get("session_id", [0])).size))
        if model == "dflash_target":
            out = serve_target(sessions, inputs)
        else:
            out = dict(zip(outputs, ort_drafter.session.run(outputs, inputs)))
        return {name: out[name] for name in outputs}

    return infer


@pytest.mark.parametrize("model_side", ["batched", "per-row"])
def test_one_target_call_carries_several_sessions(parts, model_side):
    """Ragged rows with their own rollbacks in one dflash_target call == each session called alone (the
    model side serving a row-batched engine, or one that runs a sequence per row, as TensorRT-LLM does)."""
    import torch

    *_, target_engine = parts
    model, layers = target_engine.model, target_engine.feature_layer_ids
    engine = target_engine if model_side == "batched" else SequenceTargetEngine(model, layers)
    sessions = TargetSessions(engine, ttl_s=60)
    calls = []
    remote = RemoteTargetEngine(
        _batch_infer(parts, sessions, calls),
        "dflash_target",
        target_engine.vocab_size,
        2048,
        target_engine.feature_layer_ids,
    )
    batch = remote.new_session()
    rows = [batch.add_row() for _ in range(3)]
    alone = [HfSequenceTarget(model, layers) for _ in rows]
    g = torch.Generator().manual_seed(0)
    for step, sizes in enumerate([(7, 3, 12), (4, 1, 8), (2, 5, 1)]):
        pieces = [torch.randint(0, target_engine.vocab_size, (n,), generator=g) for n in sizes]
        outs = batch.forward(rows, pieces)
        assert calls[-1] == ("dflash_target", 3)  # one call for the three sessions
        for out, session, piece in zip(outs, alone, pieces):
            want = session.forward(piece)
            torch.testing.assert_close(out.logits, want.logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(out.features, want.features, atol=1e-4, rtol=1e-4)
        if step == 1:  # per-row rollbacks ride on the next call
            for row, session, back in zip(rows, alone, (2, 0, 5)):
                batch.rollback(row, batch.length(row) - back)
                session.rollback(session.length - back)
    assert [batch.length(r) for r in rows] == [s.length for s in alone]
    outs = batch.forward(rows[:2], [torch.tensor([1]), torch.tensor([2, 3])], last_logits_only=True, features=False)
    assert [o.logits.shape[0] for o in outs] == [1, 1] and all(o.features is None for o in outs)
    batch.remove_row(rows[0])
    assert len(sessions) == 2


def test_serve_target_rejects_inconsistent_batches(parts):
    *_, target_engine = parts
    sessions = TargetSessions(target_engine, ttl_s=60)
    base = {
        "session_id": np.array([1, 2], np.uint64),
        "token_ids": np.arange(5, dtype=np.int64),
        "cache_length": np.array([0, 0], np.int64),
    }
    with pytest.raises(ValueError, match="do not split 5 token_ids into 2 sessions"):
        serve_target(sessions, {**base, "token_lengths": np.array([2, 2], np.int64)})
    with pytest.raises(ValueError, match="cache_length has 3 values for 2 sessions"):
        serve_target(sessions, {**base, "token_lengths": np.array([2, 3]), "cache_length": np.zeros(3, np.int64)})
    with pytest.raises(ValueError, match="appears twice"):
        serve_target(sessions, {**base, "session_id": np.array([1, 1], np.uint64)})
    out = serve_target(sessions, {**base, "token_lengths": np.array([2, 3], np.int64)})
    assert out["length"].tolist() == [2, 3] and out["logits"].shape[0] == 5


def test_batch_decoder_over_remote_engines_equals_each_row_alone(parts):
    """The BLS's batched step: BatchDecoder over the remote target and the per-row remote drafter, greedy,
    equals each prompt alone through the remote path."""
    _, _, onnx_dir, _, target_engine = parts
    single, _ = remote_decoder(parts)
    prompts = [single.encode(p) for p in (PROMPT, "class Stack:", "import os\n\ndef main():")]
    configs = [GenerationConfig(max_new_tokens=n) for n in (16, 9, 20)]
    want = [generate_one(single, p, c).token_ids for p, c in zip(prompts, configs)]
    sessions = TargetSessions(TorchTargetEngine(target_engine.model, target_engine.feature_layer_ids), ttl_s=60)
    calls = []
    infer = _batch_infer(parts, sessions, calls)
    meta = DrafterGraphMeta.read(onnx_dir)
    target = RemoteTargetEngine(infer, "dflash_target", meta.vocab_size, 2048, meta.feature_layer_ids)
    drafter = RemoteDrafterEngine(infer, "dflash_drafter", json.loads(meta.to_json()))
    got = BatchDecoder(target, drafter).generate(prompts, configs)
    assert [g.token_ids for g in got] == want
    assert ("dflash_target", 3) in calls  # verify steps carried every row in one call
    assert len(sessions) == 0  # finished rows released their sessions


def test_batch_decoder_with_the_batched_remote_drafter_makes_one_drafter_call_per_step(parts, tmp_path):
    """With the batched graph served (dflash_drafter_batch), a step drafts every row in ONE call; greedy output
    still equals each row alone."""
    import onnxruntime as ort

    from dflash_trt.builders.onnx_drafter_batch import export_batched_from_checkpoints
    from dflash_trt.formats import BATCH_DRAFTER_OUTPUTS, BATCH_GRAPH_FILES

    target_dir, drafter_dir, onnx_dir, ort_drafter, target_engine = parts
    export_batched_from_checkpoints(drafter_dir, target_dir, tmp_path)
    graph = ort.InferenceSession(str(tmp_path / BATCH_GRAPH_FILES["fp32"]), providers=["CPUExecutionProvider"])
    single, _ = remote_decoder(parts)
    prompts = [single.encode(p) for p in (PROMPT, "class Stack:", "import os\n\ndef main():")]
    configs = [GenerationConfig(max_new_tokens=n) for n in (16, 9, 20)]
    want = [generate_one(single, p, c).token_ids for p, c in zip(prompts, configs)]
    sessions = TargetSessions(TorchTargetEngine(target_engine.model, target_engine.feature_layer_ids), ttl_s=60)
    calls = []
    target_infer = _batch_infer(parts, sessions, calls)

    def infer(model, inputs, outputs):
        if model != "dflash_drafter_batch":
            return target_infer(model, inputs, outputs)
        calls.append((model, inputs["block_ids"].shape[0]))
        return dict(zip(outputs, graph.run(list(BATCH_DRAFTER_OUTPUTS), inputs)))

    meta = DrafterGraphMeta.read(onnx_dir)
    target = RemoteTargetEngine(infer, "dflash_target", meta.vocab_size, 2048, meta.feature_layer_ids)
    drafter = RemoteDrafterEngine(infer, "dflash_drafter_batch", json.loads(meta.to_json()), batched=True)
    decoder = BatchDecoder(target, drafter)
    rows = [decoder.add(p, c) for p, c in zip(prompts, configs)]
    steps = 0
    while decoder.active:
        before = len(calls)
        decoder.step()
        steps += 1
        assert sum(1 for m, _ in calls[before:] if m == "dflash_drafter_batch") <= 1  # one drafter call per step
    assert [r.result().token_ids for r in rows] == want
    assert ("dflash_drafter_batch", 3) in calls and steps > 1
