"""Suffix drafting in the simulator: the matches a request's suffix structure finds, replayed from recorded rounds
of the real one.

A simulated request's tokens are `engines.truth(seed, position)`, pseudo-random: a real suffix automaton over them
would never find what a rewrite or a long generation repeats. What the proposers read of a suffix match
(`proposers.RowDrafts.match`) is whether there is one where the output stands and the run it offers; the target's
verification then decides how much of the run is right. Both are replayed from a recording of the suffix proposer
on the demo pair (data/measured/suffix-trace.json, written by `dflash-trt bench suffix-trace`):

  * a recorded request becomes a map over its output positions (`position_map`): a round that began at output
    position p, drafted d tokens and had a of them accepted says that at p + i (0 <= i <= a, i < d) a match
    offered d - i tokens of which the first a - i were right (the same earlier occurrence, read further on); a
    round without a run says there was no match at p;
  * a simulated request follows one recorded request of the chosen workload (its seed picks which), position by
    position, from the start again past its end;
  * `ReplayedMatches` stands where the row's suffix automaton stands (`RowDrafts.suffix`): its run is the simulated
    truth for the right tokens and wrong tokens after them, so the real `best_run` / `HybridProposer.pick` choose,
    the loop verifies, and the target, not the replay, decides what is accepted.

What a trace does not hold, and what stands in for it: the continuation a match had beyond the run the recording's
proposer chose to verify (a replayed run is at most that long: the simulated proposer may take less, never more),
and the match length behind the prior (`proposers.suffix_prior`): every replayed match carries the length whose
prior is the trace's pooled per-position acceptance, and the row's own suffix rounds correct it as on a server.
Out of sample (`SuffixTrace.prior_from`, `dflash-trt bench sim --suffix-prior-from`) that length comes from a trace
recorded on other prompts, so no prior is fitted on the rounds being replayed.
The shared structure of earlier requests' outputs is not replayed (the recording emptied it before each request).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..decoding import GenerationConfig, SamplingParams
from ..decoding.proposers import DEFAULT_PROPOSER, PRIOR_HALF, REGISTRY, proposer_for
from ..decoding.suffix import StepBudget, SuffixAutomaton, SuffixMatch
from .engines import SEED_TOKENS, prompt_seed, truth_many
from .measured import SUFFIX_TRACE, read

if TYPE_CHECKING:
    from ..decoding.loop import BatchDecoder
    from ..decoding.row import BatchRow

GREEDY = SamplingParams(temperature=0.0)
# the longest match length a replayed match claims: its prior then reaches MAX_PRIOR (proposers.py)
LONGEST_MATCH = 256


def position_map(rounds: Sequence[Sequence[int]]) -> tuple[tuple[int, int], ...]:
    """Per output position of a recorded request, (tokens a match offered, of which right); (0, 0): no match.
    `rounds`: its rounds in order after the prefill's token, [drafted, accepted] each (drafted 0: no run)."""
    out = [(0, 0)]  # position 0: the prefill's token, before any round
    for drafted, accepted in rounds:
        if drafted == 0:
            out.append((0, 0))
            continue
        out += [(drafted - i, accepted - i) if i < drafted else (0, 0) for i in range(accepted + 1)]
    return tuple(out)


def rounds_of(trace: Sequence[Mapping[str, Any]]) -> list[list[int]]:
    """A request's `--trace` rounds (`GenerationStats.trace`: `dflash-trt generate --json --trace`) as replayable
    rounds: a suffix round's (drafted by a proposer that keeps a suffix structure) [drafted, accepted]; any other
    round, one [0, 0] per token it committed (a hybrid's DFlash round does not say whether a suffix run was there:
    counted as none, so a hybrid's trace understates)."""
    out: list[list[int]] = []
    for r in trace:
        drafted, accepted = len(r["drafted"]), int(r["accepted"])
        by = REGISTRY.get(str(r.get("proposer")))
        out += [[drafted, accepted]] if by is not None and by.keeps_suffix else [[0, 0]] * (accepted + 1)
    return out


def pooled_alpha(requests: Sequence[Sequence[Sequence[int]]]) -> float:
    """The per-position acceptance of the recorded suffix runs: accepted drafts over the positions tried (each
    accepted one, and the rejected one where a run was not accepted whole); 0 without a run."""
    runs = [(d, a) for rounds in requests for d, a in rounds if d > 0]
    tried = sum(a + (a < d) for d, a in runs)
    return sum(a for _, a in runs) / tried if tried else 0.0


