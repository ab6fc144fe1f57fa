"""Serving simulated from measured GPU profiles: fake engines on a virtual clock under the real loop.

`engines` (simulated target and drafter behind the batched engine protocols), `cost` (pass times from
Vidur's A100 profiles or a fitted CPU grid), `acceptance` (per-position acceptance fitted to the paper or
replayed from recorded rounds), `serving` (workloads, policies, the orchestrator-like driver).
Used by scripts/bench_sim.py (`make bench-sim`); nothing here runs a model.
"""
