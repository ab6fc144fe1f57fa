"""Per-round host traffic of the batched decoding loop: token ids, never the target's full-vocabulary logits.

On a GPU, the target's logits [block, vocab] stay on its device through the request's adjustments, argmax /
sampling and the acceptance test; what crosses to the host is token ids (and scalars: the accepted count).
There is no GPU here, so the logits are marked instead: a FAKE device tensor (a torch.Tensor subclass that
records every conversion to host memory: .cpu(), .tolist(), .item(), .numpy(), int/float/bool/index, and any
.to(device)) is what the target hands out, and every tensor computed from it stays marked. The test counts the
elements that left "the device" per round."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_drafter, make_tiny_target

from dflash_trt.decoding import BatchDecoder, GenerationConfig, SamplingParams
from dflash_trt.decoding.processors import LogitsAdjustment
from dflash_trt.runtime.base import TargetOutput
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine

V = 96
TO_HOST = {
    torch.Tensor.cpu,
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.numpy,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.__bool__,
}


class DeviceTensor(torch.Tensor):
    """FAKE device memory: counts the elements of every transfer to the host (class-level log)."""

    log: list[tuple[str, int]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in TO_HOST or (func is torch.Tensor.to and _moves_device(args[1:], kwargs)):
            cls.log.append((getattr(func, "__name__", str(func)), int(args[0].numel())))
        return super().__torch_function__(func, types, args, kwargs)


def _moves_device(args, kwargs) -> bool:
    values = list(args) + list(kwargs.values())
    return any(isinstance(v, (str, torch.device)) for v in values)


class OnDevice:
    """The batched target with its logits in FAKE device memory (features untouched: they feed the drafter)."""

    def __init__(self, engine):
        self.engine = engine
        self.vocab_size, self.max_context = engine.vocab_size, engine.max_context
        self.feature_layer_ids, self.name = engine.feature_layer_ids, engine.name

    def new_session(self):
        return _Session(self.engine.new_session())


class _Session:
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, rows, tokens, **kw):
        outs = self.inner.forward(rows, tokens, **kw)
        return [TargetOutput(o.logits.as_subclass(DeviceTensor), o.features) for o in outs]


@pytest.fixture(scope="module")
def engines():
    model = make_tiny_target(None, vocab_size=V, layers=4)
    drafter = make_tiny_drafter(model.config, None, layers=1, block_size=8)
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    return OnDevice(target), TorchDrafterEngine.for_target(drafter, target), target


@pytest.mark.parametrize(
    "config",
    [
        GenerationConfig(max_new_tokens=24),  # greedy
        GenerationConfig(max_new_tokens=24, sampling=SamplingParams(temperature=1.0, seed=3)),  # rejection
        GenerationConfig(
            max_new_tokens=24, sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=4), acceptance="exact-match"
        ),
        GenerationConfig(
            max_new_tokens=24,
            adjust=LogitsAdjustment.of(
                frequency_penalty=0.5, logit_bias={3: 2.0}, min_tokens=4, min_tokens_suppress=[0]
            ),
        ),
    ],
    ids=["greedy", "rejection", "exact-match", "adjusted"],
)
def test_only_token_ids_leave_the_device(engines, config):
    on_device, drafter, plain = engines
    DeviceTensor.log = []
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13]]
    dec = BatchDecoder(on_device, drafter)
    got = dec.generate(prompts, config)
    moved = [n for _, n in DeviceTensor.log]
    assert moved, "the marked logits were never read (the test would prove nothing)"
    # per transfer: a scalar or a handful of token ids, never a row of the vocabulary
    assert max(moved) <= 8, DeviceTensor.log[:10]
    assert not [name for name, _ in DeviceTensor.log if name in ("cpu", "numpy", "to")], DeviceTensor.log[:10]
    # per round at most the block's ids (greedy acceptance reads the target's k + 1 argmax ids in one transfer)
    rounds = sum(r.stats.rounds for r in got)
    assert sum(moved) <= 8 * rounds + 16 * len(prompts), (sum(moved), rounds)
    # and the outputs are what the same loop gives on plain tensors
    again = BatchDecoder(plain, drafter).generate(prompts, config)
    assert [r.token_ids for r in got] == [r.token_ids for r in again]


def test_the_recorder_sees_a_full_vocabulary_copy():
    """Negative control: what the loop did before (`out.logits.cpu()`) is recorded as V elements per row."""
    DeviceTensor.log = []
    torch.zeros(3, V).as_subclass(DeviceTensor).cpu()
    assert DeviceTensor.log == [("cpu", 3 * V)]
