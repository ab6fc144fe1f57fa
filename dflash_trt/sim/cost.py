"""What one batched pass costs, in seconds: from measured GPU op profiles, or from a fitted CPU cost grid.

GPU passes (`ProfileCost`), for a pass over rows i with n_i new tokens after p_i cached ones, N = sum n_i:

    target  = layers x [ layer_ops(N) + attention(n, p, causal) + 2 x all_reduce(N x hidden x 2 B) ]
              + emb(N) + lm_head(rows that need logits) + PASS_LAUNCH_S
    drafter = fc(sum new context) + layers_d x [ layer_ops(sum B) + kv_proj(new context)
              + attention(B, p + new context, non-causal) + 2 x all_reduce(sum B) ] + emb(sum B)
              + lm_head(sum (B - 1)) + PASS_LAUNCH_S

- layer_ops: Vidur's measured medians of every linear, norm, activation, rope and add op of one layer at this
  token count and tp (`profiles.LayerProfile.layer`); the matrices are weight-bandwidth bound up to ~128
  tokens and compute bound beyond, which is exactly the regime change speculative decoding lives in.
- all-reduce at tp > 1: two per layer (after the attention output and after the MLP, as in Vidur's
  ExecutionTime), each Vidur's measured all-reduce of the layer's activations plus its NCCL launch
  overhead (Vidur's default, 0.02 ms).
- attention (a model: Vidur's attention profiles were not in the snapshot, see data/profiles/vidur/SOURCE.md):
  per layer and GPU, max(KV bytes read and written / (HBM bandwidth x ATTN_BW_EFFICIENCY),
  attention FLOPs / (bf16 peak x ATTN_FLOP_EFFICIENCY), ATTN_MIN_S), with KV bytes
  sum_i (p_i + n_i) x 2 x kv_heads/tp x head_dim x 2 B and FLOPs sum_i 4 x heads/tp x head_dim x n_i x
  (keys each query sees: p_i + (n_i + 1)/2 causal, p_i + n_i non-causal). Memory bound for decode and
  verify blocks, compute bound for long prefills. Checked against a published measurement, not Vidur's:
  FlashAttention-2's causal forward rate on an A100 (Dao 2023, fig. 4) for a 2048-token prefill at 32 heads
  (the figures: results/sim/README.md; tests/sim/test_sim.py checks the range). Vidur's own attention
  profiles could not be compared: absent.
- lm_head: a [hidden x vocab] matrix priced as Vidur's measured fused gate/up projection
  ([hidden x 2 intermediate]) at the same token count and tp, times vocab / (2 x intermediate): the same
  GEMM kernel family, measured efficiency, scaled by its weight size.
- the drafter (a DFlash drafter of `drafter_layers` layers of the target's shape): block tokens go through
  whole layers; each new context feature goes through the `fc` projection (layers_target_features x hidden
  -> hidden, priced as that many [hidden x hidden] output projections) and each drafter layer's K/V
  projection only, a GEMM of its own as in z-lab's drafter (k_proj / v_proj of the context features, apart
  from the block's), priced as the fused QKV projection of those rows times the K/V share of its weights
  (`kv_share`); the block's queries attend over the whole context, unmasked.

CUDA graphs (`graph_sizes`, on when given): a GPU server replays captured graphs for passes of at most the
largest captured token count, padded to the smallest captured size that holds them (vLLM's default sizes:
`vllm_capture_sizes`); the layer ops and all-reduces then run at the padded count (the padding rows are
computed), attention and the lm_head at the real one. Larger passes (prefills) run eagerly, unpadded. Off,
every pass runs at its own token count: the profile's medians, no launch gaps (its kernels back to back).

A what-if GPU (`what_if`): a measured profile read as another GPU's from datasheet ratios alone (bandwidth
and bf16 peak): times divided by the bandwidth ratio (weight-bound passes), the token axis stretched by the
ratio of the two GPUs' FLOPs per byte (where the matrices turn compute bound). Not a measurement: its name
says what-if.

CPU passes (`LinearPassCost`): the server's own fitted grid (`adaptive.EngineCost` coefficients, e.g. the
`cost_model` that `make bench-load` records), target (rows, tokens) and drafter (rows, block + new context
tokens) exactly as the policy prices them, so that the simulator can be held against the measured loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np

from .profiles import GPUS, MODELS, AllReduceProfile, GpuSpec, LayerProfile, all_reduce_profile, layer_profile

ATTN_BW_EFFICIENCY = 0.8  # decode attention kernels (FlashDecoding / FlashInfer) reach ~80 % of HBM bandwidth
ATTN_FLOP_EFFICIENCY = 0.6  # FlashAttention-2 forward on A100: ~50-70 % of the bf16 peak at head dim 128
ATTN_MIN_S = 10e-6  # one attention kernel per layer is never cheaper than this (launch, one wave)
NCCL_LAUNCH_S = 0.02e-3  # per all-reduce: Vidur's nccl_cpu_launch_overhead_ms default
PASS_LAUNCH_S = 50e-6  # per pass: input preparation, sampling kernels, the host-device round trip

# Datasheet figures of GPUs without a measured profile, each read from a measured one (`what_if`); HGX B200:
# 8 TB/s HBM3e, 2.25 PFLOP/s dense bf16
WHAT_IFS = {"b200-like-what-if": ("a100", GpuSpec("B200 (what-if from A100 profiles)", 8.0e12, 2.25e15, "a100_dgx"))}


def vllm_capture_sizes(largest: int = 512) -> tuple[int, ...]:
    """vLLM's default CUDA-graph capture sizes: 1, 2, 4, then every multiple of 8 up to `largest`."""
    return (1, 2, 4, *range(8, largest + 1, 8))


