"""TensorRT-LLM target session against a FAKE `tensorrt_llm.bindings.executor` (this workplace has no
TensorRT-LLM and no GPU). The fake proves nothing about TensorRT-LLM; it checks our handling of what
the real Executor is documented to return: context logits [tokens, vocab_size_padded], no rows for
tokens whose KV blocks were reused, and a request re-sent with a fresh cache_salt_id when reuse
covered new tokens too."""

import json
import sys
import types

import numpy as np
import pytest
import torch

VOCAB, PADDED, HIDDEN = 10, 12, 3  # tp=4 pads the vocabulary of 10 to 12


def fake_executor_module(calls: list, short_features: bool = False):
    trtllm = types.ModuleType("tensorrt_llm.bindings.executor")

    class Request:
        def __init__(self, **kw):
            self.kw = kw

    trtllm.Request = Request
    trtllm.OutputConfig = lambda **kw: kw
    trtllm.AdditionalModelOutput = lambda name, gather_context=False: name
    trtllm.KvCacheConfig = lambda **kw: kw
    trtllm.ExecutorConfig = lambda **kw: kw
    trtllm.ModelType = types.SimpleNamespace(DECODER_ONLY="DECODER_ONLY")

    class Executor:
        """Reuse: the longest prefix already seen under the same salt (the last token is always computed);
        only computed tokens get rows. short_features: the feature outputs lack their first row."""

        def __init__(self, engine_dir, model_type, config):
            self.seen, self.requests = [], {}

        def enqueue_request(self, request):
            calls.append(request.kw)
            self.requests[len(calls)] = request.kw
            return len(calls)

        def await_responses(self, request_id):
            kw = self.requests.pop(request_id)
            tokens, salt = kw["input_token_ids"], kw["cache_salt_id"]
            reused = 0
            for prev_tokens, prev_salt in self.seen:
                if prev_salt == salt:
                    common = next((i for i, (a, b) in enumerate(zip(prev_tokens, tokens)) if a != b),
                                  min(len(prev_tokens), len(tokens)))
                    reused = max(reused, common)
            reused = min(reused, len(tokens) - 1)
            self.seen.append((list(tokens), salt))
            positions = np.arange(reused, len(tokens))
            logits = np.full((len(positions), PADDED), 100.0, dtype=np.float32)  # padding columns are junk
            logits[:, :VOCAB] = np.array(tokens)[positions, None] * 0.0 + positions[:, None]
            outputs = [types.SimpleNamespace(name=f"dflash_feature_{i}",
                                             output=np.repeat(positions[:, None] * 10.0 + i, HIDDEN, 1)[short_features:])
                       for i in (0, 1)]
            result = types.SimpleNamespace(context_logits=logits, additional_outputs=outputs)
            return [types.SimpleNamespace(has_error=lambda: False, error_msg="", result=result)]

    trtllm.Executor = Executor
    return trtllm


@pytest.fixture
def engine_dir(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "config.json").write_text(json.dumps(
        {"pretrained_config": {"vocab_size": VOCAB}, "build_config": {"max_seq_len": 64}}))
    (tmp_path / "dflash_target.json").write_text(json.dumps(
        {"engine_dir": "engine", "feature_layer_ids": [1, 3], "feature_outputs": ["dflash_feature_0", "dflash_feature_1"]}))
    return tmp_path


def install(monkeypatch, calls, **kw):
    mod = fake_executor_module(calls, **kw)
    for name in ("tensorrt_llm", "tensorrt_llm.bindings"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "tensorrt_llm.bindings.executor", mod)
    sys.modules["tensorrt_llm"].bindings = sys.modules["tensorrt_llm.bindings"]
    sys.modules["tensorrt_llm.bindings"].executor = mod


def test_rows_of_the_new_tokens_and_retry_when_reuse_covers_them(monkeypatch, engine_dir):
    from dflash_trt.runtime.trtllm_backend import TrtllmTargetEngine

    calls = []
    install(monkeypatch, calls)
    engine = TrtllmTargetEngine(engine_dir)
    assert engine.max_context == 64

    first = engine.new_session()
    out = first.forward(torch.tensor([5, 6, 7]))
    assert out.logits.shape == (3, VOCAB)  # padding columns sliced off
    assert out.logits[:, 0].tolist() == [0, 1, 2]  # rows of positions 0..2
    assert out.features.shape == (3, 2 * HIDDEN) and out.features[:, 0].tolist() == [0, 10, 20]
    out = first.forward(torch.tensor([8, 9]))
    assert out.logits[:, 0].tolist() == [3, 4] and out.features[:, HIDDEN].tolist() == [31, 41]
    assert [c["cache_salt_id"] for c in calls] == [None, None]

    # An identical sequence: the first two tokens' blocks are reused, so only 1 row comes back for 3
    # new tokens; the session re-sends with a fresh salt and gets all three.
    calls.clear()
    second = engine.new_session()
    out = second.forward(torch.tensor([5, 6, 7]), last_logits_only=True)
    assert len(calls) == 2 and calls[0]["cache_salt_id"] is None and isinstance(calls[1]["cache_salt_id"], int)
    assert out.logits[:, 0].tolist() == [2] and out.features[:, 0].tolist() == [0, 10, 20]
    assert second.length == 3


def test_short_features_are_refused_not_misaligned(monkeypatch, engine_dir):
    from dflash_trt.runtime.trtllm_backend import TrtllmTargetEngine

    calls = []
    install(monkeypatch, calls, short_features=True)
    session = TrtllmTargetEngine(engine_dir).new_session()
    with pytest.raises(RuntimeError, match="fewer than 2 rows for 2 new tokens even without KV reuse"):
        session.forward(torch.tensor([1, 2]))
    assert len(calls) == 2 and session.length == 0  # retried once, then refused; nothing committed
    assert session.forward(torch.tensor([1, 2]), features=False).logits.shape == (2, VOCAB)  # logits alone are fine
