"""`make bench-sim`: serving simulated from measured profiles, the real batched loop and block-size policies on
simulated GPUs. The logic is dflash_trt/sim/bench (its docstring says what each grid runs and what it writes);
this is `python -m dflash_trt.sim.bench`.

    python scripts/bench_sim.py [--out results/sim] [--full | --smoke] [--setups ...] [--concurrency ...]
"""

from dflash_trt.sim.bench.cli import main

if __name__ == "__main__":
    main()
