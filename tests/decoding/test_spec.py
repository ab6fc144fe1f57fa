"""The draft-and-verify loop is lossless: greedy equality and sampling distribution, plus bookkeeping."""

import pytest
import torch
from helpers import CountingDrafter, NoisyOracleDrafter, generate_one, hf_greedy, make_tokenizer
from tiny_models import make_tiny_drafter, make_tiny_target

from dflash_trt.decoding import BatchDecoder, ContextLengthError, GenerationConfig, InputError, SamplingParams
from dflash_trt.decoding import acceptance as acceptance_module
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine


def decoders(model, drafter):
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    spec = BatchDecoder(target, TorchDrafterEngine.for_target(drafter, target))
    base = BatchDecoder(TorchTargetEngine(model))
    return spec, base


def test_greedy_equals_target_alone_with_real_drafter(tiny_pair):
    family, _, _, model, drafter = tiny_pair
    spec, base = decoders(model, drafter)
    rng = torch.Generator().manual_seed(1)
    for trial in range(12):
        prompt = torch.randint(0, 95, (int(torch.randint(1, 40, (1,), generator=rng)),), generator=rng).tolist()
        n = int(torch.randint(1, 60, (1,), generator=rng))
        block = [2, 3, 5, 8][trial % 4]
        expected = generate_one(base, prompt, GenerationConfig(max_new_tokens=n)).token_ids
        got = generate_one(spec, prompt, GenerationConfig(max_new_tokens=n, block_size=block))
        assert got.token_ids == expected, (family, trial, block)
        assert len(got.token_ids) == n
        if trial < 3:  # the baseline itself equals Hugging Face generate()
            assert expected == hf_greedy(model, prompt, n)


@pytest.mark.parametrize("p_correct", [0.5, 0.9, 1.0])
def test_greedy_equals_target_alone_across_acceptance_lengths(tiny_pair, p_correct):
    family, _, _, model, drafter = tiny_pair
    base = BatchDecoder(TorchTargetEngine(model))
    rng = torch.Generator().manual_seed(2)
    lengths = set()
    for trial in range(6):
        prompt = torch.randint(0, 95, (int(torch.randint(2, 30, (1,), generator=rng)),), generator=rng).tolist()
        n = 50
        reference = generate_one(base, prompt, GenerationConfig(max_new_tokens=n)).token_ids
        block = [4, 8, 16][trial % 3]
        # the oracle counts context rows to know its position, so the target hands it (layer-0) features
        oracle = NoisyOracleDrafter(reference, len(prompt), 96, 16, p_correct, seed=trial, feature_layer_ids=(0,))
        spec = BatchDecoder(TorchTargetEngine(model, (0,)), oracle)
        got = generate_one(spec, prompt, GenerationConfig(max_new_tokens=n, block_size=block))
        assert got.token_ids == reference, (family, trial)
        lengths |= set(got.stats.acceptance_lengths)
        s = got.stats
        assert sum(s.acceptance_lengths) == n - 1  # every token but the prefill's came from a round
        assert s.accepted_draft_tokens == sum(s.acceptance_lengths) - s.rounds
    if p_correct == 1.0:
        assert max(lengths) == 16  # whole blocks accepted: bonus token included in tau
    assert len(lengths) > 1


def test_block_size_one_is_target_alone(tiny_pair):
    _, _, _, model, drafter = tiny_pair
    spec, base = decoders(model, drafter)
    r = generate_one(spec, [1, 2, 3], GenerationConfig(max_new_tokens=10, block_size=1))
    assert r.token_ids == generate_one(base, [1, 2, 3], GenerationConfig(max_new_tokens=10)).token_ids
    assert r.stats.drafted_tokens == 0 and r.stats.mean_acceptance_length == 1.0 and r.stats.rounds == 9


# ---------------------------------------------------------------------------------------
# Sampling: the distribution of the first tokens equals the target's own, exactly computed.
# ---------------------------------------------------------------------------------------
V = 6
N_SAMPLES = 2000


