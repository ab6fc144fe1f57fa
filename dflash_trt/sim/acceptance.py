"""How many drafted positions the simulated target accepts: per-position acceptance rates.

`rates[k-1]` is the probability that draft position k (1-based, after the block's first token) is accepted
given that positions 1..k-1 were: a round of block B accepts the longest prefix of positions that pass,
so tau(B) = 1 + sum_{k=1}^{B-1} prod_{j<=k} rates[j-1] (the bonus token included).

Fitted profiles: the paper reports one tau per benchmark (Qwen3-8B, T=0, block 16, its Table 1), so one
number per benchmark fixes one parameter; the shape along the block is an assumption:
rates[k-1] = a x DECAY^(k-1), later positions a little worse than earlier ones (the paper weights its
training loss by exp(-(k-1)/gamma) for that reason). DECAY is assumed, not measured; `a` is solved so that
tau at block 16 equals the published figure exactly. Replayed profiles: per-position rates counted from
recorded rounds (`from_rounds`: (block, accepted) pairs of a run on the demo pair), or the constant rate
that gives a recorded tau at its block size (`from_tau`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DECAY = 0.99

# Qwen3-8B DFlash, T = 0, block 16: tau per benchmark (dflash.md, the paper's Table 1)
PAPER_T0_B16 = {
    "gsm8k": 6.54,
    "math500": 7.87,
    "aime25": 7.08,
    "humaneval": 6.50,
    "mbpp": 5.95,
    "livecodebench": 7.27,
    "mt-bench": 4.24,
}
# the same drafter sampled at T = 1 (the paper's Table 1, "DFlash, T=1" row): the acceptance a sampling
# deployment sees (the simulated engines decode greedily; only the rates change)
PAPER_T1_B16 = {
    "gsm8k": 5.98,
    "math500": 6.40,
    "aime25": 4.73,
    "humaneval": 5.52,
    "mbpp": 5.21,
    "livecodebench": 6.69,
    "mt-bench": 3.80,
}


def tau_of(rates: Sequence[float], block: int) -> float:
    """Expected committed tokens of one round of `block` tokens (block - 1 drafts)."""
    tau, p = 1.0, 1.0
    for r in rates[: block - 1]:
        p *= r
        tau += p
    return tau


@dataclass(frozen=True)
class AcceptanceProfile:
    name: str
    rates: tuple[float, ...]  # per draft position, conditional on the positions before it

    def tau(self, block: int) -> float:
        return tau_of(self.rates, block)

    def equivalent_rate(self, block: int = 16) -> float:
        """The constant per-position rate with this profile's tau at `block` (what a geometric estimate of
        the row's acceptance, as the adaptive policy keeps, would read if it were exact)."""
        return AcceptanceProfile.fit(self.name, self.tau(block), block, decay=1.0).rates[0]

    def accepted(self, draws: Iterable[float]) -> int:
        """Accepted positions for uniform draws in [0, 1), one per drafted position (taken up to the first
        rejection: an iterator is drawn no further)."""
        k = 0
        for u, r in zip(draws, self.rates):
            if u >= r:
                break
            k += 1
        return k

    @classmethod
    def fit(cls, name: str, tau: float, block: int = 16, decay: float = DECAY) -> AcceptanceProfile:
        """rates a x decay^(k-1) with tau(block) = tau (bisection on a; capped at 1 per position)."""
        if not 1.0 <= tau <= block:
            raise ValueError(f"tau {tau} impossible at block {block}")

        def rates(a: float) -> tuple[float, ...]:
            return tuple(min(1.0, a * decay**k) for k in range(block - 1))

        lo, hi = 0.0, 1.0 / decay ** (block - 2)  # at hi every position accepts: tau = block
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if tau_of(rates(mid), block) < tau else (lo, mid)
        return cls(name, rates((lo + hi) / 2))

    @classmethod
    def from_tau(cls, name: str, tau: float, block: int) -> AcceptanceProfile:
        """The constant per-position rate whose tau at `block` is `tau` (positions past the block keep it)."""
        p = cls.fit(name, tau, block, decay=1.0)
        return cls(name, p.rates + (p.rates[-1],) * max(0, 15 - len(p.rates)))

    @classmethod
    def from_rounds(cls, name: str, rounds: Sequence[tuple[int, int]], prior: float = 0.5) -> AcceptanceProfile:
        """Per-position rates counted from recorded rounds (block, accepted drafts): position k was tried in a
        round that drafted >= k tokens and accepted >= k-1 of them, passed when accepted >= k. One pseudo-trial
        at `prior` per position keeps unseen positions defined."""
        longest = max((b - 1 for b, _ in rounds), default=1)
        rates = []
        for k in range(1, longest + 1):
            tried = [acc for b, acc in rounds if b - 1 >= k and acc >= k - 1]
            rates.append((sum(acc >= k for acc in tried) + prior) / (len(tried) + 1))
        return cls(name, tuple(rates))


def paper_profiles(decay: float = DECAY, temperature: float = 0.0) -> dict[str, AcceptanceProfile]:
    """Per-benchmark profiles fitted to the paper's tau at T = 0 or T = 1 (the two it publishes)."""
    if temperature not in (0.0, 1.0):
        raise ValueError(f"the paper publishes tau at T = 0 and T = 1 only, not {temperature}")
    table = PAPER_T0_B16 if temperature == 0.0 else PAPER_T1_B16
    return {b: AcceptanceProfile.fit(b, tau, 16, decay) for b, tau in table.items()}


POOR = AcceptanceProfile.fit("poor", 2.0, 16)  # "mixed" workload: rows that accept poorly, tau ~2 at block 16
