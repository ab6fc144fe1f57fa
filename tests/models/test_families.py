"""Target families beside Qwen3 (Qwen3.5 and Qwen3.5-MoE hybrids, gpt-oss, Gemma 4, LLaMA 3.x, Qwen3-MoE): tiny
random fp32 targets with a DFlash 1 drafter built by z-lab's reference class. Greedy output is the target's
own, drafts are the reference's (`dflash_generate`, tests/reference.py) round for round, rows decoded together
equal each row alone, partial acceptance leaves every row where the target alone is (the linear-attention
rollback), and sampled output has the target's distribution."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch
from helpers import NoisyOracleDrafter, generate_one, hf_greedy
from reference import draft_agreement, make_reference_drafter, run_ours, run_reference
from server_harness import running_server
from tiny_models import make_tiny_drafter, make_tiny_target

from dflash_trt.decoding import BatchDecoder, GenerationConfig, SamplingParams
from dflash_trt.loading import load_decoder
from dflash_trt.models.target import SUPPORTED_FAMILIES, load_target, save_portable
from dflash_trt.runtime.hybrid import HfRowSequence
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine

pytest.importorskip("dflash.model")  # z-lab's reference, installed by the Makefile (pip --no-deps)

FAMILIES = ["qwen3", "llama3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gpt_oss", "gemma4"]
BATCHED = {"qwen3", "llama3", "qwen3_moe"}  # the layered engine; the others run per row (runtime/hybrid.py)
VOCAB, BLOCK = 128, 4


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(family, target dir, drafter dir, target model): saved as published checkpoints are."""
    root = tmp_path_factory.mktemp(f"family-{request.param}")
    model = make_tiny_target(None, family=request.param, vocab_size=VOCAB, layers=4, seed=0)
    save_portable(model, root / "target")
    make_reference_drafter(model.config, root / "drafter", layers=1, block_size=BLOCK)
    return request.param, root / "target", root / "drafter", load_target(root / "target")


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [11, 3, 17, 9][:n]  # past the tiny sliding windows (8) and not
    return [torch.randint(3, VOCAB - 2, (k,), generator=g).tolist() for k in lengths]


def test_greedy_is_the_target_and_drafts_are_the_reference(family):
    name, target_dir, drafter_dir, model = family
    assert (TorchTargetEngine(model).per_row_reason is None) == (name in BATCHED)
    for prompt in _prompts(2):
        ours = run_ours(target_dir, drafter_dir, prompt, BLOCK, 20)
        ref = run_reference(target_dir, drafter_dir, prompt, BLOCK, 20)
        assert ours.output_ids == hf_greedy(model, prompt, 20)
        assert ours.output_ids == ref.output_ids
        agreement = draft_agreement(ours, ref)
        assert agreement >= 0.95, (name, agreement, ours.drafted, ref.drafted)
        # the committed counts agree but for the last round (ours runs one token longer: tests/reference.py)
        assert ours.committed[: len(ref.committed) - 1] == ref.committed[:-1]


def test_partial_acceptance_leaves_each_row_where_the_target_alone_is(family):
    """Rounds keep anywhere from 0 to B-1 drafts, so rollbacks cut blocks (and linear-attention state) anywhere."""
    name, _, _, model = family
    base = BatchDecoder(TorchTargetEngine(model))
    lengths = set()
    for trial, prompt in enumerate(_prompts(2, seed=1)):
        expected = generate_one(base, prompt, GenerationConfig(max_new_tokens=30)).token_ids
        oracle = NoisyOracleDrafter(expected, len(prompt), VOCAB, 8, 0.7, seed=trial, feature_layer_ids=(0,))
        spec = BatchDecoder(TorchTargetEngine(model, (0,)), oracle)
        got = generate_one(spec, prompt, GenerationConfig(max_new_tokens=30, block_size=8))
        assert got.token_ids == expected, (name, trial)
        lengths |= set(got.stats.acceptance_lengths[:-1])
    assert len(lengths) >= 3, lengths  # partial blocks were kept, not only none or all


