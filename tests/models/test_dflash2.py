"""DFlash 2 drafters (z-lab's `dflash` 0.1.0 DFlash2DraftModel) against the reference package itself.

The oracle: a tiny random DFlash 2 drafter made and saved by the reference's own class, next to a tiny random
Qwen3 target. It loads as is; our forward and proposals equal the reference modules'; round for round the
drafted tokens equal the reference's `dflash_generate`; greedy output equals the target alone; the PyTorch,
batched and ONNX Runtime drafters give the same drafts; sampled output has the target's own distribution.
"""

import time

import pytest
import torch
from helpers import generate_one, hf_greedy, make_tokenizer, sequence_engines
from reference import draft_agreement, run_ours, run_reference
from tiny_models import make_tiny_target
from transformers import Qwen3Config

from dflash_trt.config import ConfigError, build_target_layer_ids, drafter_config_from_dict
from dflash_trt.decoding import BatchDecoder, GenerationConfig, SamplingParams
from dflash_trt.loading import load_decoder
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.target import save_portable
from dflash_trt.runtime.base import DraftRequest
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchDrafterSession, TorchTargetEngine

ref = pytest.importorskip("dflash.model", reason="the reference package `dflash` (test dependency)")

VOCAB, TARGET_LAYERS, BLOCK, TOP_K = 96, 4, 8, 4
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def dflash2_fields(top_k: int = TOP_K) -> dict:
    return {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": top_k}


def reference_config(target_config, block_size: int = BLOCK, top_k: int = TOP_K, layers: int = 2) -> Qwen3Config:
    n = target_config.num_hidden_layers
    vocab = target_config.vocab_size
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=target_config.hidden_size,
        intermediate_size=2 * target_config.hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=target_config.hidden_size // 4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        num_target_layers=n,
        architectures=["DFlash2DraftModel"],
        dflash_config={
            "mask_token_id": vocab - 1,
            "target_layer_ids": build_target_layer_ids(n, layers),
            "block_size": block_size,
            **dflash2_fields(top_k),
        },
    )


