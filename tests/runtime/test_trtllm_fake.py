"""TensorRT-LLM target session against a FAKE `tensorrt_llm.bindings.executor` (tests/fake_tensorrt.py; this
workplace has no TensorRT-LLM and no GPU). The fake proves nothing about TensorRT-LLM itself: it models what the
1.2 sources say the Executor does (prefixed output names, unwritten rows of reused tokens, reuse keyed by salt,
the input limit, context logits needing a special build, leader-only enqueue), each behaviour naming its source,
and computes the marked outputs with a real tiny Hugging Face model so that results can be compared exactly."""

import json

import pytest
import torch
from fake_tensorrt import install_trtllm, make_trtllm_executor
from helpers import HfSequenceTarget, NoisyOracleDrafter, generate_one
from tiny_models import make_tiny_drafter, make_tiny_target

from dflash_trt.decoding import BatchDecoder, GenerationConfig
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine

LAYERS = (1, 2)  # build_target_layer_ids(5 layers, 2 drafter layers)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("trtllm")
    model = make_tiny_target(root / "target", family="qwen3", vocab_size=96, layers=5)
    drafter = make_tiny_drafter(model.config, root / "drafter", layers=2, block_size=8)
    return root, model, drafter


def hf_outputs(model):
    @torch.inference_mode()
    def run(tokens):
        out = model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
        hs = out.hidden_states
        values = {f"dflash_feature_{i}": hs[i + 1][0].numpy() for i in LAYERS}
        values["dflash_final_hidden"] = hs[-1][0].numpy()  # after the final norm
        return values

    return run


def engine_folder(
    root, target_dir, name="engine", max_seq_len=128, max_num_tokens=128, dtype="float32", mapping=None, **build
):
    """A TensorRT-LLM engine folder; `mapping`: its pretrained_config.mapping (None: none, the runtime's defaults)."""
    folder = root / name
    (folder / "engine").mkdir(parents=True, exist_ok=True)
    pretrained = {"vocab_size": 96, "hidden_size": 64, "dtype": dtype, **({"mapping": mapping} if mapping else {})}
    (folder / "engine" / "config.json").write_text(
        json.dumps(
            {
                "pretrained_config": pretrained,
                "build_config": {
                    "max_seq_len": max_seq_len,
                    "max_num_tokens": max_num_tokens,
                    "plugin_config": {"tokens_per_block": 4},
                    **build,
                },
            }
        )
    )
    (folder / "dflash_target.json").write_text(
        json.dumps(
            {
                "engine_dir": "engine",
                "feature_layer_ids": list(LAYERS),
                "feature_outputs": [f"dflash_feature_{i}" for i in LAYERS],
                "final_hidden_output": "dflash_final_hidden",
                "target_dir": str(target_dir),
            }
        )
    )
    return folder


@pytest.fixture
def fake(monkeypatch, tiny):
    root, model, _ = tiny
    calls = []
    module = make_trtllm_executor(calls, hf_outputs(model))
    install_trtllm(monkeypatch, module)
    return calls, module


def test_rows_of_new_tokens_by_prefixed_name_match_the_hf_target(fake, tiny):
    from dflash_trt.runtime.trtllm_backend import TrtllmSequence, TrtllmTargetEngine

    calls, module = fake
    root, model, _ = tiny
    engine = TrtllmTargetEngine(engine_folder(root, root / "target"))
    ref = HfSequenceTarget(model, LAYERS)
    session = TrtllmSequence(engine)
    tokens = torch.randint(0, 96, (19,), generator=torch.Generator().manual_seed(0))
    for piece in (tokens[:9], tokens[9:12], tokens[12:]):
        got, want = session.forward(piece), ref.forward(piece)
        assert torch.isfinite(got.logits).all() and torch.isfinite(got.features).all()  # no unwritten row read
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.features, want.features, atol=1e-4, rtol=1e-4)
    assert module.reused[1:] == [8, 12]  # the session's own prefix was reused (whole blocks of 4)
    requests = [c for c in calls if hasattr(c, "input_token_ids")]
    assert [len(r.input_token_ids) for r in requests] == [9, 12, 19]
    assert len({r.cache_salt_id for r in requests}) == 1 and requests[0].cache_salt_id is not None
    executor_config = next(c for c in calls if c[0] == "Executor")[2]
    assert executor_config.kv_cache_config.enable_block_reuse
    # a prefill asks for the last row's logits only
    other = TrtllmSequence(engine)
    out = other.forward(tokens[:7], last_logits_only=True)
    assert out.logits.shape == (1, 96) and out.features.shape[0] == 7
    assert other.salt != session.salt  # sessions never share KV blocks


