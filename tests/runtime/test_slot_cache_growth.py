"""The slot cache grows without holding the old and the new cache together (runtime/rows.SlotCacheRows._reserve):
the peak while it grows is the new cache plus one old half, and its contents survive the growth."""

import weakref

import numpy as np
import pytest
import torch

from dflash_trt.runtime.rows import SlotCacheRows


class Tracked(SlotCacheRows):
    """A slot cache whose buffers are counted while alive (weak references): the peak of live bytes at each
    allocation is what the allocator would have to find."""

    def __init__(self, shape, kind):
        self.kind, self.live, self.peak = kind, {}, 0
        super().__init__(self._zeros(shape), self._zeros(shape))

    def _zeros(self, shape):
        a = torch.zeros(shape) if self.kind == "torch" else np.zeros(shape, np.float32)
        key = id(a)
        self.live[key] = a.nbytes
        weakref.finalize(a, self.live.pop, key, None)
        self.peak = max(self.peak, sum(self.live.values()))
        return a


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_growth_peak_is_the_new_cache_and_one_old_half(kind):
    cache = Tracked((2, 4, 1, 16, 8), kind)
    row = cache.add_row()
    cache.k[:, row, :, :16] = 1.5
    cache.v[:, row, :, :16] = -2.5
    old = sum(cache.live.values())
    cache.peak = 0
    cache._reserve(4, 17)  # C doubles: 16 -> 32
    new = sum(cache.live.values())
    assert new == 2 * old  # the old buffers are gone, the new ones live
    assert cache.peak <= new + old // 2  # 2.5x the old cache; old and new together would be 3x
    assert float(cache.k[:, row, :, :16].min()) == 1.5 and float(cache.v[:, row, :, :16].max()) == -2.5
    assert float(abs(cache.k[:, :, :, 16:]).max()) == 0.0


def test_failed_growth_keeps_the_cache():
    cache = Tracked((2, 4, 1, 16, 8), "torch")
    cache.k[:] = 3.0
    k_before = cache.k

    def no_memory(shape):
        raise torch.OutOfMemoryError("no room")

    cache._zeros = no_memory
    with pytest.raises(torch.OutOfMemoryError):
        cache._reserve(4, 40)
    assert cache.k is k_before and cache.k.shape == (2, 4, 1, 16, 8)