class SuffixTrace(NamedTuple):
    """One recorded workload: per request its position map; the match length every replayed match carries."""

    name: str
    positions: tuple[tuple[tuple[int, int], ...], ...]
    match_length: int
    rounds: tuple[tuple[tuple[int, int], ...], ...]  # as recorded, for comparing a simulated run with

    @classmethod
    def from_rounds(cls, name: str, requests: Sequence[Sequence[Sequence[int]]]) -> SuffixTrace:
        """A trace from per-request rounds ([drafted, accepted] each); the match length from the pooled acceptance
        alpha: suffix_prior = 1 - PRIOR_HALF / (PRIOR_HALF + length) = alpha for a match seen once."""
        if not requests or not all(requests):
            raise ValueError(f"trace {name!r}: every request needs at least one round")
        alpha = pooled_alpha(requests)
        length = LONGEST_MATCH if alpha >= 1 else round(PRIOR_HALF * alpha / (1 - alpha))
        rounds = tuple(tuple((int(d), int(a)) for d, a in r) for r in requests)
        if any(not 0 <= a <= d for r in rounds for d, a in r):
            raise ValueError(f"trace {name!r}: a round accepted more than it drafted")
        return cls(name, tuple(position_map(r) for r in rounds), max(1, min(LONGEST_MATCH, length)), rounds)

    @classmethod
    def load(cls, workload: str, path: Path = SUFFIX_TRACE) -> SuffixTrace:
        """The recorded workload `workload` of the trace file (data/measured/suffix-trace.json by default)."""
        recorded = read(path, "suffix-trace").get("workloads", {})
        if workload not in recorded:
            raise ValueError(f"{path} holds no trace of {workload!r}: it has {sorted(recorded)}")
        return cls.from_rounds(workload, [r["rounds"] for r in recorded[workload]["requests"]])

    @classmethod
    def resolve(cls, spec: str, path: Path = SUFFIX_TRACE) -> SuffixTrace:
        """`spec`: a workload of the recorded trace file, FILE:WORKLOAD (a workload of another file that
        `dflash-trt bench suffix-trace --out` wrote), or a file of `dflash-trt generate --json --trace` outputs (one
        JSON object a line, each a request: its "trace" replayed by `rounds_of`)."""
        given = Path(spec)
        other, _, workload = spec.rpartition(":")
        if not given.is_file() and other and Path(other).is_file():
            return cls.load(workload, Path(other))
        if not given.is_file():
            return cls.load(spec, path)
        lines = [json.loads(line) for line in given.read_text().splitlines() if line.strip()]
        if not lines or not all(isinstance(x, dict) and "trace" in x for x in lines):
            raise ValueError(f"{given}: expected `dflash-trt generate --json --trace` outputs, one a line")
        return cls.from_rounds(given.stem, [rounds_of(x["trace"]) for x in lines])

    def prior_from(self, other: SuffixTrace) -> SuffixTrace:
        """This trace's matches replayed with the match length (the prior) of `other`, recorded on other prompts:
        evaluated out of sample, no prior fitted on the rounds being replayed."""
        return self._replace(match_length=other.match_length)

    def suffix_acceptance(self) -> tuple[float, float]:
        """(the share of rounds that verified a suffix run, accepted over drafted suffix tokens) as recorded."""
        runs = [(d, a) for r in self.rounds for d, a in r if d > 0]
        every = sum(len(r) for r in self.rounds)
        return len(runs) / every, sum(a for _, a in runs) / max(1, sum(d for d, _ in runs))


class ReplayedMatches(SuffixAutomaton):
    """A row's suffix structure in the simulator: the recorded request's match at the row's output position, its
    run built from the simulated truth (right for the recorded accepted length, wrong after). Holds no tokens."""

    __slots__ = ("positions", "seed", "vocab", "match_length", "start", "next_index")

    def __init__(self, positions: tuple[tuple[int, int], ...], seed: int, vocab: int, prompt: int, match_length: int):
        super().__init__(max_tokens=0)
        self.positions, self.seed, self.vocab, self.match_length = positions, seed, vocab, match_length
        self.start = self.next_index = prompt  # the sequence index of the output's first token, of the next one

    def extend(self, token: int) -> None:
        self.next_index += 1

    def extend_all(self, tokens: list[int]) -> None:
        self.next_index += len(tokens)

    def match(self, most: int, budget: StepBudget | None = None) -> SuffixMatch | None:
        """The recorded match at the row's position (no tokens wait here: `budget` is not spent)."""
        offered, right = self.positions[(self.next_index - self.start) % len(self.positions)]
        run = min(offered, most)
        if run < 1:
            return None
        ids = truth_many([self.seed] * run, range(self.next_index, self.next_index + run), self.vocab)
        ids[right:] = (ids[right:] + 1) % self.vocab  # the recorded target rejected the first of these
        return SuffixMatch(self.match_length, 1, tuple(int(t) for t in ids))


class Proposing(NamedTuple):
    """How a simulated run's requests draft: the proposer they name and, for one that keeps a suffix structure
    (`Proposer.keeps_suffix`), the trace its suffix matches are replayed from."""

    proposer: str = DEFAULT_PROPOSER
    trace: SuffixTrace | None = None

    def check(self) -> None:
        if self.proposer not in REGISTRY:
            raise ValueError(f"proposer must be one of {tuple(REGISTRY)}, got {self.proposer!r}")
        if proposer_for(self.proposer).keeps_suffix and self.trace is None:
            raise ValueError(f"proposer {self.proposer!r} in the simulator needs a suffix trace to replay")

    def new_row(self, dec: BatchDecoder, prompt: list[int], max_new: int) -> BatchRow:
        """A greedy request's row on `dec`, its suffix structure (if its proposer keeps one) the trace's replay."""
        config = GenerationConfig(max_new_tokens=max_new, sampling=GREEDY, stop_token_ids=(), proposer=self.proposer)
        row = dec.new_row(prompt, config)
        if row.drafts.suffix is not None and self.trace is not None:
            seed = prompt_seed(prompt[:SEED_TOKENS])  # the simulated target's seed of this sequence (engines.py)
            maps = self.trace.positions
            vocab = int(dec.target.vocab_size)
            row.drafts.suffix = ReplayedMatches(
                maps[seed % len(maps)], seed, vocab, len(prompt), self.trace.match_length
            )
            row.drafts.shared = None
        return row


def recorded_workloads(path: Path = SUFFIX_TRACE) -> list[str]:
    """The workloads the trace file holds."""
    return sorted(json.loads(path.read_text()).get("workloads", {})) if path.exists() else []
