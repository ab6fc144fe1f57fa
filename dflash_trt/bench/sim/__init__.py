"""Serving simulated from measured profiles: the real batched loop and block-size policies on simulated GPUs.

    dflash-trt bench sim [--out results/sim] [--full | --smoke] [--setups ...] [--concurrency ...]

Two grids. The default, REDUCED (about 12 minutes with --jobs 2 on 2 CPUs, 2 seeds): A100 Llama-3-8B tp=1 on
`paper` and `mixed`, H100 Llama-2-7B tp=1 on `paper`, H100 Llama-2-70B tp=4 on `mixed`, at concurrency
1/8/32/128, 32 requests at C=1 and max(64, 8 x C) above. `--full` (about 8 CPU-hours: 4 hours with --jobs 2):
concurrency 1..256 x workloads ("paper": each request from one of the paper's Qwen3-8B T=0 benchmarks;
"mixed": half the requests accept poorly, tau ~2 at block 16) x every setup x 3 seeds, at max(512, 16 x C)
requests a cell, on Vidur's measured profiles: A100 Llama-3-8B tp=1 and Llama-3-70B tp=4, H100 Llama-2-7B
tp=1 and Llama-2-70B tp=4 (dflash_trt/sim, the simulator this package drives). Both run every policy, in two phases:

  1. none, fixed-4/8/16, adaptive, trtllm-schedule (as DFlashDecodingConfig configures it: no acceptance
     threshold), trtllm-schedule-threshold (the threshold set: a named variant) and optimum (the exact
     per-step optimum with true acceptance and true pass costs: the bound);
  2. tuned-table and vllm-table: TensorRT-LLM's and vLLM's per-batch-size tables, each entry the best of
     none / fixed-4 / fixed-8 / fixed-16 at that concurrency in phase 1 (mean over the seeds).

Prefill: the grid runs with `--prefill` (default chunked, the loop's default, at a GPU server's token budget:
STEP_TOKENS_OF in dflash_trt/sim/policies.py, vLLM's per-GPU defaults, and the loop's time bound,
`--prefill-stall`); at C=32 chunked and separate prefill are run side by side. Also a Poisson open-loop sweep and two calibrations:

  (a) CPU: the simulator with the CPU cost grid and host overhead `make bench-load` recorded
      (data/measured/demo-load.json) against the measured engines-alone tokens/s;
  (b) GPU: the speedup of a fixed block 16 over the target alone on MATH500-like requests (T = 0 and T = 1
      acceptance) from concurrency 1 to 32 at 2048 new tokens, the published conditions, against SGLang's
      published DFlash curve (B200: 5.1x -> 2.8x), on the A100 profile and a B200-like what-if.

Proposers: every request drafts DFlash blocks unless `--proposer suffix|hybrid`; their suffix matches are then
replayed from the demo pair's recorded suffix rounds (`--suffix-trace`: data/measured/suffix-trace.json,
dflash_trt/sim/suffix.py), and the real proposers choose on them. The GPU calibration stays DFlash.

Writes results.json (`runs`: one item per closed-loop cell and seed), README.md (tables, checks, and
explanations computed from the run) and sim.png. Nothing here runs a model; every figure is simulated.
"""
