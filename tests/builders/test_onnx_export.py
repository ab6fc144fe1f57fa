"""Drafter export to ONNX: checker, parity with PyTorch (fp32 and fp16), the empty-cache first round,
and greedy generation with the ONNX Runtime drafter equal to the target alone. Real onnxruntime sessions."""

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import DrafterSequence, generate_one

from dflash_trt.builders.onnx_drafter import DrafterRound, example_inputs, export_from_checkpoints
from dflash_trt.decoding import BatchDecoder, ContextLengthError, GenerationConfig
from dflash_trt.formats import DRAFTER_INPUTS as INPUT_NAMES
from dflash_trt.formats import DRAFTER_OUTPUTS as OUTPUT_NAMES
from dflash_trt.formats import FP16_GRAPH_FILE, GRAPH_FILE, DrafterGraphMeta
from dflash_trt.runtime.ort_backend import OrtDrafterEngine, RoundGraphSequence
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine


@pytest.fixture(scope="module")
def exported(tiny_pair, tmp_path_factory):
    family, target_dir, drafter_dir, model, drafter = tiny_pair
    out = tmp_path_factory.mktemp(f"onnx-{family}")
    export_from_checkpoints(drafter_dir, target_dir, out, fp16=True)
    module = DrafterRound(drafter, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    return family, out, module, model, drafter


def run_both(module, session, meta, new, past, block, seed):
    torch.manual_seed(seed)
    ids, feats, pk, pv = example_inputs(meta, new, past, block)
    ids[0, 0] = int(torch.randint(meta.vocab_size, (1,)))
    feats = torch.randn_like(feats)  # fresh random features per case
    with torch.no_grad():
        ref = [t.numpy() for t in module(ids, feats, pk, pv)]
    got = session.run(None, dict(zip(INPUT_NAMES, (ids.numpy(), feats.numpy(), pk.numpy(), pv.numpy()))))
    return ref, got


CASES = [(1, 0, 8), (5, 0, 8), (3, 7, 8), (1, 40, 2), (9, 100, 5), (2, 3, 4)]  # (n, T, B); T=0: first round


def test_graph_checks_and_interface(exported):
    _, out, _, _, _ = exported
    for name in (GRAPH_FILE, FP16_GRAPH_FILE):
        onnx.checker.check_model(str(out / name))
        assert (out / (name + ".data")).is_file()  # weights in the side file
        sess = ort.InferenceSession(str(out / name), providers=["CPUExecutionProvider"])
        assert [i.name for i in sess.get_inputs()] == list(INPUT_NAMES)
        assert [o.name for o in sess.get_outputs()] == list(OUTPUT_NAMES)
        # every dynamic axis stayed symbolic (an int here means the exporter fixed it)
        shapes = {i.name: i.shape for i in sess.get_inputs()}
        assert isinstance(shapes["block_ids"][1], str) and isinstance(shapes["features"][1], str)
        assert isinstance(shapes["past_k"][3], str) and isinstance(shapes["past_v"][3], str)
        # keep_io_types: fp32 in and out even for the fp16 graph
        assert [o.type for o in sess.get_outputs()][:2] == ["tensor(float)", "tensor(int64)"]


def test_fp32_parity_with_pytorch(exported):
    family, out, module, _, _ = exported
    meta = DrafterGraphMeta.read(out)
    sess = ort.InferenceSession(str(out / GRAPH_FILE), providers=["CPUExecutionProvider"])
    worst = 0.0
    for i, (new, past, block) in enumerate(CASES):
        ref, got = run_both(module, sess, meta, new, past, block, seed=i)
        assert got[0].shape == (1, block - 1, meta.vocab_size) and got[0].dtype == np.float32
        assert got[2].shape == meta.cache_shape(past + new)
        worst = max(worst, float(np.abs(got[0] - ref[0]).max()))
        np.testing.assert_array_equal(got[1], ref[1], err_msg=f"{family} draft tokens differ at {new, past, block}")
        np.testing.assert_allclose(got[2], ref[2], atol=1e-4)
        np.testing.assert_allclose(got[3], ref[3], atol=1e-4)
    assert worst <= 1e-4, worst
    print(f"\n{family}: fp32 max abs logit diff {worst:.2e}")


def test_fp16_token_agreement(exported):
    family, out, module, _, _ = exported
    meta = DrafterGraphMeta.read(out)
    sess = ort.InferenceSession(str(out / FP16_GRAPH_FILE), providers=["CPUExecutionProvider"])
    same = total = 0
    for i in range(40):
        new, past, block = 1 + i % 7, (i * 13) % 60, 2 + i % 7
        ref, got = run_both(module, sess, meta, new, past, block, seed=100 + i)
        assert np.abs(got[0] - ref[0]).max() < 5e-2  # fp16 rounding, not a different function
        same += int((got[1] == ref[1]).sum())
        total += ref[1].size
    agreement = same / total
    print(f"\n{family}: fp16 draft-token agreement {agreement:.4f} over {total} tokens")
    assert agreement >= 0.99


def test_empty_cache_first_round_matches_torch_session(exported):
    """The first round of a request has T = 0; the graph was traced at T = 5 and must not have specialised."""
    _, out, _, model, drafter = exported
    torch_engine = TorchDrafterEngine(
        drafter, model.get_input_embeddings().weight, model.get_output_embeddings().weight
    )
    ort_engine = OrtDrafterEngine(out)
    assert not ort_engine.batched  # this folder has the single-sequence graph only
    a, b = DrafterSequence(torch_engine), RoundGraphSequence(ort_engine.meta, ort_engine.run)
    assert b.context_length == 0
    torch.manual_seed(3)
    for new in (6, 1, 3):  # prompt features, then rounds
        feats = torch.randn(new, ort_engine.meta.feature_size)
        da, db = a.draft(feats, 5, 8), b.draft(feats, 5, 8)
        assert torch.equal(da.tokens, db.tokens)
        assert (da.logits - db.logits).abs().max() <= 1e-4
        assert a.context_length == b.context_length
    assert b.context_length == 10


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_greedy_generation_with_ort_drafter_equals_target_alone(exported, precision):
    family, out, _, model, drafter = exported
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    ort_spec = BatchDecoder(target, OrtDrafterEngine(out, precision))
    torch_spec = BatchDecoder(target, TorchDrafterEngine.for_target(drafter, target))
    base = BatchDecoder(TorchTargetEngine(model))
    rng = torch.Generator().manual_seed(7)
    for trial in range(4):
        prompt = torch.randint(0, 95, (int(torch.randint(1, 30, (1,), generator=rng)),), generator=rng).tolist()
        cfg = GenerationConfig(max_new_tokens=40, block_size=[8, 4, 2, 5][trial])
        expected = generate_one(base, prompt, GenerationConfig(max_new_tokens=40)).token_ids
        got = generate_one(ort_spec, prompt, cfg)
        assert got.token_ids == expected, (family, precision, trial)
        if precision == "fp32":  # same drafts, so the same acceptance as the PyTorch drafter
            assert got.stats.acceptance_lengths == generate_one(torch_spec, prompt, cfg).stats.acceptance_lengths


def test_bench_export_leaves_the_live_drafter_alone_and_cleans_up(exported, tmp_path):
    """The benchmark exports its live bf16 engine's drafter to a scratch folder: the export must not turn
    that drafter to fp32 (or change its mode), and the scratch folder must go when the engine goes."""
    import gc

    from dflash_trt.bench.runner import BenchSettings, ort_drafter

    family, _, _, model, drafter = exported
    if family != "qwen3":
        pytest.skip("the export path does not depend on the family; one export is enough")
    live = copy.deepcopy(drafter).to(torch.bfloat16).train()
    embed = model.get_input_embeddings().weight.detach().to(torch.bfloat16)
    head = model.get_output_embeddings().weight.detach().to(torch.bfloat16)
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    decoder = BatchDecoder(target, TorchDrafterEngine(live, embed, head))
    live.train()  # TorchDrafterEngine set eval(); train() makes a mode change by the export visible
    engine = ort_drafter(decoder, BenchSettings(target=tmp_path, drafter=None, ar_draft=None, out=tmp_path))
    assert {p.dtype for p in live.parameters()} == {torch.bfloat16}
    assert live.training
    assert embed.dtype == head.dtype == torch.bfloat16
    assert engine.session.get_inputs()[1].type == "tensor(float)"  # the graph itself is fp32
    folder = engine.folder
    assert (folder / "drafter.onnx").is_file() and folder.name.startswith("dflash-bench-onnx-")
    del engine
    gc.collect()
    assert not folder.exists()


def test_drafter_context_limit_is_checked_up_front(exported):
    """A drafter engine with max_context (a TensorRT plan's profile) caps requests like the target does."""
    _, out, _, model, drafter = exported
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    engine = OrtDrafterEngine(out)
    assert engine.max_context is None  # ONNX Runtime: no limit of its own
    decoder = BatchDecoder(target, engine)
    prompt = list(range(1, 11))
    decoder.new_row(prompt, GenerationConfig(max_new_tokens=30))
    engine.max_context = 32
    with pytest.raises(ContextLengthError, match="= 40 exceeds the drafter's context length 32"):
        decoder.new_row(prompt, GenerationConfig(max_new_tokens=30))
    decoder.new_row(prompt, GenerationConfig(max_new_tokens=30, block_size=1))  # target alone: drafter unused
    assert len(generate_one(decoder, prompt, GenerationConfig(max_new_tokens=22)).token_ids) == 22  # at the limit
    target_limit = target.max_context
    engine.max_context = target_limit + 100  # the smaller of the two limits applies
    with pytest.raises(ContextLengthError, match=f"exceeds the target's context length {target_limit}"):
        decoder.new_row(prompt, GenerationConfig(max_new_tokens=target_limit))


def test_sessions_do_not_spin_next_to_the_target(exported):
    """onnxruntime's intra-op workers spin after a run by default; next to the PyTorch target on the same
    cores that halved the target's speed (runtime.cpu_threads.ort_session_options), so every session we
    open turns it off, and still takes the thread count it is given."""
    _, out, _, _, _ = exported
    for threads in (None, 1):
        engine = OrtDrafterEngine(out, threads=threads)
        options = engine.session.get_session_options()
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
        assert options.intra_op_num_threads == (threads or 0)
