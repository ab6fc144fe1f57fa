"""Serving simulated from measured GPU profiles: fake engines on a virtual clock under the real loop.

`engines` (simulated target and drafter behind the batched engine protocols), `cost` (pass times from
Vidur's A100 profiles or a fitted CPU grid), `acceptance` (per-position acceptance fitted to the paper or
replayed from recorded rounds), `serving` (workloads, and the driver that runs the server's own loop,
`server.orchestrator.BatchLoop`, on the virtual clock), `measured` (the measured inputs under data/measured/, the
one place they are resolved). The benchmark that drives it over a grid of setups and policies is
dflash_trt.bench.sim (`dflash-trt bench sim`, `make bench-sim`). Nothing here runs a model.
"""
