"""GenerationConfig(drafter_fallback=True): a drafter that raises mid-generation leaves the output unchanged."""

import pytest

from dflash_trt.models.tiny import make_tiny_drafter, make_tiny_target
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine
from dflash_trt.decoding import GenerationConfig, SamplingParams, SpeculativeDecoder


class FailingDrafter:
    """Wraps a real drafter engine; its sessions raise from the `fail_at`-th draft call on (fault injection)."""

    def __init__(self, engine, fail_at: int):
        self.engine, self.fail_at = engine, fail_at
        self.name, self.block_size, self.feature_layer_ids = "failing", engine.block_size, engine.feature_layer_ids

    def new_session(self):
        inner, calls = self.engine.new_session(), [0]
        fail_at = self.fail_at

        class Session:
            context_length = property(lambda self: inner.context_length)

            def draft(self, new_features, last_token, block_size):
                calls[0] += 1
                if calls[0] >= fail_at:
                    raise RuntimeError("drafter engine exploded")
                return inner.draft(new_features, last_token, block_size)

        return Session()


@pytest.fixture(scope="module")
def engines():
    model = make_tiny_target(vocab_size=96, layers=4, seed=3)
    drafter = make_tiny_drafter(model.config, layers=1, block_size=4)
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    return model, target, TorchDrafterEngine.for_target(drafter, target)


@pytest.mark.parametrize("fail_at", [1, 3])
def test_fallback_keeps_greedy_output(engines, fail_at):
    model, target, drafter = engines
    prompt = [5, 17, 3, 40, 2]
    expected = SpeculativeDecoder(TorchTargetEngine(model)).generate(prompt, GenerationConfig(max_new_tokens=20))
    spec = SpeculativeDecoder(target, FailingDrafter(drafter, fail_at))
    gen = spec.start(prompt, GenerationConfig(max_new_tokens=20, drafter_fallback=True))
    for _ in gen:
        pass
    assert gen.result().token_ids == expected.token_ids
    assert isinstance(gen.drafter_error, RuntimeError)
    assert gen.block_size == 1 and gen.drafter_session is None


def test_without_fallback_the_error_propagates(engines):
    _, target, drafter = engines
    spec = SpeculativeDecoder(target, FailingDrafter(drafter, 1))
    with pytest.raises(RuntimeError, match="exploded"):
        spec.generate([1, 2, 3], GenerationConfig(max_new_tokens=8))


def test_sampled_generation_survives_fallback(engines):
    _, target, drafter = engines
    spec = SpeculativeDecoder(target, FailingDrafter(drafter, 2))
    cfg = GenerationConfig(max_new_tokens=15, drafter_fallback=True, sampling=SamplingParams(1.0, seed=0))
    result = spec.generate([1, 2, 3], cfg)
    assert len(result.token_ids) == 15 and all(0 <= t < 96 for t in result.token_ids)
    assert result.stats.acceptance_lengths[1:] == [1] * (result.stats.rounds - 1)  # target alone after the failure
