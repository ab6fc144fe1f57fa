"""The exact per-step optimum of block sizes: the bound the simulator holds every policy against.

Per step, over per-row blocks 1..16 (ragged: every row its own; block 1 = the row does not draft; a request's
own block size kept), the choice of the most expected committed tokens per second of the step, under

- the rows' TRUE acceptance: row r's expected tokens at block b are E_r(b) = tau of its class's profile
  (`acceptance.AcceptanceProfile`; the class is the simulated prompt's first id), and
- the engines' TRUE pass costs (`cost.ProfileCost`, the very function the simulated engines charge), at the
  rows' cache lengths and drafter backlogs, plus the host's time per step. Prompt chunks riding in the pass
  (chunked prefill: `StepRows.chunk_rows` / `chunk_tokens`, totals only) are priced as one chunk from
  position 0, one logit each, in the bound and in the exact price alike (so the certificate compares like with
  like; the engines price each chunk at its own position): the tokens and that chunk's causal attention
  exact, the rest of the attention a floor (the same for every choice but for the pass's max of memory and
  compute time).

Why the search is exact. E_r(b + 1) - E_r(b) = rates[0] x ... x rates[b - 1], which never grows with b (every
rate <= 1): each row's tokens are concave in its block. For a total of N target tokens the assignment of most
expected tokens is therefore the N - (base tokens) largest marginal gains over all rows, taken in order (for
separable concave gains the greedy choice is optimal); the cumulative sum of the sorted gains gives it for
every N at once. The step's seconds depend on the assignment only through N (the target pass: layer ops and
all-reduces of N tokens, memory-bound attention at the rows' cache lengths, N logits) and through which rows
draft and how (the drafter pass). `Optimum.choose` rates every N with a LOWER bound of any assignment's
seconds at that N (the drafter with the fewest rows able to hold N, no backlog beyond one row each, every op
at the profile's lower monotone envelope, attention at its memory floor), which gives a certified UPPER bound
of the step's tokens per second; then it prices the greedy assignments of the best few N exactly and keeps
the best. The bound and the chosen rate are recorded per step (`Optimum.gap`): the choice is within that gap
of the exact per-step optimum, and a run reports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np

from ..decoding.policy import own_or_max
from ..decoding.step import StepResult, StepRows
from .acceptance import AcceptanceProfile
from .cost import ATTN_BW_EFFICIENCY, ATTN_FLOP_EFFICIENCY, ATTN_MIN_S, PASS_LAUNCH_S, ProfileCost

MAX_DRAFTS = 15  # a 16-token drafter block


class Optimum:
    """The per-step optimum (module docstring). `candidates`: how many of the best-bounded token totals are
    priced exactly."""

    def __init__(
        self, cost: ProfileCost, profiles: Sequence[AcceptanceProfile], host_s: float = 0.0, candidates: int = 4
    ):
        if not isinstance(cost, ProfileCost):
            raise ValueError("the optimum needs the GPU cost model (ProfileCost): it prices every token total")
        self.cost, self.host_s, self.candidates, self.profiles = cost, host_s, candidates, list(profiles)
        self.gains = [np.cumprod(np.asarray(p.rates[:MAX_DRAFTS], np.float64)) for p in profiles]
        self.steps, self.bound_sum, self.chosen_sum, self.worst_gap = 0, 0.0, 0.0, 0.0
        self._chunks = (0, 0)  # this step's riding prompt chunks: rows, tokens
        # the classes strongest first, when each one's gains dominate the next's at every position (then the
        # bound counts a drafting row's worth; otherwise it falls back to the best gains of any rows)
        strength = sorted(range(len(self.gains)), key=lambda c: -float(self.gains[c][0]))
        ordered = all(bool((self.gains[a] >= self.gains[b]).all()) for a, b in zip(strength, strength[1:]))
        self.order: list[int] | None = strength if ordered else None
        if self.order is not None:  # every class's gains, in that order, then sorted best first (`_strongest`)
            values = np.concatenate([self.gains[c] for c in self.order])
            self._by_gain = np.argsort(-values, kind="stable")
            self._sorted_gains = values[self._by_gain]

    @property
    def gap(self) -> float:
        """Mean over steps of the certified bound over the chosen rate, minus 1 (0: provably optimal)."""
        return self.bound_sum / self.chosen_sum - 1 if self.chosen_sum else 0.0

    def choose(self, step: StepRows) -> list[int]:
        forced = np.where(step.fixed > 0, step.fixed, np.where(step.max_block < 2, 1, 0)).astype(np.int64)
        free = np.flatnonzero(forced == 0)
        if not len(free):
            return own_or_max(step)
        rows = step.rows
        klass = np.array([r.prompt_ids[0] for r in rows], np.int64)
        past = np.array([len(r.prompt_ids) + len(r.generated) - 1 for r in rows], np.int64)
        backlog = np.maximum(step.backlog.astype(np.int64), 1)
        base = np.where(forced > 0, forced, 1)
        gains = np.full((len(free), MAX_DRAFTS), -1.0)  # -1: a block the row may not reach
        for j, i in enumerate(free.tolist()):
            reach = min(int(step.max_block[i]) - 1, MAX_DRAFTS)
            gains[j, :reach] = self.gains[klass[i]][:reach]
        flat = gains.ravel()
        order = np.argsort(-flat, kind="stable")  # within a row its gains in block order (they never grow)
        order = order[flat[order] >= 0]
        tokens0 = float(sum(1.0 + self.gains[klass[i]][: base[i] - 1].sum() for i in range(len(rows))))
        tokens = tokens0 + np.concatenate(([0.0], np.cumsum(flat[order])))  # index k: k gains taken
        self._chunks = (int(step.chunk_rows), int(step.chunk_tokens))
        floor = _Floor(self, base, forced, past, backlog)
        bound = self._bound(tokens, tokens0, klass[free], floor)
        best_k = np.argsort(-bound, kind="stable")[: self.candidates]
        chosen, rate = base, 0.0
        for k in best_k.tolist():
            blocks = base.copy()
            np.add.at(blocks, free[order[:k] // MAX_DRAFTS], 1)
            r = tokens[k] / self._exact_time(blocks, past, backlog)
            if r > rate:
                chosen, rate = blocks, r
        top = float(bound.max())
        self.steps += 1
        self.bound_sum += top
        self.chosen_sum += rate
        self.worst_gap = max(self.worst_gap, top / rate - 1)
        return cast(list[int], chosen.tolist())

    def _bound(self, tokens: np.ndarray, tokens0: float, klass: np.ndarray, floor: _Floor) -> np.ndarray:
        """Per k (gains taken), an upper bound of tokens per second over every choice with k gains: over
        intervals [a, b] of m, the free rows that draft, the most tokens of b drafting rows over the least
        seconds of a (both monotone in m). With the profiles ordered by dominance (every gain of one >= the
        other's), b drafting rows yield at most the b strongest rows' k best gains (caps relaxed to 16)."""
        k = np.arange(len(tokens))
        target = floor.target(k)
        out = np.where(k == 0, tokens / (target + floor.drafter(k, np.zeros_like(k))), 0.0)
        rows = len(klass)
        edges = np.unique(np.round(np.geomspace(1, rows, min(rows, 24))).astype(np.int64))
        lows = np.concatenate(([1], edges[:-1] + 1))
        keep = lows <= edges
        if not keep.any():
            return out
        lows, edges = lows[keep], edges[keep]
        # every interval at once, one row each (the same elementwise sums as one interval at a time)
        if self.order is None:
            most = np.broadcast_to(tokens, (len(edges), len(tokens)))
        else:
            most = np.minimum(tokens, tokens0 + self._strongest(klass, edges, k))
        a, b = lows[:, None], edges[:, None]
        m_least = np.maximum(a, np.ceil(k / MAX_DRAFTS)).astype(np.int64)
        ok = (k >= a) & (m_least <= b)
        rate = most / (target + floor.drafter(k, m_least))
        return cast(np.ndarray, np.maximum(out, np.where(ok, rate, -np.inf).max(axis=0)))

    def _strongest(self, klass: np.ndarray, m: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Per m (one row each), the sum of the k best gains of the m strongest of these rows, each allowed all
        15 drafts."""
        assert self.order is not None
        counts = np.bincount(klass, minlength=len(self.gains))[self.order]
        before = np.concatenate(([0], np.cumsum(counts)[:-1]))
        take = np.minimum(counts, np.maximum(0, m[:, None] - before))
        values, weights = self._sorted_gains, np.repeat(take, MAX_DRAFTS, axis=1)[:, self._by_gain]
        zero = np.zeros((len(m), 1))
        cum_w = np.concatenate((zero.astype(np.int64), np.cumsum(weights, axis=1)), axis=1)
        cum_v = np.concatenate((zero, np.cumsum(values * weights, axis=1)), axis=1)
        j = np.clip(np.stack([np.searchsorted(w, k, side="right") for w in cum_w]) - 1, 0, len(values) - 1)
        at_w, at_v = np.take_along_axis(cum_w, j, axis=1), np.take_along_axis(cum_v, j, axis=1)
        partial = np.where(k > at_w, (k - at_w) * values[j], 0.0)
        return np.where(k >= cum_w[:, -1:], cum_v[:, -1:], at_v + partial)

    def observe(self, result: StepResult) -> None:
        return None

    def forget(self, row: object) -> None:
        return None

    def _exact_time(self, blocks: np.ndarray, past: np.ndarray, backlog: np.ndarray) -> float:
        """Seconds of the step with these blocks: the engines' own prices, plus the host's."""
        c, n = self.cost, int(blocks.sum())
        rows, tokens = self._chunks  # the prompt chunks riding in the pass, priced as one from position 0
        if tokens:
            t = c.target([*blocks.tolist(), tokens], [*past.tolist(), 0], n + rows)
        else:
            t = c.target(blocks.tolist(), past.tolist(), n)
        d = np.flatnonzero(blocks >= 2)
        if len(d):
            t += c.drafter(blocks[d].tolist(), backlog[d].tolist(), (past[d] - backlog[d]).tolist())
        return t + self.host_s


class _Floor:
    """Lower bounds of one step's seconds, vectorised over k (gains taken over the base choice)."""

    def __init__(self, opt: Optimum, base: np.ndarray, forced: np.ndarray, past: np.ndarray, backlog: np.ndarray):
        c, s = opt.cost, opt.cost.shape
        self.cost, self.host_s, self.base, self.past = c, opt.host_s, base, past
        self.chunk_rows, self.chunk_tokens = opt._chunks
        self.fd = forced >= 2  # rows whose own block drafts
        self.kv_row = 2 * s.kv_heads / c.tp * s.head_dim * s.bytes_per_value
        self.bw = c.spec.hbm_bytes_per_s * c.time_scale * ATTN_BW_EFFICIENCY
        self.peak = c.spec.bf16_flops * c.time_scale * c.token_scale * ATTN_FLOP_EFFICIENCY
        # the m drafting rows at their least: the m smallest backlogs and cache lengths
        self.least_ctx = np.concatenate(([0], np.cumsum(np.sort(backlog))))
        self.least_keys = np.concatenate(([0], np.cumsum(np.sort(past))))

    def target(self, k: np.ndarray) -> np.ndarray:
        """The host's time and the target pass of base + k tokens (attention at its memory and FLOP floors)."""
        c, s = self.cost, self.cost.shape
        n = int(self.base.sum()) + k  # verify tokens; the pass also holds the chunks' tokens
        total = n + self.chunk_tokens
        padded = c.padded_many(total)
        flop_q = 4 * s.heads / c.tp * s.head_dim
        chunk_pairs = self.chunk_tokens * (self.chunk_tokens + 1) / 2  # the chunk's causal attention, exact
        attn = np.maximum.reduce(
            [
                (self.past.sum() + 2 * total) * self.kv_row / self.bw,
                flop_q * (n * (self.past.min() + 1) + chunk_pairs) / self.peak,
                np.full(len(n), ATTN_MIN_S),
            ]
        )
        lm = c.op_floor(n + self.chunk_rows, "mlp_up_proj") * s.vocab / (2 * s.intermediate)
        layers = s.layers * (c.op_floor(padded) + attn + c.comm_floor(padded))
        return cast(np.ndarray, self.host_s + layers + c.op_floor(total, "emb") + lm + PASS_LAUNCH_S)

    def drafter(self, k: np.ndarray, m_free: np.ndarray) -> np.ndarray:
        """The drafter pass for k gains taken by m_free free rows (0: none drafts), the forced rows beside."""
        c, s = self.cost, self.cost.shape
        m = int(self.fd.sum()) + m_free
        blocks = int(self.base[self.fd].sum()) + k + m_free  # block tokens of the drafting rows
        drafts = blocks - m
        mm = np.minimum(m, len(self.past))
        ctx = self.least_ctx[mm]
        fc = c.op_floor(ctx, "attn_post_proj") * c.feature_layers + c.op_floor(ctx, "input_layernorm")
        kv = c.kv_share * c.op_floor(ctx, "attn_pre_proj")
        attn = np.maximum((self.least_keys[mm] + 2 * blocks) * self.kv_row / self.bw, ATTN_MIN_S)
        padded = c.padded_many(blocks)
        layer = c.op_floor(padded) + kv + attn + c.comm_floor(padded)
        lm = c.op_floor(drafts, "mlp_up_proj") * s.vocab / (2 * s.intermediate)
        total = fc + c.drafter_layers * layer + c.op_floor(blocks, "emb") + lm + PASS_LAUNCH_S
        return np.where(m > 0, total, 0.0)
