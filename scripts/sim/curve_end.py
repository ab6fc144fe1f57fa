"""What adaptive's start-up grid says a token costs past the end of its measured token curve, per simulated setup:
the slope of the curve's last two points (the extrapolation before dd3366c), the upper half's least-squares line
(`cost.beyond_slope`, after), and the simulated truth: 256 rows at a 512-token context going from 16 to 32
tokens each (4,096 to 8,192, logits for every token). Run from the
repository root: PYTHONPATH=. .venv/bin/python scripts/sim/curve_end.py"""

from dflash_trt.decoding.adaptive import AdaptiveBlocks
from dflash_trt.decoding.cost import curve_arrays
from dflash_trt.sim.cost import ProfileCost
from dflash_trt.sim.engines import sim_engines
from dflash_trt.sim.serving import workload

print("| setup | curve ends at | last two points us/token | upper half us/token | simulated 4,096 -> 8,192 us/token |")
print("|---|---|---|---|---|")
for setup in ("a100:llama-3-8b:1", "a100:llama-3-70b:4", "h100:llama-2-7b:1", "h100:llama-2-70b:4"):
    gpu, model, tp = setup.split(":")
    cost = ProfileCost(gpu, model, int(tp))
    target, drafter, clock = sim_engines(cost, list(workload("paper").profiles))
    target_cost, _ = AdaptiveBlocks.measured(target, drafter, 256, clock, gpu=True).cost.current()
    c = curve_arrays(target_cost.curve)
    last_two = (c.ys[-1] - c.ys[-2]) / (c.xs[-1] - c.xs[-2])
    truth = (cost.target([32] * 256, [512] * 256, 8192) - cost.target([16] * 256, [512] * 256, 4096)) / 4096
    print(f"| {setup} | {c.xs[-1]:.0f} | {1e6 * last_two:.1f} | {1e6 * c.slope_beyond:.1f} | {1e6 * truth:.1f} |")