class PassCost(Protocol):
    def target(self, new: Sequence[int], past: Sequence[int], logits: int) -> float:
        """Seconds of one target pass: rows with new[i] tokens after past[i] cached; `logits` rows of the
        lm_head are computed (every new token in a verify pass, one per row in a prefill)."""

    def drafter(self, blocks: Sequence[int], new_context: Sequence[int], past: Sequence[int]) -> float:
        """Seconds of one drafter pass: per row, a block of blocks[i] tokens, new_context[i] new context
        features taken in, past[i] context features already cached."""


@dataclass
class ProfileCost:
    """GPU pass times from Vidur's profiles (see the module docstring)."""

    gpu: str = "a100"
    model: str = "llama-3-8b"
    tp: int = 1
    drafter_layers: int = 5  # the published Qwen3-8B DFlash drafter
    feature_layers: int = 5  # target layers whose hidden states the drafter reads (its fc input)

    # a what-if, not a measurement: read the profile at tokens / token_scale and divide its times by time_scale
    # (a GPU whose matrices turn compute bound token_scale x later and run time_scale x faster)
    token_scale: float = 1.0
    time_scale: float = 1.0
    graph_sizes: tuple[int, ...] = ()  # CUDA graphs: captured token counts (empty: off; module docstring)
    label: str = ""  # the name results carry (the GPU's, or a what-if's)

    @classmethod
    def what_if(cls, name: str, model: str = "llama-3-8b", tp: int = 1, **options: object) -> ProfileCost:
        """A GPU without a profile, read from a measured one by datasheet ratios (module docstring)."""
        if name not in WHAT_IFS:
            raise ValueError(f"unknown what-if {name!r}: one of {sorted(WHAT_IFS)}")
        base, spec = WHAT_IFS[name]
        have = GPUS[base]
        bw = spec.hbm_bytes_per_s / have.hbm_bytes_per_s
        ridge = (spec.bf16_flops / spec.hbm_bytes_per_s) / (have.bf16_flops / have.hbm_bytes_per_s)
        return cls(base, model, tp, token_scale=ridge, time_scale=bw, label=name, **options)  # type: ignore[arg-type]

    def padded(self, tokens: int) -> int:
        """The token count a pass runs at: with graphs on, the smallest captured size that holds it."""
        if not self.graph_sizes or tokens > self.graph_sizes[-1]:
            return tokens
        return next(g for g in self.graph_sizes if g >= tokens)

    def padded_many(self, tokens: np.ndarray) -> np.ndarray:
        """`padded` of many token counts at once."""
        if not self.graph_sizes:
            return tokens
        sizes = np.asarray(self.graph_sizes)
        at = np.minimum(np.searchsorted(sizes, tokens), len(sizes) - 1)
        return np.where(tokens <= sizes[-1], sizes[at], tokens)

    @property
    def kv_share(self) -> float:
        """The K and V projections' share of the fused QKV projection (its output width, hence its weights)."""
        s = self.shape
        return 2 * s.kv_heads / (s.heads + 2 * s.kv_heads)

    def __post_init__(self) -> None:
        self.label = self.label or self.gpu
        self.graph_sizes = tuple(sorted(self.graph_sizes))
        self.shape = MODELS[self.model]
        self.spec = GPUS[self.gpu]
        self.ops: LayerProfile = layer_profile(self.gpu, self.model)
        self.all_reduce: AllReduceProfile = all_reduce_profile(self.gpu)
        self.op(1)  # fail now on a tp the profile lacks

    def op(self, tokens: float, name: str | None = None) -> float:
        """One op's (`name`) or a whole layer's (None) seconds at `tokens` tokens, remembered per (tokens, name):
        a run prices the same few token counts thousands of times."""
        known = self.__dict__.setdefault("_ops", {})
        t = known.get((tokens, name))
        if t is None:
            n = tokens / self.token_scale
            t = known[tokens, name] = (
                self.ops.layer(n, self.tp) if name is None else self.ops.op(name, n, self.tp)
            ) / self.time_scale
        return cast(float, t)

    def op_floor(self, tokens: np.ndarray, name: str | None = None) -> np.ndarray:
        """`op` at integer token counts (vectorised), each replaced by the least time of any count at or above
        it (the profile's lower monotone envelope: its medians are not monotone): a lower bound of `op` at any
        count >= tokens (`sim.optimum`). The envelope is kept per op, extended when a larger count comes."""
        tokens = np.asarray(tokens, np.int64)
        need = int(np.max(tokens, initial=0)) + 1
        floors = self.__dict__.setdefault("_floors", {})
        floor = floors.get(name)
        if floor is None or len(floor) <= need:
            top = max(2 * need, 4096)
            grid = np.arange(top + 1, dtype=np.float64)
            t = self.ops.curve(name, grid / self.token_scale, self.tp) / self.time_scale
            floor = floors[name] = np.minimum.accumulate(t[::-1])[::-1]
        return cast(np.ndarray, floor[tokens])

    def comm_floor(self, tokens: np.ndarray) -> np.ndarray:
        """A lower bound of `comm` at these token counts (vectorised)."""
        if self.tp == 1:
            return np.zeros(np.shape(tokens))
        size = np.asarray(tokens, np.float64) * self.shape.hidden * self.shape.bytes_per_value
        return np.where(size > 0, 2 * (self.all_reduce.curve(size, self.tp) + NCCL_LAUNCH_S), 0.0)

    def comm(self, tokens: float) -> float:
        """Both all-reduces of one layer."""
        if self.tp == 1 or tokens <= 0:
            return 0.0
        size = tokens * self.shape.hidden * self.shape.bytes_per_value
        return 2 * (self.all_reduce(size, self.tp) + NCCL_LAUNCH_S)

    def attention(self, queries: Sequence[int], keys_before: Sequence[int], causal: bool) -> float:
        """One layer's attention on one GPU: rows with queries[i] query tokens after keys_before[i] cached keys
        (the queries' own keys are written and read too)."""
        s = self.shape
        kv_row = 2 * s.kv_heads / self.tp * s.head_dim * s.bytes_per_value  # K and V bytes per token
        flop_q = 4 * s.heads / self.tp * s.head_dim  # QK^T and PV, per query per key
        nbytes = flops = 0.0
        for n, p in zip(queries, keys_before):
            nbytes += (p + 2 * n) * kv_row  # read all keys (the cache and the new), write the new
            flops += flop_q * n * (p + ((n + 1) / 2 if causal else n))
        bandwidth = self.spec.hbm_bytes_per_s * self.time_scale
        peak = self.spec.bf16_flops * self.time_scale * self.token_scale
        return max(nbytes / (bandwidth * ATTN_BW_EFFICIENCY), flops / (peak * ATTN_FLOP_EFFICIENCY), ATTN_MIN_S)

    def lm_head(self, tokens: float) -> float:
        s = self.shape
        return self.op(tokens, "mlp_up_proj") * s.vocab / (2 * s.intermediate) if tokens > 0 else 0.0

    def target(self, new: Sequence[int], past: Sequence[int], logits: int) -> float:
        n = sum(new)
        if n == 0:
            return 0.0
        padded = self.padded(n)
        per_layer = self.op(padded) + self.attention(new, past, causal=True) + self.comm(padded)
        return self.shape.layers * per_layer + self.op(n, "emb") + self.lm_head(logits) + PASS_LAUNCH_S

    def drafter(self, blocks: Sequence[int], new_context: Sequence[int], past: Sequence[int]) -> float:
        b, c = sum(blocks), sum(new_context)
        if b == 0:
            return 0.0
        fc = self.feature_layers * self.op(c, "attn_post_proj") + self.op(c, "input_layernorm") if c else 0.0
        kv_proj = self.kv_share * self.op(c, "attn_pre_proj")  # the context rows' own K/V projection
        keys = [p + n for p, n in zip(past, new_context)]
        padded = self.padded(b)
        per_layer = self.op(padded) + kv_proj + self.attention(blocks, keys, causal=False) + self.comm(padded)
        drafts = sum(max(0, x - 1) for x in blocks)
        return fc + self.drafter_layers * per_layer + self.op(b, "emb") + self.lm_head(drafts) + PASS_LAUNCH_S