@pytest.fixture(scope="module")
def sharp_pair():
    """Small vocabulary, sharpened logits: target and drafter distributions differ a lot,
    so acceptance, rejection and residual resampling all happen often."""
    model = make_tiny_target(vocab_size=V, layers=4, hidden=32, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    drafter = make_tiny_drafter(model.config, layers=1, block_size=4, seed=4, mask_token_id=V - 1)
    return model, drafter


def exact_joint(model, prompt, params: SamplingParams, n: int, adjust=None) -> dict[tuple, float]:
    """P(t1..tn) under the target alone with the same temperature / top-p / top-k warping, and the request's
    penalties / logit_bias (`LogitsAdjustment`, after the tokens generated so far) when given."""
    from dflash_trt.decoding.sampling import probabilities

    probs = {(): 1.0}
    for _ in range(n):
        seqs = list(probs)
        batch = torch.tensor([prompt + list(s) for s in seqs])
        with torch.no_grad():
            logits = model(batch).logits[:, -1]
        if adjust is not None:
            logits = torch.cat([adjust.apply(logits[i : i + 1], s) for i, s in enumerate(seqs)])
        p = probabilities(logits, params)
        probs = {s + (t,): probs[s] * float(p[i, t]) for i, s in enumerate(seqs) for t in range(V) if p[i, t] > 0}
    return probs


def chi_square_pvalue(counts: dict, expected_probs: dict, n: int) -> float:
    from scipy.stats import chi2

    # merge rare cells so every expected count is >= 5
    cells = sorted(expected_probs, key=expected_probs.get, reverse=True)
    stat, df, rest_p, rest_c = 0.0, 0, 0.0, 0
    for c in cells:
        e = expected_probs[c] * n
        if e >= 5:
            stat += (counts.get(c, 0) - e) ** 2 / e
            df += 1
        else:
            rest_p += expected_probs[c]
            rest_c += counts.get(c, 0)
    unexpected = sum(v for k, v in counts.items() if k not in expected_probs)
    if unexpected:
        return 0.0  # a sequence the target can never produce
    if rest_p * n >= 1:
        stat += (rest_c - rest_p * n) ** 2 / (rest_p * n)
        df += 1
    if df < 2:
        raise ValueError("the expected distribution is (nearly) one sequence: a chi-square test of it tests nothing")
    return float(chi2.sf(stat, df - 1))


def sample_counts(model, drafter, prompt, params_fn, acceptance, n_tokens=3):
    spec, _ = decoders(model, drafter)
    counts = {}
    accepted = 0
    for seed in range(N_SAMPLES):
        r = generate_one(
            spec,
            prompt,
            GenerationConfig(max_new_tokens=n_tokens, sampling=params_fn(seed), block_size=4, acceptance=acceptance),
        )
        key = tuple(r.token_ids)
        counts[key] = counts.get(key, 0) + 1
        accepted += r.stats.accepted_draft_tokens
    return counts, accepted


SETTINGS = {
    "T1": lambda seed: SamplingParams(temperature=1.0, seed=seed),
    "T0.7-topk4-topp0.9": lambda seed: SamplingParams(temperature=0.7, top_k=4, top_p=0.9, seed=seed),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "setting, acceptance", [("T1", "rejection"), ("T1", "exact-match"), ("T0.7-topk4-topp0.9", "rejection")]
)
def test_sampling_is_lossless(sharp_pair, setting, acceptance):
    model, drafter = sharp_pair
    prompt = [1, 2, 3]
    expected = exact_joint(model, prompt, SETTINGS[setting](0), 3)
    counts, accepted = sample_counts(model, drafter, prompt, SETTINGS[setting], acceptance)
    assert accepted > N_SAMPLES * 0.1, "drafts must be accepted often enough to test acceptance"
    p = chi_square_pvalue(counts, expected, N_SAMPLES)
    assert p > 1e-3, f"speculative samples deviate from the target distribution (p={p:.2e})"


def _accept_all(draft, draft_probs, target_probs, generator):
    from dflash_trt.decoding.sampling import sample

    return draft.shape[0], int(sample(target_probs[draft.shape[0]], generator))


def _resample_from_target(draft, draft_probs, target_probs, generator):
    """The classic bug: after a rejection, resample from p instead of norm(max(0, p - q))."""
    from dflash_trt.decoding.sampling import sample

    k = draft.shape[0]
    idx = torch.arange(k)
    ok = torch.rand(k, generator=generator) * draft_probs[idx, draft] < target_probs[idx, draft]
    a = int(ok.to(torch.int64).cumprod(0).sum())
    return a, int(sample(target_probs[a], generator))


@pytest.mark.slow
@pytest.mark.parametrize("broken", [_accept_all, _resample_from_target])
def test_statistical_test_catches_broken_samplers(sharp_pair, monkeypatch, broken):
    """Negative control: the test above must be able to fail."""
    model, drafter = sharp_pair
    prompt = [1, 2, 3]
    monkeypatch.setattr(acceptance_module, "accept_rejection", broken)  # what RejectionRule calls
    expected = exact_joint(model, prompt, SETTINGS["T1"](0), 3)
    counts, _ = sample_counts(model, drafter, prompt, SETTINGS["T1"], "rejection")
    assert chi_square_pvalue(counts, expected, N_SAMPLES) < 1e-6


def test_seed_makes_sampling_reproducible(tiny_pair):
    _, _, _, model, drafter = tiny_pair
    spec, _ = decoders(model, drafter)
    cfg = GenerationConfig(max_new_tokens=20, sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=7))
    assert generate_one(spec, [4, 5, 6], cfg).token_ids == generate_one(spec, [4, 5, 6], cfg).token_ids


