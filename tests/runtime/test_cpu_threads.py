"""runtime.cpu_threads: releasing a thread's OpenMP workers (why: see the module docstring)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dflash_trt.runtime.cpu_threads import _loaded_libgomp, release_openmp_workers

pytestmark = [
    pytest.mark.skipif(not _loaded_libgomp(), reason="this torch build does not run on libgomp"),
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: torch runs no OpenMP team"),
]


def test_release_frees_the_calling_threads_openmp_workers():
    """In a fresh process: a parallel kernel on the main thread leaves an OpenMP worker thread behind; the
    release makes it exit; the next parallel kernel builds a team again and still computes correctly."""
    script = textwrap.dedent("""
        import os, time, torch
        from dflash_trt.runtime.cpu_threads import release_openmp_workers
        torch.set_num_threads(2)
        tasks = lambda: len(os.listdir("/proc/self/task"))
        before = tasks()
        a = torch.randn(4_000_000); b = torch.empty_like(a); b.copy_(a)  # a parallel region
        with_team = tasks()
        released = release_openmp_workers()
        time.sleep(0.2)
        after = tasks()
        c = torch.empty_like(a); c.copy_(a)  # parallel again after the release
        print(before, with_team, released, after, bool(torch.equal(a, c)))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    before, with_team, released, after, equal = out.stdout.split()
    assert int(with_team) > int(before)  # the team's worker thread
    assert released == "True"
    assert int(after) < int(with_team)  # gone
    assert equal == "True"


def test_release_in_this_process_leaves_torch_working():
    x = torch.randn(2_000_000)
    assert release_openmp_workers() is True
    assert torch.equal(x.clone(), x)
