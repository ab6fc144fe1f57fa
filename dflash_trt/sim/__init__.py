"""Serving simulated from measured GPU profiles: fake engines on a virtual clock under the real loop.

`engines` (simulated target and drafter behind the batched engine protocols), `cost` (pass times from
Vidur's A100 profiles or a fitted CPU grid), `acceptance` (per-position acceptance fitted to the paper or
replayed from recorded rounds), `serving` (workloads, and the driver that runs the server's own loop,
`server.orchestrator.BatchLoop`, on the virtual clock), `measured` (the measured inputs under data/measured/, the
one place they are resolved), `bench` (`make bench-sim`: its grid, calibrations, checks and report;
scripts/bench_sim.py is its command line). Nothing here runs a model.
"""