def test_new_tokens_sent_before_move_the_session_to_a_fresh_salt(fake, tiny):
    from dflash_trt.runtime.trtllm_backend import TrtllmSequence, TrtllmTargetEngine

    _, module = fake
    root, model, _ = tiny
    engine = TrtllmTargetEngine(engine_folder(root, root / "target"))
    session, ref = TrtllmSequence(engine), HfSequenceTarget(model, LAYERS)
    seq = torch.arange(10, 30)
    session.forward(seq[:8])
    ref.forward(seq[:8])
    session.forward(seq[8:16])
    session.rollback(9)
    first_salt = session.salt
    # the same tokens again at the same positions: their KV blocks exist, their rows could come back unwritten
    got = session.forward(seq[9:16])
    ref.forward(seq[8:9])
    want = ref.forward(seq[9:16])
    assert session.salt != first_salt and session.salt_changes == 1
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    assert module.reused[-1] == 0
    # a round that differs right after the committed prefix keeps the salt
    session.rollback(12)
    session.forward(torch.tensor([1, 2, 3]))
    assert session.salt_changes == 1


def test_greedy_output_equals_the_target_alone(fake, tiny):
    from dflash_trt.runtime.trtllm_backend import TrtllmTargetEngine

    root, model, drafter = tiny
    trt_target = TrtllmTargetEngine(engine_folder(root, root / "target"))
    base = BatchDecoder(TorchTargetEngine(model))
    torch_target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    assert tuple(drafter.spec.target_layer_ids) == LAYERS
    real = BatchDecoder(trt_target, TorchDrafterEngine.for_target(drafter, torch_target))
    for trial, (prompt, p_correct) in enumerate([([5, 6, 7], 1.0), (list(range(20, 33)), 0.6)]):
        reference = generate_one(base, prompt, GenerationConfig(max_new_tokens=24)).token_ids
        if trial == 0:  # the real (random) drafter: mostly rejections
            assert generate_one(real, prompt, GenerationConfig(max_new_tokens=24, block_size=4)).token_ids == reference
        # a noisy oracle: long accepted runs, and rollbacks into the middle of KV blocks
        oracle = NoisyOracleDrafter(reference, len(prompt), 96, 8, p_correct, seed=trial, feature_layer_ids=LAYERS)
        got = generate_one(BatchDecoder(trt_target, oracle), prompt, GenerationConfig(max_new_tokens=24, block_size=8))
        assert got.token_ids == reference
        assert max(got.stats.acceptance_lengths) > 1


def test_max_context_is_the_runtime_input_limit(fake, tiny):
    from dflash_trt.decoding import ContextLengthError
    from dflash_trt.runtime.trtllm_backend import TrtllmSequence, TrtllmTargetEngine

    root, _, _ = tiny
    engine = TrtllmTargetEngine(engine_folder(root, root / "target", "short", max_seq_len=64, max_num_tokens=24))
    assert engine.max_context == 24  # min(max_seq_len - 1, max_num_tokens), not max_seq_len
    with pytest.raises(ContextLengthError):
        generate_one(BatchDecoder(engine), list(range(20)), GenerationConfig(max_new_tokens=10))
    session = TrtllmSequence(engine)
    with pytest.raises(ValueError, match="exceed the engine's input limit 24"):
        session.forward(torch.arange(25))
    assert session.forward(torch.arange(24), features=False).features is None


def test_engine_built_with_context_logits_is_refused(fake, tiny):
    from dflash_trt.runtime.base import EngineUnavailable
    from dflash_trt.runtime.trtllm_backend import TrtllmTargetEngine

    root, _, _ = tiny
    folder = engine_folder(root, root / "target", "logits", gather_context_logits=True)
    with pytest.raises(EngineUnavailable, match="disables KV block reuse"):
        TrtllmTargetEngine(folder)


def test_engine_without_the_marked_features_names_the_rebuild(monkeypatch, tiny):
    from dflash_trt.runtime.trtllm_backend import TrtllmSequence, TrtllmTargetEngine

    root, model, _ = tiny
    full = hf_outputs(model)
    # an engine built by plain trtllm-build marks only what its model class marks: no features here
    install_trtllm(
        monkeypatch, make_trtllm_executor([], lambda t: {"dflash_final_hidden": full(t)["dflash_final_hidden"]})
    )
    session = TrtllmSequence(TrtllmTargetEngine(engine_folder(root, root / "target")))
    with pytest.raises(RuntimeError, match="no 'context_dflash_feature_1'.*rebuild it with `dflash-trt build-target`"):
        session.forward(torch.tensor([1, 2, 3]))
    assert session.length == 0
    assert session.forward(torch.tensor([1, 2, 3]), features=False).logits.shape == (3, 96)


