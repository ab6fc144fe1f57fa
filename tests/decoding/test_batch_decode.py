"""The batched step is lossless: every row's greedy output equals the target alone (rows of different
lengths and block sizes in one step, rows joining and leaving), seeded sampled rows return the same
tokens alone or in a batch, and the sampling distribution stays exact (chi-square as in test_spec)."""

import pytest
import torch
from clocks import StoppedClock
from helpers import NoisyOracleDrafter, generate_one, sequence_engines
from test_spec import SETTINGS, V, chi_square_pvalue, exact_joint
from tiny_models import make_tiny_drafter, make_tiny_target

from dflash_trt.decoding import AdaptiveBlocks, BatchDecoder, FixedBlocks, GenerationConfig, SamplingParams
from dflash_trt.decoding import acceptance as acceptance_module
from dflash_trt.decoding.cost import CostModel, EngineCost
from dflash_trt.runtime.rows import PerRowDrafter
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine


def torch_engines(model, drafter):
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    return target, TorchDrafterEngine.for_target(drafter, target)


def reference(model, prompt, n):
    return generate_one(BatchDecoder(TorchTargetEngine(model)), prompt, GenerationConfig(max_new_tokens=n)).token_ids


def random_prompts(rng, count, vocab=95):
    return [
        torch.randint(0, vocab, (int(torch.randint(1, 40, (1,), generator=rng)),), generator=rng).tolist()
        for _ in range(count)
    ]


def test_greedy_rows_equal_target_alone_mixed_blocks(tiny_pair):
    family, _, _, model, drafter = tiny_pair
    target, drafter_engine = torch_engines(model, drafter)
    rng = torch.Generator().manual_seed(1)
    prompts = random_prompts(rng, 6)
    lengths = [int(torch.randint(1, 40, (1,), generator=rng)) for _ in prompts]
    blocks = [None, 1, 2, 3, 5, 8]  # None: the drafter's trained size
    dec = BatchDecoder(target, drafter_engine)
    got = dec.generate(prompts, [GenerationConfig(max_new_tokens=n, block_size=b) for n, b in zip(lengths, blocks)])
    for i, (p, n, r) in enumerate(zip(prompts, lengths, got)):
        assert r.token_ids == reference(model, p, n), (family, i, blocks[i])
        assert r.finish_reason == "length" and len(r.token_ids) == n
    assert got[1].stats.drafted_tokens == 0  # block_size 1: target alone
    assert not dec.active and dec.target_session.slots.live.count(True) == 0  # every row released


class OracleBatch:
    """Test double (not a hardware fake): one NoisyOracleDrafter per row, in the order rows are added,
    behind the row protocol (rows.PerRowDrafter), so rounds accept anywhere from 0 to B-1 drafts."""

    def __init__(self, oracles):
        self.oracles = list(oracles)
        self.block_size, self.feature_layer_ids, self.name = 16, (0,), "oracle-batch"
        self.max_context, self.dtype = None, "float32"

    def new_session(self):
        oracles = iter(self.oracles)
        return PerRowDrafter(lambda: next(oracles).sequence())


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_with_long_acceptances_and_rows_joining_and_leaving(tiny_pair, adaptive):
    family, _, _, model, _ = tiny_pair
    rng = torch.Generator().manual_seed(2)
    prompts = random_prompts(rng, 6)
    n = 40
    refs = [reference(model, p, n) for p in prompts]
    p_correct = [1.0, 0.9, 0.5, 0.0, 0.9, 0.7]
    oracles = [
        NoisyOracleDrafter(r, len(p), 96, 16, pc, seed=i, feature_layer_ids=(0,))
        for i, (r, p, pc) in enumerate(zip(refs, prompts, p_correct))
    ]
    target = TorchTargetEngine(model, (0,))
    cost = CostModel(EngineCost(1e-3, 1e-4, 2e-5), EngineCost(5e-4, 1e-4, 1e-5)) if adaptive else None
    # no time passes (`StoppedClock`): the policy chooses by the cost model as given, no timing corrects it
    policy = AdaptiveBlocks(cost) if adaptive else FixedBlocks()
    dec = BatchDecoder(target, OracleBatch(oracles), policy=policy, clock=StoppedClock())
    rows = [
        dec.add(prompts[0], GenerationConfig(max_new_tokens=n)),
        dec.add(prompts[1], GenerationConfig(max_new_tokens=n, block_size=4)),
    ]
    dec.step()
    dec.step()
    rows.append(dec.add(prompts[2], GenerationConfig(max_new_tokens=n)))  # joins mid-run
    dec.step()
    rows += [dec.add(p, GenerationConfig(max_new_tokens=n)) for p in prompts[3:]]
    cancelled = rows[3]
    seen_blocks = set()
    while dec.active:
        seen_blocks |= set(dec.step().profile.blocks)
        if cancelled in dec.running and len(cancelled.generated) >= 5:
            dec.cancel(cancelled)
    for i, row in enumerate(rows):
        r = row.result()
        if row is cancelled:
            assert r.finish_reason == "cancelled" and r.token_ids == refs[i][: len(r.token_ids)]
            continue
        assert r.token_ids == refs[i], (family, adaptive, i)
        assert sum(r.stats.acceptance_lengths) == n - 1
    assert max(len(a) for a in [rows[0].stats.acceptance_lengths]) > 0
    assert max(rows[0].stats.acceptance_lengths) >= 8  # long accepted runs happened (p_correct 1.0)
    if adaptive:
        assert len(seen_blocks) > 2  # the policy chose different sizes
        assert rows[3].stats.drafted_tokens < rows[0].stats.drafted_tokens  # a failing row drafts less