@dataclass
class LinearPassCost:
    """CPU pass times from a fitted cost grid: seconds = fixed + per_row x rows + per_token x tokens (the
    target's one-token pass `one_token` when given), the shape the adaptive policy itself uses."""

    target_fixed: float
    target_per_row: float
    target_per_token: float
    drafter_fixed: float
    drafter_per_row: float
    drafter_per_token: float
    target_one_token: float | None = None

    @classmethod
    def from_cost_model(cls, cost: dict[str, dict[str, float]], k: float = 1.0) -> LinearPassCost:
        """From a recorded `{"target": {...}, "drafter": {...}}` (`make bench-load`'s cost_model, kept in
        data/measured/demo-load.json), every coefficient times k (e.g. the ratio of the passes that ran to the
        grid's price for them)."""
        t, d = cost["target"], cost["drafter"]
        one = t.get("one_token")
        return cls(
            k * t["fixed"],
            k * t["per_row"],
            k * t["per_token"],
            k * d["fixed"],
            k * d["per_row"],
            k * d["per_token"],
            None if one is None else k * one,
        )

    def target(self, new: Sequence[int], past: Sequence[int], logits: int) -> float:
        rows, n = len(new), sum(new)
        if rows == 1 and n == 1 and self.target_one_token is not None:
            return self.target_one_token
        return self.target_fixed + self.target_per_row * rows + self.target_per_token * n if rows else 0.0

    def drafter(self, blocks: Sequence[int], new_context: Sequence[int], past: Sequence[int]) -> float:
        rows = len(blocks)
        tokens = sum(blocks) + sum(new_context)
        return self.drafter_fixed + self.drafter_per_row * rows + self.drafter_per_token * tokens if rows else 0.0
