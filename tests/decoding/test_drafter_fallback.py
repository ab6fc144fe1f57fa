"""GenerationConfig(drafter_fallback=True): a drafter that raises mid-generation leaves the output unchanged."""

import pytest
from helpers import FaultyDrafter, generate_one, make_tiny_pair

from dflash_trt.decoding import BatchDecoder, GenerationConfig, SamplingParams
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine


@pytest.fixture(scope="module")
def engines():
    model, drafter = make_tiny_pair(vocab_size=96, seed=3)
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    return model, target, TorchDrafterEngine.for_target(drafter, target)


@pytest.mark.parametrize("fail_at", [1, 3])
def test_fallback_keeps_greedy_output(engines, fail_at):
    model, target, drafter = engines
    prompt = [5, 17, 3, 40, 2]
    expected = generate_one(BatchDecoder(TorchTargetEngine(model)), prompt, GenerationConfig(max_new_tokens=20))
    dec = BatchDecoder(target, FaultyDrafter(drafter, fail_at=fail_at))
    row = dec.add(prompt, GenerationConfig(max_new_tokens=20, drafter_fallback=True))
    dec.run()
    assert row.result().token_ids == expected.token_ids
    assert isinstance(row.drafter_error, RuntimeError)
    assert row.can_draft is False and row.drafter_row is None


def test_without_fallback_the_error_propagates(engines):
    _, target, drafter = engines
    dec = BatchDecoder(target, FaultyDrafter(drafter, fail_at=1))
    with pytest.raises(RuntimeError, match="exploded"):
        generate_one(dec, [1, 2, 3], GenerationConfig(max_new_tokens=8))


def test_sampled_generation_survives_fallback(engines):
    _, target, drafter = engines
    dec = BatchDecoder(target, FaultyDrafter(drafter, fail_at=2))
    cfg = GenerationConfig(max_new_tokens=15, drafter_fallback=True, sampling=SamplingParams(1.0, seed=0))
    result = generate_one(dec, [1, 2, 3], cfg)
    assert len(result.token_ids) == 15 and all(0 <= t < 96 for t in result.token_ids)
    assert result.stats.acceptance_lengths[1:] == [1] * (result.stats.rounds - 1)  # target alone after the failure