def test_seeded_sampled_row_is_the_same_alone_or_in_a_batch(tiny_pair):
    family, _, _, model, drafter = tiny_pair
    target, drafter_engine = torch_engines(model, drafter)
    prompt = [4, 5, 6, 7]
    cfg = GenerationConfig(
        max_new_tokens=30, block_size=4, sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    )
    alone = BatchDecoder(target, drafter_engine).generate([prompt], cfg)[0].token_ids
    rng = torch.Generator().manual_seed(3)
    others = random_prompts(rng, 5)
    mixed = [
        GenerationConfig(
            max_new_tokens=20 + 3 * i,
            block_size=[2, 8, None, 5, 1][i],
            sampling=SamplingParams(temperature=[0, 1.0, 0.5, 0, 1.2][i], seed=i),
        )
        for i in range(5)
    ]
    got = BatchDecoder(target, drafter_engine).generate(
        others[:2] + [prompt] + others[2:], mixed[:2] + [cfg] + mixed[2:]
    )
    assert got[2].token_ids == alone, family
    # the old single-sequence sessions (Hugging Face forward, the drafter's own), one per row behind the
    # per-row adapters, with the same seed and block size, the request streamed: the same tokens too
    single = BatchDecoder(*sequence_engines(model, drafter))
    assert [t for r in single.stream(prompt, cfg) for t in r.token_ids] == alone


N_SAMPLES = 2000