def test_only_the_leader_rank_runs_sessions(monkeypatch, tiny):
    from dflash_trt.runtime.trtllm_backend import TrtllmTargetEngine

    root, model, _ = tiny
    calls = []
    install_trtllm(monkeypatch, make_trtllm_executor(calls, hf_outputs(model), rank=1))
    engine = TrtllmTargetEngine(engine_folder(root, root / "target"))
    assert not engine.is_leader
    with pytest.raises(RuntimeError, match="not the TensorRT-LLM leader"):
        engine.new_session()
    engine.serve_worker()
    assert ("shutdown", 1) in calls


def test_the_fake_refuses_what_the_old_backend_did(fake, tiny):
    """Negative controls: the behaviours the previous backend relied on fail against the modelled runtime."""
    calls, module = fake
    root, _, _ = tiny
    folder = engine_folder(root, root / "target")
    ex = module.Executor(
        folder / "engine",
        "DECODER_ONLY",
        module.ExecutorConfig(
            kv_cache_config=module.KvCacheConfig(enable_block_reuse=True),
            additional_model_outputs=[module.AdditionalModelOutput("dflash_feature_1", gather_context=True)],
        ),
    )
    # context logits from an engine built without them
    rid = ex.enqueue_request(
        module.Request([1, 2, 3], 1, output_config=module.OutputConfig(return_context_logits=True))
    )
    assert ex.await_responses(rid)[0].has_error()
    # outputs come back prefixed, and reused rows are left unwritten (not dropped)
    cfg = module.OutputConfig(additional_model_outputs=[module.AdditionalModelOutput("dflash_feature_1", True)])
    ex.await_responses(ex.enqueue_request(module.Request(list(range(9)), 1, output_config=cfg, cache_salt_id=7)))
    result = ex.await_responses(
        ex.enqueue_request(module.Request(list(range(12)), 1, output_config=cfg, cache_salt_id=7))
    )[0].result
    by_name = {o.name: o.output for o in result.additional_outputs}
    assert "dflash_feature_1" not in by_name and by_name["context_dflash_feature_1"].shape[0] == 12
    assert torch.isnan(by_name["context_dflash_feature_1"][:8]).all()
    assert by_name["context_dflash_feature_1"].dtype == torch.float32  # the engine's dtype (float32 here)
    # Request's parameters after max_tokens are keyword-only (nanobind executor/request.cpp: nb::kw_only())
    with pytest.raises(TypeError):
        module.Request([1, 2, 3], 1, False)
    # prompts past min(max_seq_len - 1, max_num_tokens) are refused
    short = engine_folder(root, root / "target", "limit", max_seq_len=64, max_num_tokens=24)
    ex = module.Executor(short / "engine", "DECODER_ONLY", module.ExecutorConfig())
    assert ex.await_responses(ex.enqueue_request(module.Request(list(range(30)), 1)))[0].has_error()


def _rows_alone(model, pieces):
    """Per-row reference: each row's token pieces through its own Hugging Face sequence (DynamicCache)."""
    return [[s.forward(p) for p in row] for s, row in ((HfSequenceTarget(model, LAYERS), row) for row in pieces)]