def test_partial_acceptance_test_catches_a_rollback_that_keeps_linear_state(monkeypatch):
    """Negative control: cutting only the K/V back (the linear-attention state left after the whole block)
    must make the test above fail."""

    def kv_only_rollback(self, length):
        for layer in self.cache.layers:
            layer.crop(0 if hasattr(layer, "conv_states") else length - self._length)
        self._length, self._undoable, self._pending_trim = length, 0, False

    monkeypatch.setattr(HfRowSequence, "rollback", kv_only_rollback)
    model = make_tiny_target(None, family="qwen3_5", vocab_size=VOCAB, layers=4, seed=0)
    with pytest.raises(AssertionError):
        test_partial_acceptance_leaves_each_row_where_the_target_alone_is(("qwen3_5", None, None, model))


def _mixed_rows(decoder: BatchDecoder) -> list[list[int]]:
    """Four rows of mixed lengths: two join, two more after two steps; all run to the end together."""
    prompts, budgets = _prompts(4, seed=2), [18, 7, 12, 15]
    rows = [decoder.add(p, GenerationConfig(max_new_tokens=n)) for p, n in zip(prompts[:2], budgets[:2])]
    decoder.step()
    decoder.step()
    rows += [decoder.add(p, GenerationConfig(max_new_tokens=n)) for p, n in zip(prompts[2:], budgets[2:])]
    decoder.run()
    return [r.result().token_ids for r in rows]


def test_concurrent_rows_equal_each_row_alone(family):
    name, target_dir, drafter_dir, _ = family
    together = _mixed_rows(load_decoder(target_dir, drafter_dir))
    prompts, budgets = _prompts(4, seed=2), [18, 7, 12, 15]
    alone = load_decoder(target_dir, drafter_dir)
    for p, n, got in zip(prompts, budgets, together):
        assert got == generate_one(alone, p, GenerationConfig(max_new_tokens=n)).token_ids, name


def test_hybrid_rows_through_the_server_equal_each_alone(tmp_path):
    model = make_tiny_target(None, family="qwen3_5", vocab_size=VOCAB, layers=4, seed=3)
    save_portable(model, tmp_path / "target")
    make_reference_drafter(model.config, tmp_path / "drafter", layers=1, block_size=BLOCK)
    decoder = load_decoder(tmp_path / "target", tmp_path / "drafter")
    bodies = [{"input_ids": p, "max_tokens": n} for p, n in zip(_prompts(4, seed=4), [14, 6, 10, 12])]
    with running_server(decoder) as (url, _):
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda b: httpx.post(url + "/generate", json=b, timeout=120).json(), bodies))
    alone = load_decoder(tmp_path / "target", tmp_path / "drafter")
    for body, reply in zip(bodies, replies):
        want = generate_one(alone, body["input_ids"], GenerationConfig(max_new_tokens=body["max_tokens"]))
        assert reply["token_ids"] == want.token_ids


# Sampling on the hybrid target: the first tokens' joint distribution is the target's own, computed exactly.
V, N_SAMPLES, N_TOKENS = 6, 800, 3


def _exact_joint(model, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    from dflash_trt.decoding.sampling import probabilities

    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(N_TOKENS):
        seqs = list(probs)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(s) for s in seqs])).logits[:, -1]
        p = probabilities(logits, params)
        probs = {s + (t,): probs[s] * float(p[i, t]) for i, s in enumerate(seqs) for t in range(V) if p[i, t] > 0}
    return probs