@pytest.fixture(scope="module")
def sharp_batch_pair():
    model = make_tiny_target(vocab_size=V, layers=4, hidden=32, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    drafter = make_tiny_drafter(model.config, layers=1, block_size=4, seed=4, mask_token_id=V - 1)
    return model, drafter


@pytest.mark.parametrize("probe_every", [0, 8])
def test_probes_keep_a_pessimistic_estimate_from_freezing(tiny_pair, probe_every):
    """Rows the policy believes hopeless never draft, so without probes neither they nor the prior that the
    next requests start from ever learn otherwise; with probes the rows measure a perfect drafter, the
    prior learns it, and later requests draft long blocks from their first steps."""
    from dflash_trt.decoding.estimates import AcceptancePrior

    _, _, _, model, _ = tiny_pair
    prompt, n = [3, 1, 4, 1, 5], 40
    ref = reference(model, prompt, n)
    target = TorchTargetEngine(model, (0,))
    cost = CostModel(EngineCost(1e-3, 1e-4, 2e-4), EngineCost(2e-3, 1e-4, 1e-5))
    oracles = [NoisyOracleDrafter(ref, len(prompt), 96, 16, 1.0, seed=i, feature_layer_ids=(0,)) for i in range(4)]
    dec = BatchDecoder(
        target, OracleBatch(oracles), policy=AdaptiveBlocks(cost, probe_every=probe_every), clock=StoppedClock()
    )
    dec.policy.prior = AcceptancePrior(start=0.02)  # as if earlier requests had measured a useless drafter
    results = [dec.generate([prompt], GenerationConfig(max_new_tokens=n))[0] for _ in oracles]  # one after another
    assert all(r.token_ids == ref for r in results)
    if probe_every == 0:
        assert all(r.stats.drafted_tokens == 0 for r in results)  # frozen at block 1, request after request
    else:
        last = results[-1].stats
        assert max(last.acceptance_lengths) >= 8 and len(last.acceptance_lengths) < n // 2
        assert dec.policy.prior.alpha[False] > 0.3  # the prior learned from the probes


def test_probes_back_off_while_they_miss(tiny_pair):
    """A drafter that never hits, at a load where drafting does not pay: the row is probed 4 steps after it
    joined, then 8, 16, 32 steps after each probe (each one a backlog the drafter must take in), not every
    4 steps; its tokens are still the target's own."""
    from dflash_trt.decoding.estimates import AcceptancePrior

    _, _, _, model, _ = tiny_pair
    prompt, n = [3, 1, 4, 1, 5], 100
    ref = reference(model, prompt, n)
    target = TorchTargetEngine(model, (0,))
    cost = CostModel(EngineCost(1e-3, 1e-4, 2e-4), EngineCost(2e-3, 1e-4, 1e-5))
    dec = BatchDecoder(
        target,
        OracleBatch([NoisyOracleDrafter(ref, len(prompt), 96, 16, 0.0, seed=0, feature_layer_ids=(0,))]),
        policy=AdaptiveBlocks(cost, probe_every=4),
        clock=StoppedClock(),  # the cost model as given: drafting never pays
    )
    dec.policy.prior = AcceptancePrior(start=0.02)
    row = dec.add(prompt, GenerationConfig(max_new_tokens=n))
    drafted_at = []
    while dec.active:
        for _, rnd in dec.step():
            if rnd.drafted:
                drafted_at.append(dec.policy.steps - 1)  # the verify step that ran it
    assert row.result().token_ids == ref
    assert drafted_at == [4, 12, 28, 60] and dec.policy.probes.misses[False] == 4


def test_a_regime_whose_probes_miss_is_probed_less_across_requests_but_never_stops(tiny_pair):
    """Short requests one after another, a drafter that never hits, a load where drafting does not pay: the
    backoff belongs to the sampling regime, not to a request that ends before its own wait grows, so most
    requests are never probed (each probe is a drafter pass over the row's backlog), and the waits double up
    to 2^max_probe_backoff x probe_every steps and stay there, so the regime is still tried now and then."""
    from dflash_trt.decoding.estimates import AcceptancePrior

    _, _, _, model, _ = tiny_pair
    prompt, n, requests = [3, 1, 4, 1, 5], 12, 24
    ref = reference(model, prompt, n)
    target = TorchTargetEngine(model, (0,))
    cost = CostModel(EngineCost(1e-3, 1e-4, 2e-4), EngineCost(2e-3, 1e-4, 1e-5))
    oracles = [
        NoisyOracleDrafter(ref, len(prompt), 96, 16, 0.0, seed=i, feature_layer_ids=(0,)) for i in range(requests)
    ]
    policy = AdaptiveBlocks(cost, probe_every=4, max_probe_backoff=3)
    dec = BatchDecoder(target, OracleBatch(oracles), policy=policy, clock=StoppedClock())  # the cost as given
    dec.policy.prior = AcceptancePrior(start=0.02)
    drafted_at, probed_requests = [], 0
    for _ in range(requests):
        row = dec.add(prompt, GenerationConfig(max_new_tokens=n))
        while dec.active:
            for _, rnd in dec.step():
                if rnd.drafted:
                    drafted_at.append(dec.policy.steps - 1)
        assert row.result().token_ids == ref
        probed_requests += row.result().stats.drafted_tokens > 0
    gaps = [b - a for a, b in zip(drafted_at, drafted_at[1:])]
    # the k-th wait is 4 x 2^k steps, capped at 2^3 x 4 (plus the steps until some row has gone 4 without drafting)
    for k, gap in enumerate(gaps):
        wait = 4 * 2 ** min(k + 1, 3)
        assert wait <= gap < wait + n, (k, gaps)
    assert len(gaps) >= 5 and dec.policy.probes.misses[False] == 3  # capped, and probing never stops
    assert probed_requests <= requests // 2  # the per-request backoff probed every one of them


def batched_counts(model, drafter, prompt, setting, acceptance, adaptive=False):
    """N_SAMPLES seeded rows, 400 per batch, next to rows of other lengths and settings."""
    target, drafter_engine = torch_engines(model, drafter)
    # a memory-bound target (tokens nearly free) so the policy drafts; sizes then follow each row's history (no time
    # passes, `StoppedClock`: no timing of this machine corrects the cost model)
    cost = CostModel(EngineCost(1e-2, 0.0, 1e-6), EngineCost(1e-3, 0.0, 1e-7)) if adaptive else None
    counts, accepted = {}, 0
    for start in range(0, N_SAMPLES, 400):
        policy = AdaptiveBlocks(cost) if adaptive else FixedBlocks()
        dec = BatchDecoder(target, drafter_engine, policy=policy, clock=StoppedClock())
        rows = []
        for seed in range(start, start + 400):
            rows.append(
                dec.add(
                    prompt,
                    GenerationConfig(
                        max_new_tokens=3,
                        sampling=SETTINGS[setting](seed),
                        block_size=None if adaptive else 4,
                        acceptance=acceptance,
                    ),
                )
            )
            if seed % 50 == 0:  # a distractor row: a longer prompt, greedy, another block size
                dec.add(prompt * 3, GenerationConfig(max_new_tokens=5, block_size=2))
        dec.run()
        for r in rows:
            key = tuple(r.result().token_ids)
            counts[key] = counts.get(key, 0) + 1
            accepted += r.stats.accepted_draft_tokens
    return counts, accepted


@pytest.mark.slow
@pytest.mark.parametrize(
    "setting, acceptance, adaptive",
    [
        ("T1", "rejection", False),
        ("T0.7-topk4-topp0.9", "exact-match", False),
        ("T1", "rejection", True),
    ],
)
def test_batched_sampling_is_lossless(sharp_batch_pair, setting, acceptance, adaptive):
    model, drafter = sharp_batch_pair
    prompt = [1, 2, 3]
    expected = exact_joint(model, prompt, SETTINGS[setting](0), 3)
    counts, accepted = batched_counts(model, drafter, prompt, setting, acceptance, adaptive)
    assert accepted > N_SAMPLES * 0.1, "drafts must be accepted often enough to test acceptance"
    p = chi_square_pvalue(counts, expected, N_SAMPLES)
    assert p > 1e-3, f"batched samples deviate from the target distribution (p={p:.2e})"


@pytest.mark.slow
def test_batched_statistical_test_catches_a_broken_sampler(sharp_batch_pair, monkeypatch):
    """Negative control: accept every draft, then sample the bonus from the target."""
    from dflash_trt.decoding.sampling import sample

    def accept_all(draft, draft_probs, target_probs, generator):
        return draft.shape[0], int(sample(target_probs[draft.shape[0]], generator))

    model, drafter = sharp_batch_pair
    monkeypatch.setattr(acceptance_module, "accept_rejection", accept_all)  # what RejectionRule calls
    expected = exact_joint(model, [1, 2, 3], SETTINGS["T1"](0), 3)
    counts, _ = batched_counts(model, drafter, [1, 2, 3], "T1", "rejection")
    assert chi_square_pvalue(counts, expected, N_SAMPLES) < 1e-6


class FailingBatchDrafter:
    """Test double: a batched drafter whose calls raise (a broken engine)."""

    def __init__(self, inner):
        self.inner, self.name, self.dtype = inner, "failing", inner.dtype
        self.block_size, self.feature_layer_ids = inner.block_size, inner.feature_layer_ids

    def new_session(self):
        sess = self.inner.new_session()

        def draft(requests):
            raise RuntimeError("drafter engine failed")

        sess.draft = draft
        return sess


def test_drafter_failure_falls_back_per_row(tiny_pair):
    family, _, _, model, drafter = tiny_pair
    target, drafter_engine = torch_engines(model, drafter)
    dec = BatchDecoder(target, FailingBatchDrafter(drafter_engine))
    ok = dec.add([1, 2, 3], GenerationConfig(max_new_tokens=12, drafter_fallback=True))
    failed = dec.add([4, 5], GenerationConfig(max_new_tokens=12))
    dec.run()
    assert ok.result().token_ids == reference(model, [1, 2, 3], 12)
    assert isinstance(ok.drafter_error, RuntimeError)
    assert failed.result().finish_reason == "error" and isinstance(failed.error, RuntimeError)
    assert not dec.active


def test_stop_tokens_and_validation(tiny_pair):
    from dflash_trt.decoding import ContextLengthError, InputError

    family, _, _, model, drafter = tiny_pair
    target, drafter_engine = torch_engines(model, drafter)
    full = reference(model, [7, 8, 9], 40)
    stop = full[12]
    dec = BatchDecoder(target, drafter_engine)
    r = dec.generate(
        [[7, 8, 9], [1, 2]],
        [GenerationConfig(max_new_tokens=40, stop_token_ids=(stop,)), GenerationConfig(max_new_tokens=40)],
    )
    assert r[0].token_ids == full[: full.index(stop) + 1] and r[0].finish_reason == "stop"
    assert r[1].token_ids == reference(model, [1, 2], 40)
    with pytest.raises(ContextLengthError):
        dec.add([1] * 2000, GenerationConfig(max_new_tokens=100))
    with pytest.raises(InputError, match="block_size"):
        dec.add([1], GenerationConfig(block_size=9))
    with pytest.raises(InputError, match="out of vocabulary"):
        dec.add([1, 96], GenerationConfig())
    with pytest.raises(ValueError, match="cost model"):
        BatchDecoder(target, drafter_engine, policy=AdaptiveBlocks(None))


def test_stop_strings_per_row_with_tokenizer(tmp_path):
    """Text stops: each row's own stop string, the text cut as for the request alone."""
    from helpers import make_tokenizer

    tok = make_tokenizer(tmp_path)
    model = make_tiny_target(vocab_size=len(tok), layers=4, seed=5)
    drafter = make_tiny_drafter(model.config, layers=1, block_size=4, mask_token_id=tok.mask_token_id)
    target, drafter_engine = torch_engines(model, drafter)
    base = BatchDecoder(TorchTargetEngine(model), None, tok)
    prompts = [tok.encode("def fibonacci(n):"), tok.encode("for i in range(10):")]
    fulls = [generate_one(base, p, GenerationConfig(max_new_tokens=30)) for p in prompts]
    stop = fulls[0].text[8:11]
    assert stop
    got = BatchDecoder(target, drafter_engine, tok).generate(
        prompts, [GenerationConfig(max_new_tokens=30, stop_strings=(stop,)), GenerationConfig(max_new_tokens=30)]
    )
    assert got[0].finish_reason == "stop" and got[0].text == fulls[0].text[: fulls[0].text.index(stop)]
    alone = generate_one(base, prompts[0], GenerationConfig(max_new_tokens=30, stop_strings=(stop,)))
    assert got[0].token_ids == alone.token_ids  # cut after the same token as the request alone
    assert got[1].token_ids == fulls[1].token_ids and got[1].text == fulls[1].text


def single_decoder(model, drafter):
    """A decoder of its own over the reference single-sequence engines (helpers.sequence_engines): a request
    run on it alone is a batch of one through the per-row adapters."""
    return BatchDecoder(*sequence_engines(model, drafter))


def test_logits_adjustments_match_the_request_alone(tiny_pair):
    """Penalties, logit_bias and min_tokens act on the prefill's and every verify row's logits exactly as for
    the request alone: each row's tokens in a batch equal those of the request alone on the single-sequence
    sessions (greedy and seeded sampling)."""
    from dflash_trt.decoding.processors import LogitsAdjustment

    family, _, _, model, drafter = tiny_pair
    target, drafter_engine = torch_engines(model, drafter)
    prompt = [3, 1, 4, 1, 5]
    plain = reference(model, prompt, 24)
    adjusts = [
        LogitsAdjustment.of(frequency_penalty=1.5),
        LogitsAdjustment.of(presence_penalty=2.0, logit_bias={plain[0]: -100.0}),  # the first token changes
        LogitsAdjustment.of(logit_bias={plain[3]: 5.0}),
        LogitsAdjustment.of(min_tokens=20, min_tokens_suppress=(plain[0], plain[1])),  # stop ids held back
    ]
    configs = [GenerationConfig(max_new_tokens=24, adjust=a, block_size=b) for a, b in zip(adjusts, (None, 4, 8, 3))]
    configs += [
        GenerationConfig(
            max_new_tokens=24, adjust=adjusts[0], block_size=4, sampling=SamplingParams(temperature=0.9, seed=11)
        )
    ]
    got = BatchDecoder(target, drafter_engine).generate([prompt] * len(configs), configs)
    single = single_decoder(model, drafter)
    for i, (cfg, r) in enumerate(zip(configs, got)):
        assert r.token_ids == generate_one(single, prompt, cfg).token_ids, (family, i)
    assert got[1].token_ids[0] != plain[0] and got[0].token_ids != plain  # the adjustments did act
    assert not set(got[3].token_ids[:20]) & {plain[0], plain[1]}


def test_validation_of_the_drafter_limit_and_of_no_drafter(tiny_pair):
    """The drafter's context limit, and no drafter means block_size 1 only: the errors the single-sequence
    loop raised (the same message, the same prompt_alone), for a batched drafter and a per-row one."""
    from dflash_trt.decoding import ContextLengthError, InputError

    family, _, _, model, drafter = tiny_pair
    target, _ = torch_engines(model, drafter)
    limited = TorchDrafterEngine.for_target(drafter, target)
    limited.max_context = 40  # as a TensorRT plan's profile would cap it
    per_row = NoisyOracleDrafter([], 0, 96, 8, 0.0, seed=0, feature_layer_ids=drafter.spec.target_layer_ids)
    per_row.max_context = 40
    for dec in (BatchDecoder(target, limited), BatchDecoder(target, per_row)):
        for prompt, n in (([1] * 30, 20), ([1] * 40, 5)):
            with pytest.raises(ContextLengthError) as got:
                dec.add(prompt, GenerationConfig(max_new_tokens=n))
            want = (
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({n}) = {len(prompt) + n} "
                "exceeds the drafter's context length 40"
            )
            assert str(got.value) == want
            assert got.value.prompt_alone == (len(prompt) >= 40)
    batched = BatchDecoder(target, limited)
    batched.new_row([1] * 30, GenerationConfig(max_new_tokens=20, block_size=1))  # no drafting: the target's limit
    alone = BatchDecoder(target)
    with pytest.raises(InputError, match="no drafter is loaded, so block_size must be 1, got 2"):
        alone.add([1], GenerationConfig(block_size=2))
    assert alone.generate([[1, 2]], GenerationConfig(max_new_tokens=5, block_size=1))[0].token_ids == reference(
        model, [1, 2], 5
    )


def test_server_block_size_is_the_default_and_the_cap(tiny_pair):
    family, _, _, model, drafter = tiny_pair
    target, drafter_engine = torch_engines(model, drafter)
    dec = BatchDecoder(target, drafter_engine, block_size=1)
    rows = [
        dec.add([5, 6, 7], GenerationConfig(max_new_tokens=10)),
        dec.add([5, 6, 7], GenerationConfig(max_new_tokens=10, block_size=4)),
    ]  # the request's own size wins
    dec.run()
    assert rows[0].stats.drafted_tokens == 0 and rows[0].stats.block_size == 1
    assert rows[1].stats.drafted_tokens > 0 and rows[1].stats.block_size == 4
    assert rows[0].result().token_ids == rows[1].result().token_ids == reference(model, [5, 6, 7], 10)
    with pytest.raises(ValueError, match="block_size must be in 1..8"):
        BatchDecoder(target, drafter_engine, block_size=9)
