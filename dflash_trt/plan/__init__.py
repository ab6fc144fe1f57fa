"""`dflash-trt plan`: which draft length at which batch size, for a drafter's measured acceptance on a GPU.

From a drafter's per-position acceptance (`inputs.read_trace`: the rounds of `generate --json --trace` or the
server's per-request statistics; or a named profile, `inputs.named_acceptance`) and a pass-cost profile (Vidur's
measured GPU op profiles for the nearest model shape, or a grid measured on the user's GPU by scripts/gpu_bare.py:
`inputs.vidur_cost`, `inputs.grid_cost`), `tune.plan` runs the serving simulator (dflash_trt/sim) with every
fixed block size at every concurrency, keeps the best per concurrency (the tuned table), turns it into
TensorRT-LLM's draft_len_schedule and feeds that schedule back into the simulator; `outputs` writes it as
TensorRT-LLM native YAML, vLLM's num_speculative_tokens_per_batch_size JSON and SGLang flags, with plan.json
(every figure, every input labelled measured or assumed), a table and a plot. Nothing here runs a model.
"""