# ---------------------------------------------------------------------------------------
# Bookkeeping: stops, limits, cost
# ---------------------------------------------------------------------------------------
def test_stop_token_ends_generation_and_is_kept(tiny_pair):
    _, _, _, model, drafter = tiny_pair
    spec, base = decoders(model, drafter)
    full = generate_one(base, [7, 8, 9], GenerationConfig(max_new_tokens=40)).token_ids
    stop = full[12]
    first = full.index(stop)
    for dec in (spec, base):
        r = generate_one(dec, [7, 8, 9], GenerationConfig(max_new_tokens=40, stop_token_ids=(stop,), block_size=None))
        assert r.token_ids == full[: first + 1] and r.finish_reason == "stop"


def test_length_limit_and_context_errors(tiny_pair):
    _, _, _, model, drafter = tiny_pair
    spec, _ = decoders(model, drafter)
    r = generate_one(spec, [1], GenerationConfig(max_new_tokens=5))
    assert len(r.token_ids) == 5 and r.finish_reason == "length"
    with pytest.raises(ContextLengthError, match="context length 2048"):
        spec.add([1] * 2000, GenerationConfig(max_new_tokens=100))
    with pytest.raises(InputError, match="out of vocabulary"):
        spec.add([1, 96], GenerationConfig())
    with pytest.raises(InputError, match="empty"):
        spec.add([], GenerationConfig())
    with pytest.raises(InputError, match="block_size"):
        spec.add([1], GenerationConfig(block_size=9))
    with pytest.raises(InputError, match="no drafter"):
        BatchDecoder(TorchTargetEngine(model)).add([1], GenerationConfig(block_size=4))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1, top_p=0)