def randomize(model: torch.nn.Module, seed: int, selector: float = 1.0, std: float = 0.05) -> None:
    """Random weights whose every DFlash 2 part matters: convolution bases and selector codebooks large
    enough to change the draft (the reference leaves base_kernel uninitialised); `selector` scales the
    codebooks and convolution bases, `std` the other matrices."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "base_kernel" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 * selector)
            elif "codebook" in name:
                p.copy_(torch.randn(p.shape, generator=g) * selector)
            elif "hidden_projection" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 10 * std)
            elif p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * std)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """root/target (a tiny Qwen3 with a tokenizer, so it serves) and root/drafter, written by the reference's
    DFlash2DraftModel.save_pretrained; returns (root, target, reference drafter)."""
    root = tmp_path_factory.mktemp("dflash2")
    tok = make_tokenizer(root / "target", vocab_size=VOCAB)
    target = make_tiny_target(vocab_size=len(tok), layers=TARGET_LAYERS, seed=5)
    with torch.no_grad():
        target.lm_head.weight.mul_(8)  # sharper target: drafts differ from round to round
    save_portable(target, root / "target")
    reference = ref.DFlash2DraftModel(reference_config(target.config))
    randomize(reference, 6)
    reference.eval().save_pretrained(root / "drafter")
    return root, target, reference


@pytest.fixture(scope="module")
def pair(checkpoints):
    """(target, reference DFlash2DraftModel, our drafter loaded from the reference's checkpoint as is)."""
    root, target, reference = checkpoints
    return target, reference, DFlashDrafter.from_pretrained(root / "drafter")


def test_reference_checkpoint_loads_as_dflash2(pair, tmp_path):
    _, _, ours = pair
    assert ours.spec.generation == 2 and ours.spec.selector_top_k == TOP_K
    assert ours.candidate_selector is not None and ours.decoder_layers[0].mlp_conv is not None
    ours.save_pretrained(tmp_path / "again")  # written back in the reference's layout, with its dtype
    again = DFlashDrafter.from_pretrained(tmp_path / "again")
    assert again.spec == ours.spec
    import json

    raw = json.loads((tmp_path / "again" / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"] and raw["dtype"] == "float32"
    assert raw["dflash_config"]["selector_top_k"] == TOP_K


@pytest.mark.parametrize(
    "change, field",
    [
        ({"selector_top_k": 0}, "selector_top_k"),
        ({"conv_group_size": 24}, "conv_group_size"),
        ({"conv_kernel_size": None}, "conv_kernel_size"),
    ],
)
def test_bad_dflash2_fields_are_refused_by_name(pair, change, field):
    raw = reference_config(pair[0].config).to_dict()
    raw["dflash_config"].update(change)
    with pytest.raises(ConfigError, match=field):
        drafter_config_from_dict(raw)


def test_unknown_drafter_layer_type_is_refused_by_name(pair):
    raw = reference_config(pair[0].config).to_dict()
    raw["layer_types"] = ["full_attention", "linear_attention"]
    with pytest.raises(ConfigError, match="linear_attention"):
        drafter_config_from_dict(raw)


@torch.inference_mode()
def test_forward_and_proposal_equal_the_reference(pair):
    target, reference, ours = pair
    g = torch.Generator().manual_seed(0)
    n, feature_size = 5, ours.feature_size
    features = torch.randn(1, n, feature_size, generator=g)
    block = torch.full((1, BLOCK), ours.spec.mask_token_id)
    block[0, 0] = 7
    embeds = ours.embed_block(block, target.model.embed_tokens.weight)
    got, _, _ = ours(features, embeds, *ours.empty_cache())
    want = reference(
        target_hidden=features, noise_embedding=embeds, position_ids=torch.arange(n + BLOCK)[None], use_cache=False
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

    logits, tokens, candidates, scores = ours.block_outputs(got[:, 1:], block[:, 0], target.lm_head.weight)
    path, ref_candidates, _ = reference.propose(want[:, 1:], block[:, 0], target.lm_head, 0.0)
    assert tokens.tolist() == path.tolist()
    assert torch.equal(candidates.sort(-1).values, ref_candidates.sort(-1).values)
    assert candidates.shape == (1, BLOCK - 1, TOP_K) and scores.shape == (1, BLOCK - 1, TOP_K, TOP_K)
    # the selector changes the draft somewhere (else this test could not tell it from DFlash 1's argmax)
    assert tokens.tolist() != logits.argmax(-1).tolist()


def _reference_rounds(target, reference, prompt, n, monkeypatch):
    """dflash_generate's output, its drafted tokens per round (recorded from its own propose calls) and its
    acceptance lengths. Its stats clock synchronises CUDA: the CPU's clock here."""
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)
    drafted = []
    propose = reference.propose

    def recording(*args, **kwargs):
        out = propose(*args, **kwargs)
        drafted.append(out[0][0].tolist())
        return out

    reference.propose = recording
    try:
        out = ref.dflash_generate(reference, target, torch.tensor([prompt]), n, None, return_stats=True)
    finally:
        del reference.propose
    return out.output_ids[0, len(prompt) :].tolist(), drafted, out.acceptance_lengths


def _our_rounds(target, ours, prompt, n, monkeypatch):
    drafted = []
    draft = TorchDrafterSession.draft

    def recording(self, requests):
        out = draft(self, requests)
        drafted.extend(d.tokens.tolist() for d in out)
        return out

    monkeypatch.setattr(TorchDrafterSession, "draft", recording)
    engine = TorchTargetEngine(target, ours.spec.target_layer_ids)
    decoder = BatchDecoder(engine, TorchDrafterEngine.for_target(ours, engine))
    got = generate_one(decoder, prompt, GenerationConfig(max_new_tokens=n))
    monkeypatch.undo()
    return got, drafted


def test_rounds_equal_reference_and_output_equals_target_alone(pair, monkeypatch):
    """Round for round, while both run whole blocks. Near the end the two size the last blocks differently (the
    reference drafts one token more than a round can keep), and a drafter's block attention is bidirectional,
    so a shorter block drafts other tokens: the reference runs BLOCK tokens longer, and our tail rounds (shorter
    blocks, at most BLOCK - 1 of them) are left out."""
    target, reference, ours = pair
    n = 40
    want_ids, want_rounds, want_lengths = _reference_rounds(target, reference, PROMPT, n + BLOCK, monkeypatch)
    got, got_rounds = _our_rounds(target, ours, PROMPT, n, monkeypatch)
    assert got.token_ids == want_ids[:n] == hf_greedy(target, PROMPT, n)
    whole = [r for r in got_rounds if len(r) == BLOCK - 1]
    assert len(whole) >= len(got_rounds) - (BLOCK - 1) and whole == got_rounds[: len(whole)]
    same = sum(a == b for a, b in zip(whole, want_rounds))
    assert same >= 0.95 * len(whole), f"{same} of {len(whole)} rounds drafted as the reference did"
    assert got.stats.acceptance_lengths[: len(whole)] == want_lengths[: len(whole)]


def _requests(ours, rows, rnd):
    """Ragged draft requests: per row its own new-context length and block size (the same on every engine)."""
    g = torch.Generator().manual_seed(10 + rnd)
    sizes = [(6, BLOCK), (2, 3), (4, BLOCK - 1)]
    return [
        DraftRequest(row, torch.randn((n if rnd else n + 5), ours.feature_size, generator=g), 11 + row + rnd, block)
        for row, (n, block) in zip(rows, sizes)
    ]


def _draft_rounds(engine, ours, rounds=3):
    session = engine.new_session()
    rows = [session.add_row() for _ in range(3)]
    return [session.draft(_requests(ours, rows, rnd)) for rnd in range(rounds)]


def test_engines_give_the_same_drafts_and_serve(checkpoints, pair, tmp_path):
    """`make engines` on CPU (builders/engines.py) exports the reference's checkpoint; the PyTorch drafter (its
    own forward, row by row), the batched PyTorch drafter and both ONNX Runtime graphs draft alike; the engines
    folder serves, concurrent rows of mixed lengths each equal to the target alone."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from server_harness import running_server

    from dflash_trt.builders.engines import build_engines, read_config
    from dflash_trt.loading import load_decoder_from_engines
    from dflash_trt.runtime.ort_backend import OrtDrafterEngine

    root, target, _ = checkpoints
    ours = pair[2]
    settings = {"target": str(root / "target"), "drafter": str(root / "drafter"), "output": str(tmp_path / "eng")}
    manifest, report = build_engines(read_config(None, tmp_path, settings), log=lambda *_: None)
    assert report.built == ["drafter_onnx"] and manifest["serve"]["drafter"] == "drafter_onnx"
    folder = tmp_path / "eng" / manifest["engines"]["drafter_onnx"]["dir"]
    single = tmp_path / "single"  # the single-sequence graph alone (an engine prefers the batched one)
    single.mkdir()
    for name in ("drafter.onnx", "drafter.onnx.data", "drafter.json"):
        shutil.copy(folder / name, single / name)
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    engines = {
        "batched": TorchDrafterEngine(ours, embed, head),
        "pytorch": sequence_engines(target, ours)[1],  # the drafter's own forward, one row at a time
        "ort": OrtDrafterEngine(single),
        "ort-batched": OrtDrafterEngine(folder),
    }
    assert engines["ort-batched"].batched and not engines["ort"].batched
    drafts = {name: _draft_rounds(engine, ours) for name, engine in engines.items()}
    for name, rounds in drafts.items():
        for rnd, (mine, base) in enumerate(zip(rounds, drafts["batched"])):
            for a, b in zip(mine, base):
                assert a.tokens.tolist() == b.tokens.tolist(), (name, rnd)
                assert a.candidates.tolist() == b.candidates.tolist(), (name, rnd)
                torch.testing.assert_close(a.step_scores, b.step_scores, rtol=1e-4, atol=1e-4)

    prompts, n = [PROMPT, PROMPT[:3], PROMPT * 3], 12
    decoder = load_decoder_from_engines(tmp_path / "eng")
    alone = [
        generate_one(BatchDecoder(decoder.target), p, GenerationConfig(max_new_tokens=n)).token_ids for p in prompts
    ]
    with running_server(decoder) as (url, _):

        def generate(prompt):
            body = {"input_ids": prompt, "max_tokens": n}
            return httpx.post(url + "/generate", json=body, timeout=120).json()["token_ids"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            served = list(pool.map(generate, prompts))
    assert served == alone and all(a == hf_greedy(target, p, len(a)) for a, p in zip(alone, prompts))


# ---------------------------------------------------------------------------------------
# Sampling: the candidate-set proposal is exact (tests/decoding/test_spec.py's distribution test).
# ---------------------------------------------------------------------------------------
SMALL_V, N_SAMPLES = 6, 1000


@pytest.fixture(scope="module")
def sharp_dflash2():
    from tiny_models import tiny_drafter_config

    model = make_tiny_target(vocab_size=SMALL_V, layers=4, hidden=32, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    raw = tiny_drafter_config(model.config, layers=1, block_size=4, mask_token_id=SMALL_V - 1)
    raw["architectures"] = ["DFlash2DraftModel"]
    raw["dflash_config"].update(dflash2_fields(top_k=3), conv_group_size=8)
    drafter = DFlashDrafter.from_config(raw)
    randomize(drafter, 5, selector=0.3, std=0.02)  # drafts the target accepts about a quarter of the time
    return model, drafter.eval()


@pytest.mark.slow
def test_sampling_with_the_selector_is_lossless(sharp_dflash2):
    """T = 0.8 with top-k 4 on the target: the selector's own q (temperature only, over its 3 candidates)
    differs from the target's warping, and the output must still be the target's distribution."""
    params = SamplingParams(temperature=0.8, top_k=4)
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "decoding"))
    from test_spec import chi_square_pvalue, exact_joint

    model, drafter = sharp_dflash2
    prompt = [1, 2, 3]
    engine = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    decoder = BatchDecoder(engine, TorchDrafterEngine.for_target(drafter, engine))
    counts: dict = {}
    accepted = 0
    for seed in range(N_SAMPLES):
        config = GenerationConfig(
            max_new_tokens=3, sampling=SamplingParams(params.temperature, top_k=params.top_k, seed=seed)
        )
        r = generate_one(decoder, prompt, config)
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
        accepted += r.stats.accepted_draft_tokens
    assert accepted > N_SAMPLES * 0.1, "drafts must be accepted often enough to test acceptance"
    p = chi_square_pvalue(counts, exact_joint(model, prompt, params, 3), N_SAMPLES)
    assert p > 1e-3, f"speculative samples deviate from the target distribution (p={p:.2e})"


@pytest.mark.slow
def test_sample_path_draws_each_position_after_the_one_drawn_before():
    """The sampled walk: position 1's candidate is drawn from the step_scores row of position 0's choice, and
    the q it returns is that row's softmax on the candidates (exactly what accept_rejection must judge)."""
    from dflash_trt.decoding.acceptance import sample_path
    from dflash_trt.runtime.base import Draft

    g = torch.Generator().manual_seed(1)
    candidates = torch.tensor([[4, 0, 2], [1, 5, 3]])
    scores = torch.randn(2, 3, 3, generator=g) * 2
    draft = Draft(logits=torch.zeros(2, 6), tokens=candidates[:, 0], candidates=candidates, step_scores=scores)
    t, n = 0.7, 3000
    first = torch.softmax(scores[0, 0] / t, -1)
    joint = {
        (int(a), int(b)): float(first[i] * torch.softmax(scores[1, i] / t, -1)[j])
        for i, a in enumerate(candidates[0])
        for j, b in enumerate(candidates[1])
    }
    counts: dict = {}
    for _ in range(n):
        tokens, q = sample_path(draft, t, g)
        counts[tuple(tokens.tolist())] = counts.get(tuple(tokens.tolist()), 0) + 1
        i = candidates[0].tolist().index(int(tokens[0]))
        assert torch.allclose(q[1, candidates[1]], torch.softmax(scores[1, i] / t, -1)) and q[1].sum() == pytest.approx(
            1
        )
    from scipy.stats import chisquare

    cells = sorted(joint)
    assert chisquare([counts.get(c, 0) for c in cells], [joint[c] * n for c in cells]).pvalue > 1e-3


@torch.inference_mode()
def test_newer_dflash1_fields_equal_the_reference(pair):
    """A DFlash 1 drafter with the newer fields: a sliding-window layer (causal, as the reference makes it),
    input_embedding_scale, output_multiplier and final_logit_softcapping, all inside dflash_config."""
    target = pair[0]
    config = reference_config(target.config)
    config.architectures = ["DFlashDraftModel"]
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        del config.dflash_config[name]
    config.layer_types = ["sliding_attention", "full_attention"]
    config.use_sliding_window, config.sliding_window = True, 3  # Qwen3Config keeps the window only with both
    config.dflash_config.update(input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=4.0)
    config = Qwen3Config.from_dict(config.to_dict())  # as a checkpoint's config.json reads
    reference = ref.DFlashDraftModel(config)
    randomize(reference, 7)
    ours = DFlashDrafter.from_config(config.to_dict())
    ours.load_state_dict(reference.state_dict())
    first = ours.decoder_layers[0].self_attn
    assert (
        ours.spec.generation == 1
        and first.causal
        and first.window == 3
        and reference.layers[0].self_attn.sliding_window == 3
    )
    features = torch.randn(1, 5, ours.feature_size, generator=torch.Generator().manual_seed(2))
    block = torch.tensor([[7] + [ours.spec.mask_token_id] * (BLOCK - 1)])
    embeds = ours.embed_block(block, target.model.embed_tokens.weight)
    torch.testing.assert_close(embeds, ref._raw_input_embeddings(target, block, 2.0))
    got, _, _ = ours(features, embeds, *ours.empty_cache())
    want = reference(target_hidden=features, noise_embedding=embeds, position_ids=torch.arange(5 + BLOCK)[None])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        ours.logits(got, target.lm_head.weight), reference.compute_logits(want, target.lm_head), rtol=1e-4, atol=1e-5
    )


def test_dflash2_on_a_hybrid_qwen3_5_target_equals_the_target_and_the_reference(tmp_path):
    """The issue's second DFlash 2 pair: a tiny random Qwen3.5 target (Gated DeltaNet layers between full-attention
    ones, run row by row with the linear-attention rollback) and a DFlash 2 drafter written by the reference's own
    class. Greedy output is the target's own, drafts are the reference's round for round (tests/reference.py),
    and rows of mixed lengths decoded together equal each row alone."""
    target = make_tiny_target(None, family="qwen3_5", vocab_size=VOCAB, layers=TARGET_LAYERS, seed=3)
    save_portable(target, tmp_path / "target")
    drafter = ref.DFlash2DraftModel(reference_config(target.config, block_size=4))
    randomize(drafter, 8)
    drafter.eval().save_pretrained(tmp_path / "drafter")
    prompts = [PROMPT, [5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41], [2, 4]]
    for prompt in prompts[:2]:
        ours = run_ours(tmp_path / "target", tmp_path / "drafter", prompt, 4, 16)
        want = run_reference(tmp_path / "target", tmp_path / "drafter", prompt, 4, 16)
        assert ours.output_ids == want.output_ids == hf_greedy(target, prompt, 16)
        assert draft_agreement(ours, want) >= 0.95, (ours.drafted, want.drafted)
    decoder = load_decoder(tmp_path / "target", tmp_path / "drafter")
    together = decoder.generate(prompts, GenerationConfig(max_new_tokens=12, block_size=4))
    assert [r.token_ids for r in together] == [hf_greedy(target, p, 12) for p in prompts]