@pytest.mark.slow
def test_sampling_on_a_hybrid_target_is_lossless():
    from scipy.stats import chisquare

    model = make_tiny_target(None, family="qwen3_5", vocab_size=V, layers=4, hidden=32, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # sharper: about half the drafts are rejected, so residuals are drawn
    drafter = make_tiny_drafter(model.config, layers=1, block_size=BLOCK, seed=4, mask_token_id=V - 1)
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    assert target.per_row_reason is not None
    spec = BatchDecoder(target, TorchDrafterEngine.for_target(drafter, target))
    prompt = [1, 2, 3]
    configs = [
        GenerationConfig(max_new_tokens=N_TOKENS, sampling=SamplingParams(temperature=1.0, seed=s), block_size=BLOCK)
        for s in range(N_SAMPLES)
    ]
    results = []  # batches of 100 rows, each drawing with its own seed
    for i in range(0, N_SAMPLES, 100):
        results += spec.generate([prompt] * len(configs[i : i + 100]), configs[i : i + 100])
    counts: dict[tuple[int, ...], int] = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    accepted = sum(r.stats.accepted_draft_tokens for r in results)
    assert accepted > N_SAMPLES * 0.1, "drafts must be accepted often enough to test acceptance"
    expected = _exact_joint(model, prompt, SamplingParams(temperature=1.0))
    assert set(counts) <= set(expected)
    cells = sorted(expected, key=expected.get, reverse=True)
    big = [c for c in cells if expected[c] * N_SAMPLES >= 5]
    rest = 1.0 - sum(expected[c] for c in big)
    observed = [counts.get(c, 0) for c in big] + [N_SAMPLES - sum(counts.get(c, 0) for c in big)]
    wanted = [expected[c] * N_SAMPLES for c in big] + [rest * N_SAMPLES]
    assert chisquare(observed, wanted).pvalue > 1e-3


def test_hybrid_rollback_reaches_back_one_pass_only():
    model = make_tiny_target(None, family="qwen3_5", vocab_size=VOCAB, layers=4, seed=5)
    row = HfRowSequence(model, ())
    row.forward(torch.tensor([4, 5, 6, 7]), last_logits_only=True)
    with pytest.raises(ValueError, match="only the last pass's 0 can be undone"):
        row.rollback(2)  # a prefill keeps no per-token states
    row.forward(torch.tensor([8, 9, 10]))
    with pytest.raises(ValueError, match="holds 7 tokens"):
        row.rollback(3)
    row.rollback(5)
    assert row.length == 5


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_multimodal_qwen3_5_checkpoint_loads_as_its_text_model(tmp_path, family):
    """Published Qwen3.5 checkpoints are the vision-language model (model_type qwen3_5 / qwen3_5_moe): the
    target is its language model, with the same logits, run per row."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = make_tiny_target(None, family=family, vocab_size=VOCAB, layers=4).config.to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
    config = AutoConfig.for_model(family, text_config=text, vision_config=vision)
    torch.manual_seed(0)
    full = AutoModelForImageTextToText.from_config(config).eval()
    full.save_pretrained(tmp_path)
    model = load_target(tmp_path)
    ids = torch.tensor([[5, 9, 13, 22, 40]])
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, full(input_ids=ids).logits, atol=1e-5)
    assert TorchTargetEngine(model).per_row_reason is not None


def test_unsupported_family_is_refused_by_name(tmp_path):
    from transformers import Phi3Config

    Phi3Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'phi3' is not supported") as info:
        load_target(tmp_path)
    assert all(f in str(info.value) for f in SUPPORTED_FAMILIES)


def test_hybrid_target_through_make_engines_and_serve(tmp_path):
    """`make engines` on CPU (the drafter exported to ONNX, the target served by PyTorch) for a Qwen3.5
    target, then the server on the built engines: greedy output is the target's own."""
    from dflash_trt.builders.engines import build_engines, read_config
    from dflash_trt.loading import load_decoder_from_engines

    model = make_tiny_target(tmp_path / "target", family="qwen3_5", vocab_size=VOCAB, layers=4, seed=6)
    make_tiny_drafter(model.config, tmp_path / "drafter", layers=1, block_size=BLOCK)
    paths = {"target": "target", "drafter": "drafter", "output": "engines"}
    manifest, _ = build_engines(read_config(None, tmp_path, paths), log=lambda *_: None)
    assert manifest["serve"]["target"] == "target_torch" and manifest["serve"]["drafter"] == "drafter_onnx"
    decoder = load_decoder_from_engines(tmp_path / "engines")
    assert decoder.drafter is not None and decoder.drafter.name != "torch"
    prompt = _prompts(1, seed=5)[0]
    with running_server(decoder) as (url, _):
        reply = httpx.post(url + "/generate", json={"input_ids": prompt, "max_tokens": 16}, timeout=120).json()
    assert reply["token_ids"] == hf_greedy(model, prompt, 16)
    assert reply["spec"]["rounds"] >= 1


# Rollback on the installed transformers (runtime/hybrid.py, "What the installed transformers can do").
def _before_5_25(monkeypatch) -> None:
    """The linear-attention layers as transformers 5.16-5.24 write them (read in 5.17.0's cache_utils.py):
    `activate_past_recording(self)` takes no budget and keeps no per-token recurrent state."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    def activate_past_recording(self):
        self.record_past = True
        self.recurrent_states_history = dict.fromkeys(range(self.number_of_states), [])  # what 5.25's crop reads

    monkeypatch.setattr(LinearAttentionCacheLayerMixin, "activate_past_recording", activate_past_recording)


def test_rollback_mode_follows_what_the_installed_transformers_records():
    hybrid = make_tiny_target(None, family="qwen3_5", vocab_size=VOCAB, layers=4, seed=0)
    windowed = make_tiny_target(None, family="gpt_oss", vocab_size=VOCAB, layers=4, seed=0)
    assert HfRowSequence(hybrid, ()).mode == "recorded"  # transformers 5.25 in this venv
    assert HfRowSequence(windowed, ()).mode == "none"  # no linear-attention layer


def test_a_transformers_without_per_token_states_replays_and_stays_the_target(monkeypatch):
    """Before 5.25 the budget argument is a TypeError at the first row; the replay fallback needs nothing new
    and leaves every row where the target alone is, whatever prefix a round keeps."""
    _before_5_25(monkeypatch)
    for family in ("qwen3_5", "qwen3_5_moe"):
        model = make_tiny_target(None, family=family, vocab_size=VOCAB, layers=4, seed=0)
        assert HfRowSequence(model, ()).mode == "replay"
        test_partial_acceptance_leaves_each_row_where_the_target_alone_is((family, None, None, model))


def test_replay_without_running_the_kept_tokens_again_is_caught(monkeypatch):
    """Negative control: a replay that restores the saved state but does not run the kept tokens again."""
    _before_5_25(monkeypatch)

    def restore_only(self, length):
        for i, layer in enumerate(self.cache.layers):
            if i in self._saved:
                self.cache.layers[i] = self._saved[i]
            else:
                layer.crop(-(self._length - length))
        self._saved, self._pass_ids = {}, None

    monkeypatch.setattr(HfRowSequence, "_replay", restore_only)
    model = make_tiny_target(None, family="qwen3_5", vocab_size=VOCAB, layers=4, seed=0)
    with pytest.raises(AssertionError):
        test_partial_acceptance_leaves_each_row_where_the_target_alone_is(("qwen3_5", None, None, model))


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4"])
def test_sliding_window_features_after_rollbacks_are_one_full_forward(family, monkeypatch):
    """The features the drafter is given, pass after pass through rollbacks of a 16-token window (rounds keep
    0 to B-1 drafts, so layers are cut across the window's edge), are those of one forward without a cache
    over the committed tokens and the block: every row of every pass, 60 tokens past a 17-token prompt."""
    model = make_tiny_target(None, family=family, vocab_size=VOCAB, layers=4, seed=0, sliding_window=16)
    layers = (1, 2)
    passes: list[tuple[int, list[int], torch.Tensor]] = []
    run = HfRowSequence._run

    def recorded(self, token_ids, last_logits_only, want):
        start = self.length
        out = run(self, token_ids, last_logits_only, want)
        if out.features is not None:
            passes.append((start, token_ids.view(-1).tolist(), out.features))
        return out

    monkeypatch.setattr(HfRowSequence, "_run", recorded)
    prompt = _prompts(3, seed=7)[2]
    expected = hf_greedy(model, prompt, 60)
    oracle = NoisyOracleDrafter(expected, len(prompt), VOCAB, 4, 0.6, seed=3, feature_layer_ids=layers)
    got = generate_one(
        BatchDecoder(TorchTargetEngine(model, layers), oracle), prompt, GenerationConfig(60, block_size=4)
    )
    assert got.token_ids == expected
    assert len(set(got.stats.acceptance_lengths[:-1])) >= 3
    committed = prompt + expected
    with torch.no_grad():
        for start, block, feats in passes:
            hidden = model(input_ids=torch.tensor([committed[:start] + block]), output_hidden_states=True).hidden_states
            want = torch.cat([hidden[i + 1][0, start:] for i in layers], dim=-1)
            assert torch.allclose(feats, want, atol=1e-4), (family, start, float((feats - want).abs().max()))
    assert max(start for start, _, _ in passes) > 3 * 16
