"""Penalties, logit_bias and min_tokens inside draft-and-verify stay lossless: greedy output equals the
target alone under the same adjustment (itself checked against a plain step-by-step loop), and sampled
output has the adjusted target's distribution exactly (chi-square against the exactly computed joint).
"""

import pytest
import torch
from helpers import NoisyOracleDrafter, generate_one
from test_spec import chi_square_pvalue
from tiny_models import make_tiny_drafter, make_tiny_target

from dflash_trt.decoding import BatchDecoder, GenerationConfig, LogitsAdjustment, SamplingParams
from dflash_trt.decoding.sampling import probabilities
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine

N_SAMPLES = 1000
ADJUST = LogitsAdjustment.of(
    frequency_penalty=0.7,
    presence_penalty=0.6,
    logit_bias={1: 1.5, 7: -3.0, 9: 2.0},
    min_tokens=5,
    min_tokens_suppress=(2, 3),
)


def naive_adjust(logits: torch.Tensor, generated: list[int], adj: LogitsAdjustment) -> torch.Tensor:
    """One row, written out as OpenAI / vLLM describe it, independently of LogitsAdjustment.apply."""
    out = logits.float().clone()
    for tok, bias in adj.logit_bias:
        out[tok] += bias
    for tok in set(generated):
        out[tok] -= generated.count(tok) * adj.frequency_penalty + adj.presence_penalty
    if len(generated) < adj.min_tokens:
        for tok in adj.min_tokens_suppress:
            out[tok] = float("-inf")
    return out


def naive_greedy(model, prompt: list[int], n: int, adj: LogitsAdjustment) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
        out.append(int(naive_adjust(logits, out, adj).argmax()))
    return out


def test_apply_row_i_sees_the_drafts_before_it():
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(0))
    generated, draft = [1, 9, 9, 4], [9, 1, 5]
    got = ADJUST.apply(logits, generated, draft)
    for i in range(4):
        assert torch.allclose(got[i], naive_adjust(logits[i], generated + draft[:i], ADJUST), atol=1e-5), i
    assert LogitsAdjustment.of() is None and LogitsAdjustment.of(min_tokens=3) is None  # nothing to do


def test_greedy_with_adjustment_equals_target_alone(tiny_pair):
    family, _, _, model, drafter = tiny_pair
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    spec = BatchDecoder(target, TorchDrafterEngine.for_target(drafter, target))
    base = BatchDecoder(TorchTargetEngine(model))
    rng = torch.Generator().manual_seed(5)
    n = 24
    for trial in range(3):
        prompt = torch.randint(0, 95, (int(torch.randint(2, 30, (1,), generator=rng)),), generator=rng).tolist()
        want = generate_one(base, prompt, GenerationConfig(max_new_tokens=n, adjust=ADJUST)).token_ids
        if trial == 0:
            assert want == naive_greedy(model, prompt, n, ADJUST)
            assert want != generate_one(base, prompt, GenerationConfig(max_new_tokens=n)).token_ids  # it does act
        assert (
            generate_one(
                spec, prompt, GenerationConfig(max_new_tokens=n, block_size=[2, 4, 8][trial], adjust=ADJUST)
            ).token_ids
            == want
        ), (family, trial)
        # a drafter that proposes the adjusted reference: long accepted runs, rows deep in the block matter
        oracle = NoisyOracleDrafter(want, len(prompt), 96, 8, 0.9, seed=trial, feature_layer_ids=(0,))
        got = generate_one(
            BatchDecoder(TorchTargetEngine(model, (0,)), oracle),
            prompt,
            GenerationConfig(max_new_tokens=n, block_size=8, adjust=ADJUST),
        )
        assert got.token_ids == want, (family, trial)
        assert max(got.stats.acceptance_lengths) > 3


V = 6


@pytest.fixture(scope="module")
def sharp_pair():
    """As in test_spec: a small vocabulary and sharpened logits, so rejections and residuals happen often."""
    model = make_tiny_target(vocab_size=V, layers=4, hidden=32, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    drafter = make_tiny_drafter(model.config, layers=1, block_size=4, seed=4, mask_token_id=V - 1)
    return model, drafter


SMALL = LogitsAdjustment.of(
    frequency_penalty=1.5, presence_penalty=1.0, logit_bias={1: 2.0, 4: -1.0}, min_tokens=2, min_tokens_suppress=(0,)
)


def exact_joint_adjusted(model, prompt, params: SamplingParams, n: int, adj: LogitsAdjustment) -> dict:
    probs = {(): 1.0}
    for _ in range(n):
        seqs = list(probs)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(s) for s in seqs])).logits[:, -1]
        rows = torch.stack([naive_adjust(logits[i], list(s), adj) for i, s in enumerate(seqs)])
        p = probabilities(rows, params)
        probs = {s + (t,): probs[s] * float(p[i, t]) for i, s in enumerate(seqs) for t in range(V) if p[i, t] > 0}
    return probs


@pytest.mark.slow
def test_sampling_with_adjustment_is_the_adjusted_target(sharp_pair):
    """Rejection sampling (the default rule; exact-match reads the same adjusted rows)."""
    model, drafter = sharp_pair
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    spec = BatchDecoder(target, TorchDrafterEngine.for_target(drafter, target))
    prompt = [1, 2, 3]
    expected = exact_joint_adjusted(model, prompt, SamplingParams(temperature=1.0), 3, SMALL)
    plain = exact_joint_adjusted(model, prompt, SamplingParams(temperature=1.0), 3, LogitsAdjustment())
    assert max(abs(expected.get(k, 0) - plain.get(k, 0)) for k in {*expected, *plain}) > 0.05  # it matters
    counts, accepted = {}, 0
    for seed in range(N_SAMPLES):
        r = generate_one(
            spec,
            prompt,
            GenerationConfig(max_new_tokens=3, sampling=SamplingParams(1.0, seed=seed), block_size=4, adjust=SMALL),
        )
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
        accepted += r.stats.accepted_draft_tokens
    assert accepted > N_SAMPLES * 0.1, "drafts must be accepted often enough to test acceptance"
    p = chi_square_pvalue(counts, expected, N_SAMPLES)
    assert p > 1e-3, f"speculative samples deviate from the adjusted target distribution (p={p:.2e})"
    assert chi_square_pvalue(counts, plain, N_SAMPLES) < 1e-6  # and the test can tell the difference
