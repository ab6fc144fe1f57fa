"""Measured GPU operator profiles (Vidur's, vendored under data/profiles/vidur/) and the shapes they belong to.

A profile gives, per tensor-parallel degree and token count, the median time of every linear, norm,
activation and rope op of ONE decoder layer (and the embedding lookup), measured on the GPU; between
profiled token counts the time is interpolated linearly (Vidur profiles every 8 tokens up to 32768), beyond
the last one in proportion to the tokens (see `_interp`). The all-reduce profile gives the time of one all-reduce
by message size within one DGX node; it is made monotone (an all-reduce of more bytes never costs less: the
smallest sizes are launch-bound and noisy) and extrapolated at its last bandwidth.
"""

from __future__ import annotations

import bisect
import csv
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

PROFILE_DIR = Path(__file__).resolve().parents[2] / "data" / "profiles" / "vidur"

# the ops of one decoder layer as Vidur profiles them (its ExecutionTime adds each once per layer)
LAYER_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    bytes_per_value: int = 2  # bf16 weights, activations and KV cache


@dataclass(frozen=True)
class GpuSpec:
    name: str
    hbm_bytes_per_s: float  # datasheet HBM bandwidth
    bf16_flops: float  # datasheet dense bf16 tensor-core peak
    network: str  # the all-reduce profile for tp > 1


MODELS = {
    "llama-3-8b": ModelShape("Meta-Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256),
    "llama-3-70b": ModelShape("Meta-Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256),
    # Vidur profiles H100 for Llama-2 only (MHA at 7B: 32 KV heads; GQA at 70B); vocabulary 32000
    "llama-2-7b": ModelShape("Llama-2-7b-hf", 32, 4096, 32, 32, 128, 11008, 32000),
    "llama-2-70b": ModelShape("Llama-2-70b-hf", 80, 8192, 64, 8, 128, 28672, 32000),
}
# datasheet figures (dense bf16, no sparsity); `profile` names the folder of measured op times
GPUS = {
    "a100": GpuSpec("A100-SXM4-80GB", 2.039e12, 312e12, "a100_dgx"),
    "h100": GpuSpec("H100-SXM5-80GB", 3.35e12, 989e12, "h100_dgx"),
}
# Measured profiles on disk: (gpu, model) pairs. A100: Llama-3; H100: Llama-2 (what Vidur published).
PROFILED = {("a100", "llama-3-8b"), ("a100", "llama-3-70b"), ("h100", "llama-2-7b"), ("h100", "llama-2-70b")}


# Past a profile's largest count a time is the last one scaled by the count (`_interp`, `LayerProfile.curve`): a
# pass that large is bound by compute (GEMMs) or by bandwidth (all-reduces), so its time grows with what it moves.
# The slope of the last two medians instead is noise: at the end of Vidur's H100 profiles (4096 tokens) it falls
# to zero or below for some ops, so a pass past the end would cost barely more than one at the end.


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs sorted, >= 2 points); below the first point along the first segment,
    past the last in proportion to x (see above)."""
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    if x > xs[-1]:
        return ys[-1] * x / xs[-1]
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class LayerProfile:
    """One model's per-layer op times on one GPU: `op(name, tokens, tp)` in seconds."""

    def __init__(self, path: Path):
        self.path = path
        table: dict[int, dict[int, dict[str, float]]] = {}
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                tp, n = int(r["num_tensor_parallel_workers"]), int(r["num_tokens"])
                table.setdefault(tp, {})[n] = {
                    k.removesuffix("_median_ms"): float(v) * 1e-3 for k, v in r.items() if k.endswith("_median_ms")
                }
        self.tps = sorted(table)
        self._tokens = {tp: sorted(rows) for tp, rows in table.items()}
        self._times = {
            tp: {op: [rows[n][op] for n in self._tokens[tp]] for op in rows[self._tokens[tp][0]]}
            for tp, rows in table.items()
        }

    def op(self, name: str, tokens: float, tp: int = 1) -> float:
        if tp not in self._times:
            raise ValueError(f"{self.path.name} has no tp={tp} profile (has {self.tps})")
        if tokens <= 0:
            return 0.0
        return _interp(self._tokens[tp], self._times[tp][name], tokens)

    def layer(self, tokens: float, tp: int = 1) -> float:
        """One decoder layer's linear, norm, activation, rope and add ops for `tokens` tokens (no attention
        kernel, no all-reduce)."""
        return sum(self.op(o, tokens, tp) for o in LAYER_OPS)

    def curve(self, name: str | None, tokens: np.ndarray, tp: int = 1) -> np.ndarray:
        """`op` (name) or `layer` (None) at many token counts at once, the same interpolation and extrapolation
        (a policy that rates every token total of a step calls this); past the last count the summed time is
        scaled, as `_interp` scales each op's."""
        xs = np.asarray(self._tokens[tp], np.float64)
        ops = LAYER_OPS if name is None else (name,)
        ys = np.sum([np.asarray(self._times[tp][o]) for o in ops], axis=0)
        t = np.asarray(tokens, np.float64)
        out = np.interp(t, xs, ys)
        lo, hi = t < xs[0], t > xs[-1]
        out[lo] = ys[0] + (ys[1] - ys[0]) * (t[lo] - xs[0]) / (xs[1] - xs[0])
        out[hi] = ys[-1] * t[hi] / xs[-1]
        return np.where(t > 0, np.maximum(out, 0.0), 0.0)


class AllReduceProfile:
    """Seconds of one all-reduce of `size_bytes` among `workers` GPUs of one node."""

    def __init__(self, path: Path):
        rows: dict[int, list[tuple[int, float]]] = {}
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                rows.setdefault(int(r["num_workers"]), []).append(
                    (int(r["size_bytes"]), float(r["all_reduce_median_ms"]) * 1e-3)
                )
        self._sizes: dict[int, list[float]] = {}
        self._times: dict[int, list[float]] = {}
        for n, pts in rows.items():
            pts.sort()
            times = [t for _, t in pts]
            for i in range(len(times) - 2, -1, -1):  # the lower monotone envelope
                times[i] = min(times[i], times[i + 1])
            self._sizes[n], self._times[n] = [float(s) for s, _ in pts], times

    def curve(self, size_bytes: np.ndarray, workers: int) -> np.ndarray:
        """`__call__` at many sizes, never above it (beyond the last size held at the last time): a lower bound
        for `sim.optimum`."""
        if workers <= 1:
            return np.zeros(len(size_bytes))
        return np.interp(np.asarray(size_bytes, np.float64), self._sizes[workers], self._times[workers])

    def __call__(self, size_bytes: float, workers: int) -> float:
        if workers <= 1:
            return 0.0
        if workers not in self._sizes:
            raise ValueError(f"no all-reduce profile for {workers} GPUs (has {sorted(self._sizes)})")
        xs, ys = self._sizes[workers], self._times[workers]
        if size_bytes <= xs[0]:
            return ys[0]
        return _interp(xs, ys, size_bytes)


@cache
def layer_profile(gpu: str, model: str) -> LayerProfile:
    if (gpu, model) not in PROFILED:
        raise ValueError(f"no measured profile of {model} on {gpu}: measured pairs are {sorted(PROFILED)}")
    return LayerProfile(PROFILE_DIR / gpu / f"{MODELS[model].name}.mlp.csv")


@cache
def all_reduce_profile(gpu: str) -> AllReduceProfile:
    return AllReduceProfile(PROFILE_DIR / "network" / f"{GPUS[gpu].network}.all_reduce.csv")