def test_stop_strings_with_tokenizer(tmp_path):
    tok = make_tokenizer(tmp_path)
    model = make_tiny_target(vocab_size=len(tok), layers=4, seed=5)
    drafter = make_tiny_drafter(model.config, layers=1, block_size=4, mask_token_id=tok.mask_token_id)
    spec, base = decoders(model, drafter)
    spec.tokenizer = base.tokenizer = tok
    prompt = tok.encode("def fibonacci(n):")
    full = generate_one(base, prompt, GenerationConfig(max_new_tokens=30))
    assert full.text == tok.decode(full.token_ids, skip_special_tokens=True)
    stop = full.text[8:11]
    assert stop
    r = generate_one(spec, prompt, GenerationConfig(max_new_tokens=30, stop_strings=(stop,)))
    assert r.finish_reason == "stop"
    assert r.text == full.text[: full.text.index(stop)]
    assert stop in tok.decode(r.token_ids) and stop not in tok.decode(r.token_ids[:-1])


def test_draft_cost_per_round_does_not_grow_with_context(tiny_pair):
    """Count the rows the drafter actually processes (hook on fc for context rows)."""
    _, _, _, model, drafter = tiny_pair
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    counting = CountingDrafter(TorchDrafterEngine.for_target(drafter, target))
    spec = BatchDecoder(target, counting)
    rows = []
    hook = drafter.fc.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[1]))
    try:
        per_context = {}
        for ctx in (16, 1000):
            rows.clear()
            counting.tokens_handed.clear()
            row = spec.add(
                list(range(1, 90)) * (ctx // 89) + list(range(1, 1 + ctx % 89)),
                GenerationConfig(max_new_tokens=30, block_size=8),
            )
            spec.run()
            per_context[ctx] = list(rows)
            assert rows[0] == ctx  # the first round sees the whole prompt once
            assert all(r <= 8 for r in rows[1:])  # later rounds: only the tokens committed since
            assert rows[1:] == row.stats.acceptance_lengths[: len(rows) - 1]
            processed = counting.tokens_handed
            assert all(0 < p - r <= 8 for p, r in zip(processed, rows))  # plus the block, never more
    finally:
        hook.remove()
    assert max(per_context[1000][1:]) <= 8 and max(per_context[16][1:]) <= 8


def test_tiny_temperature_is_greedy(tiny_pair):
    """1e-308 would overflow logits / T to inf and sample NaN; such temperatures are greedy."""
    _, _, _, model, drafter = tiny_pair
    spec, base = decoders(model, drafter)
    greedy = generate_one(base, [3, 4], GenerationConfig(max_new_tokens=12)).token_ids
    tiny = generate_one(spec, [3, 4], GenerationConfig(max_new_tokens=12, sampling=SamplingParams(temperature=1e-308)))
    assert tiny.token_ids == greedy


@pytest.mark.slow
def test_sample_draws_each_row_from_its_own_distribution():
    """The inverse-CDF sampler: unnormalised rows are fine, zero-probability tokens are never drawn, and the
    draws fit the distribution (chi-square); a fixed seed repeats the draws."""
    from dflash_trt.decoding.sampling import sample

    probs = torch.tensor([[0.0, 2.0, 0.0, 5.0, 3.0, 0.0], [1.0, 1.0, 1.0, 1.0, 0.0, 4.0]])
    n = 20000
    draws = sample(probs.expand(n, -1, -1), torch.Generator().manual_seed(0))  # [n, 2]
    assert draws.shape == (n, 2)
    for row in range(2):
        p = probs[row] / probs[row].sum()
        counts = torch.bincount(draws[:, row], minlength=6)
        assert all(counts[t] == 0 for t in range(6) if p[t] == 0)
        expected = {t: float(p[t]) for t in range(6) if p[t] > 0}
        pvalue = chi_square_pvalue({t: int(c) for t, c in enumerate(counts)}, expected, n)
        assert pvalue > 1e-3, (row, counts.tolist())
    again = sample(probs.expand(n, -1, -1), torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)
    skewed = sample(probs[:1].expand(n, -1), torch.Generator().manual_seed(1))
    assert (
        chi_square_pvalue(
            {t: int(c) for t, c in enumerate(torch.bincount(skewed, minlength=6))}, {1: 0.5, 3: 0.25, 4: 0.25}, n
        )
        < 1e-6
    )  # the test can tell a wrong distribution
