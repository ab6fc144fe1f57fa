"""The serve command bounds the CPU kernel caches that grow with every tensor shape (runtime/kernel_caches.py):
bfloat16 matmuls of ragged shapes, as a serving batch runs them, hold their memory flat once the caches are
bounded, where the default capacities kept growing. Real PyTorch, in subprocesses (the caches read their capacity
once per process)."""

import json
import os
import subprocess
import sys

from dflash_trt.runtime.kernel_caches import CACHE_VARIABLES, bound_kernel_caches

RAGGED = """
import json, random, sys, torch
{setup}
torch.set_num_threads(1)
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
up, down = torch.nn.Linear(320, 960).bfloat16(), torch.nn.Linear(960, 320).bfloat16()
rng, marks = random.Random(0), []
with torch.inference_mode():
    for i in range(1200):
        x = torch.randn(rng.randint(1, 400), 320).bfloat16()  # ragged rows: prompt chunks, joining rows
        down(torch.nn.functional.silu(up(x)))
        if i in (99, 1199):
            marks.append(rss())
print(json.dumps(marks))
"""


def growth_mib(setup: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    code = RAGGED.format(setup=setup)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, check=True)
    first, last = json.loads(out.stdout)
    return last - first


def test_bounded_caches_keep_ragged_bf16_matmuls_flat():
    bounded = growth_mib("from dflash_trt.runtime.kernel_caches import bound_kernel_caches; bound_kernel_caches()")
    default = growth_mib("")
    print(f"\nRSS growth over 1100 ragged bf16 passes: default caches {default:.0f} MiB, bounded {bounded:.0f} MiB")
    assert bounded < 40 and default > 3 * bounded


def test_an_operator_setting_wins(monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "500")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert bound_kernel_caches() == {"LRU_CACHE_CAPACITY": "500", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}
