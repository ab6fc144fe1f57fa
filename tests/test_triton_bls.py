"""The BLS engine adapters and dflash_target's session table, in this process: the same code the
Triton models run (dflash_trt.triton.bls), with the transport swapped for a direct call. The real
transport (tritonserver) is covered by test_triton_server.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import make_text_models

from dflash_trt.builders.onnx_drafter import export_from_checkpoints
from dflash_trt.formats import DrafterGraphMeta
from dflash_trt.decoding import GenerationConfig, SpeculativeDecoder
from dflash_trt.loading import load_decoder
from dflash_trt.models.target import load_target, load_tokenizer
from dflash_trt.runtime.ort_backend import OrtDrafterEngine
from dflash_trt.runtime.torch_backend import TorchTargetEngine
from dflash_trt.triton.bls import RemoteDrafterEngine, RemoteTargetEngine, TargetSessions, serve_target

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
    """SpeculativeDecoder over RemoteTargetEngine / RemoteDrafterEngine, whose `infer` calls the
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
    decoder = SpeculativeDecoder(target, drafter, load_tokenizer(target_dir))
    decoder.calls = calls
    return decoder, sessions


def test_remote_engines_equal_the_local_ones(parts):
    """Greedy over the remote adapters == the target alone, with the same drafts (acceptance) as the
    in-process ONNX Runtime drafter: RemoteDrafterEngine reuses OrtDrafterSession's round."""
    target_dir, _, _, ort_drafter, target_engine = parts
    decoder, sessions = remote_decoder(parts)
    config = GenerationConfig(max_new_tokens=16)
    ids = decoder.encode(PROMPT)
    gen = decoder.start(ids, config)
    for _ in gen:
        pass
    remote = gen.result()
    local = SpeculativeDecoder(target_engine, ort_drafter, decoder.tokenizer).generate(ids, config)
    alone = load_decoder(target_dir, None).generate(ids, config)
    assert remote.token_ids == alone.token_ids == local.token_ids
    assert remote.stats.acceptance_lengths == local.stats.acceptance_lengths
    assert "dflash_drafter" in decoder.calls
    assert len(sessions) == 1
    gen.target_session.close()  # what the BLS does when a request ends
    assert len(sessions) == 0


def _started(decoder, rounds=2):
    gen = decoder.start(decoder.encode(PROMPT), GenerationConfig(max_new_tokens=16))
    for _ in range(rounds):
        gen.step()
    return gen


def test_released_session_is_an_error_not_a_restart(parts):
    """Before the fix, an unknown id silently got a fresh (empty) cache and wrong logits."""
    decoder, sessions = remote_decoder(parts)
    gen = _started(decoder)
    assert gen.target_session.length > 0
    sessions.release(gen.target_session.session_id)
    with pytest.raises(LookupError, match="session expired"):
        gen.step()
    assert len(sessions) == 0  # and it was not re-created


def test_idle_session_evicted_after_ttl_is_an_error(parts):
    now = [0.0]
    decoder, sessions = remote_decoder(parts, clock=lambda: now[0])
    gen = _started(decoder)
    now[0] += 61  # past ttl_s=60
    with pytest.raises(LookupError, match=r"session expired: \d+ was idle longer than session_ttl_s=60 s"):
        gen.step()


def test_target_checks_the_callers_cache_length(parts):
    *_, target_engine = parts
    sessions = TargetSessions(target_engine, ttl_s=60)

    def call(sid, tokens, cache_length=None, **flags):
        inputs = {"session_id": np.array([sid], np.uint64), "token_ids": np.array(tokens, np.int64),
                  **{k: np.array([v]) for k, v in flags.items()}}
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