def test_batched_forward_submits_every_row_before_awaiting_and_keeps_row_order(fake, tiny):
    from dflash_trt.runtime.base import TargetEngine, TargetSession
    from dflash_trt.runtime.trtllm_backend import TrtllmTargetEngine

    calls, module = fake
    root, model, _ = tiny
    engine = TrtllmTargetEngine(engine_folder(root, root / "target"))
    assert isinstance(engine, TargetEngine) and engine.max_context == 127 and engine.vocab_size == 96
    batch = engine.new_session()
    assert isinstance(batch, TargetSession)
    rows = [batch.add_row() for _ in range(3)]
    g = torch.Generator().manual_seed(3)
    # ragged: different prompt lengths, then different block sizes, rows passed out of handle order
    prompts = [torch.randint(0, 96, (n,), generator=g) for n in (5, 11, 8)]
    blocks = [torch.randint(0, 96, (n,), generator=g) for n in (1, 4, 8)]
    want = _rows_alone(model, [[p, b] for p, b in zip(prompts, blocks)])
    order = [2, 0, 1]
    for step, pieces in enumerate((prompts, blocks)):
        start = len(calls)
        outs = batch.forward([rows[i] for i in order], [pieces[i] for i in order])
        events = calls[start:]
        submitted = [k for k, c in enumerate(events) if hasattr(c, "input_token_ids")]
        awaited = [k for k, c in enumerate(events) if isinstance(c, tuple) and c[0] == "await"]
        assert len(submitted) == 3 and awaited and max(submitted) < min(awaited)  # all enqueued, then awaited
        assert len(module.iterations[-1]) == 3  # the modelled executor ran the three rows in one iteration
        for k, i in enumerate(order):
            assert outs[k].logits.shape[0] == pieces[i].numel()
            torch.testing.assert_close(outs[k].logits, want[i][step].logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(outs[k].features, want[i][step].features, atol=1e-4, rtol=1e-4)
    assert [batch.length(r) for r in rows] == [6, 15, 16]
    # last_logits_only and features=False per call
    outs = batch.forward(rows[:2], [torch.tensor([1, 2]), torch.tensor([3])], last_logits_only=True, features=False)
    assert [o.logits.shape for o in outs] == [(1, 96), (1, 96)] and all(o.features is None for o in outs)


def test_batched_rollback_is_per_row(fake, tiny):
    from dflash_trt.runtime.trtllm_backend import TrtllmTargetEngine

    _, module = fake
    root, model, _ = tiny
    batch = TrtllmTargetEngine(engine_folder(root, root / "target")).new_session()
    a, b = batch.add_row(), batch.add_row()
    seq_a, seq_b = torch.arange(10, 30), torch.arange(40, 60)
    batch.forward([a, b], [seq_a[:8], seq_b[:8]])
    batch.forward([a, b], [seq_a[8:16], seq_b[8:16]])
    batch.rollback(a, 9)  # row a rejects most of its block; row b keeps everything
    assert (batch.length(a), batch.length(b)) == (9, 16)
    # row a re-sends tokens it sent before at those positions (fresh salt); row b goes on
    outs = batch.forward([a, b], [seq_a[9:12], seq_b[16:18]])
    ref_a, ref_b = HfSequenceTarget(model, LAYERS), HfSequenceTarget(model, LAYERS)
    ref_a.forward(seq_a[:9])
    ref_b.forward(seq_b[:16])
    torch.testing.assert_close(outs[0].logits, ref_a.forward(seq_a[9:12]).logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[1].logits, ref_b.forward(seq_b[16:18]).logits, atol=1e-4, rtol=1e-4)
    assert batch.sequences[a].salt_changes == 1 and batch.sequences[b].salt_changes == 0
    assert module.reused[-1] == 16  # row b reused its own prefix (whole blocks of 4)


def test_batched_errors_commit_no_row_and_leave_the_session_usable(fake, tiny):
    from dflash_trt.runtime.trtllm_backend import TrtllmTargetEngine

    calls, _ = fake
    root, model, _ = tiny
    engine = TrtllmTargetEngine(engine_folder(root, root / "target", "short", max_seq_len=64, max_num_tokens=24))
    batch = engine.new_session()
    a, b = batch.add_row(), batch.add_row()
    before = len(calls)
    with pytest.raises(ValueError, match="exceed the engine's input limit 24"):
        batch.forward([a, b], [torch.arange(5), torch.arange(30)])
    assert len(calls) == before  # refused before anything was submitted
    assert (batch.length(a), batch.length(b)) == (0, 0)
    with pytest.raises(ValueError, match="twice"):
        batch.forward([a, a], [torch.arange(2), torch.arange(2)])
    with pytest.raises(ValueError, match=">= 1 new token"):
        batch.forward([a], [torch.tensor([], dtype=torch.long)])
    with pytest.raises(KeyError):
        batch.forward([a, 99], [torch.arange(2), torch.arange(2)])
    # the runtime answers one row with an error: the call raises naming it, no row commits
    engine.executor.max_input_len = 6  # (a runtime-side refusal the session's own check does not see)
    with pytest.raises(RuntimeError, match="row 1 failed: Prompt length"):
        batch.forward([a, b], [torch.arange(4), torch.arange(9)])
    assert (batch.length(a), batch.length(b)) == (0, 0)
    engine.executor.max_input_len = 24
    outs = batch.forward([a, b], [torch.arange(4), torch.arange(9)])  # same tokens again: fresh salts, exact rows
    want = _rows_alone(model, [[torch.arange(4)], [torch.arange(9)]])
    torch.testing.assert_close(outs[1].logits, want[1][0].logits, atol=1e-4, rtol=1e-4)
    assert torch.isfinite(outs[0].logits).all()
    batch.remove_row(a)
    with pytest.raises(KeyError):
        batch.length(a)
    assert batch.add_row() != a  # handles are never reused


def test_batched_decoder_over_the_trtllm_target_equals_the_target_alone(fake, tiny):
    from dflash_trt.runtime.trtllm_backend import TrtllmTargetEngine

    root, model, drafter = tiny
    engine = TrtllmTargetEngine(engine_folder(root, root / "target"))
    prompts = [[5, 6, 7], list(range(20, 33)), [40, 41]]
    base = BatchDecoder(TorchTargetEngine(model))
    want = [generate_one(base, p, GenerationConfig(max_new_tokens=16)).token_ids for p in prompts]
    torch_target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    dec = BatchDecoder(engine, TorchDrafterEngine.for_target(drafter, torch_target))
    got = dec.generate(prompts, GenerationConfig(max_new_tokens=16, block_size=4))
    assert [g.token_ids for g in got] == want


def test_an_fp16_engine_returns_fp16_tensors_and_the_session_converts_them(fake, tiny):
    """A float16 engine's marked outputs come back as float16 torch tensors (the executor's Tensor caster): the
    session's logits (through the lm_head) and features are float32, within fp16 rounding of the HF target."""
    from dflash_trt.runtime.trtllm_backend import TrtllmSequence, TrtllmTargetEngine

    calls, module = fake
    root, model, _ = tiny
    engine = TrtllmTargetEngine(engine_folder(root, root / "target", name="fp16", dtype="float16"))
    session, ref = TrtllmSequence(engine), HfSequenceTarget(model, LAYERS)
    tokens = torch.arange(3, 14)
    got, want = session.forward(tokens), ref.forward(tokens)
    assert got.logits.dtype == torch.float32 and got.features.dtype == torch.float32
    torch.testing.assert_close(got.logits, want.logits, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.features, want.features, atol=2e-2, rtol=2e-2)
    assert not torch.equal(got.features, want.features)  # they did pass through float16
    request = next(c for c in calls if hasattr(c, "input_token_ids"))
    assert request.streaming is False  # given by keyword: the real Request takes nothing else after max_tokens


def test_an_fp32_engine_as_build_target_plans_it_reuses_nothing_and_equals_the_target(fake, tiny):
    """TensorRT-LLM runs fp32 context attention unfused, over a request's new tokens only: with a reused prefix
    every new row would miss it (the fake models attentionOp.cpp's fallback). build-target builds fp32 engines
    without paged context FMHA, so the Executor turns reuse off (fixExecutorConfig) and every round is exact;
    the engine as it was built before (fp32 with paged context FMHA) is the negative control."""
    from dflash_trt.builders.trtllm_target import TargetBuildSpec, build_command
    from dflash_trt.runtime.trtllm_backend import TrtllmTargetEngine

    _, module = fake
    root, model, drafter = tiny
    spec = TargetBuildSpec(root, root, "qwen3", 1, 8, LAYERS, 5, dtype="float32")
    build = build_command(spec)
    paged = build[build.index("--use_paged_context_fmha") + 1] == "enable"
    prompt = list(range(20, 33))
    reference = generate_one(BatchDecoder(TorchTargetEngine(model)), prompt, GenerationConfig(max_new_tokens=24))
    oracle = NoisyOracleDrafter(reference.token_ids, len(prompt), 96, 8, 0.6, seed=1, feature_layer_ids=LAYERS)

    def run(name, use_paged):
        plugin = {"tokens_per_block": 4, "use_paged_context_fmha": use_paged}
        engine = TrtllmTargetEngine(engine_folder(root, root / "target", name=name, plugin_config=plugin))
        start = len(module.reused)
        got = generate_one(BatchDecoder(engine, oracle), prompt, GenerationConfig(max_new_tokens=24, block_size=8))
        return got, module.reused[start:]

    got, reused = run("fp32-as-planned", paged)
    assert not paged and got.token_ids == reference.token_ids and not any(reused)
    assert max(got.stats.acceptance_lengths) > 1  # rounds accepted drafts and rolled back: exact without reuse
    before, reused = run("fp32-paged", True)  # the old plan: reuse on over unfused attention
    assert any(reused) and before.token_ids != reference.token_ids
