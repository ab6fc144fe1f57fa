"""Suffix drafting's structure: an online suffix automaton over one request's tokens (prompt, then output).

Where text repeats (an agent re-reading a file, a rewrite of code the prompt holds, a long generation revisiting
its own lines) the longest suffix of the request so far that occurred before predicts what follows: the tokens
that followed it then. SuffixDecoding (Oliaro et al., arXiv 2411.04975) finds that match in a suffix tree;
TensorRT-LLM's suffix-automaton enhancer of MTP / EAGLE-3 drafts in a suffix automaton. This module keeps a
suffix automaton (Blumer et al. 1985): a token appended costs amortised O(1) (at most two states and a bounded
number of transitions each), and the longest earlier-occurring suffix is the suffix link of the state of the
whole text, known right after each append: no search.

Per state it keeps, besides the automaton's own fields:
  end      an end position of an occurrence of the state's strings other than the newest one: the first one when
           the state was made, then the previous occurrence each time the state is matched, so a run is read after
           the most recent earlier occurrence (what repeats in an agent's loop or a rewrite is the latest version);
  hits     how often the state was the match (its context recurred): the frequency statistic a proposal carries.

Memory is bounded: at most 2n states and 3n transitions for n tokens, and an automaton stops growing at
`max_tokens` (its matches then cover the first `max_tokens` tokens only). `SuffixAutomaton.size` says what it
holds; the loop reports it per request and in all (`GenerationStats.suffix_states`, the server's metrics).
"""

from __future__ import annotations

from typing import NamedTuple

# A request's automaton stops growing past this many tokens: prompt + output of the longest context served here
# fits (the CPU demo targets' context), and a client's runaway request cannot take more memory than that.
MAX_TOKENS = 65536
# Rough bytes per state of the Python structure (its list entries and transition dict), for the metrics: a
# measure of scale, not an accounting of the allocator.
BYTES_PER_STATE = 200


class SuffixMatch(NamedTuple):
    """The longest suffix of the text so far that occurred earlier, and what followed it there."""

    length: int  # tokens of the matched suffix
    hits: int  # times this context has recurred in the request so far (1: the first repeat)
    continuation: tuple[int, ...]  # the tokens that followed its earlier occurrence (at most the asked length)


class SuffixAutomaton:
    """The suffix automaton of a token sequence, extended one token at a time (`extend`)."""

    __slots__ = ("tokens", "next", "link", "length", "end", "hits", "last", "max_tokens", "_state_of_match", "_after")

    def __init__(self, max_tokens: int = MAX_TOKENS):
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]
        self.link, self.length, self.end, self.hits = [-1], [0], [-1], [0]
        self.last = 0
        self.max_tokens = max_tokens
        self._state_of_match, self._after = 0, -1  # the match state and where its earlier occurrence ended

    @property
    def size(self) -> int:
        """States held (the memory measure)."""
        return len(self.link)

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.max_tokens

    def extend_all(self, tokens: list[int]) -> None:
        for t in tokens:
            self.extend(t)

    def extend(self, token: int) -> None:
        """Append one token: the standard online construction (a new state for the whole text; a clone where an
        existing state's strings split); then the match state records this occurrence (`_matched`)."""
        if self.full:
            return
        pos = len(self.tokens)
        self.tokens.append(token)
        cur = self._state(self.length[self.last] + 1, pos, {})
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p == -1:
            self.link[cur] = 0
        else:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = self._state(self.length[p] + 1, self.end[q], dict(self.next[q]), self.hits[q])
                self.link[clone] = self.link[q]
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur
        self._matched(pos)

    def _state(self, length: int, end: int, nxt: dict[int, int], hits: int = 0) -> int:
        self.next.append(nxt)
        self.link.append(-1)
        self.length.append(length)
        self.end.append(end)
        self.hits.append(hits)
        return len(self.link) - 1

    def _matched(self, pos: int) -> None:
        """The longest repeated suffix (the whole text's suffix link) now also ends at `pos`: its recorded end
        (an earlier occurrence, < pos) is where `match` reads the run, and `pos` becomes its recorded end. Every
        end a state records is an end of all its strings (a state's end positions only grow), so a clone may
        start from its original's."""
        s = self.link[self.last]
        self._state_of_match, self._after = s, -1
        if s > 0:
            self.hits[s] += 1
            self._after, self.end[s] = self.end[s], pos

    def match(self, most: int) -> SuffixMatch | None:
        """The longest suffix of the text that occurred before, with up to `most` tokens that followed it there
        (None: no suffix of one token or more repeats, or nothing follows).

        Where that earlier occurrence ends d tokens before the text does, only d tokens follow it, and the run
        goes on as an overlapping copy (LZ77's): token j of the run is token j - d of the run. The match says
        the text from the occurrence on repeats, and the run's own first tokens are part of that text: in a
        loop of period d (a generation cycling through its own lines) the run is the loop continued, where a
        run cut at the text's end would offer d - 1 tokens a round however long the loop held."""
        s = self._state_of_match
        if s <= 0 or self._after < 0 or most < 1 or self.full:
            return None
        start = self._after + 1
        run = self.tokens[start : start + most]
        distance = len(run)
        for j in range(distance, most if distance else 0):
            run.append(run[j - distance])
        return SuffixMatch(self.length[s], self.hits[s], tuple(run)) if run else None


# The shared automaton's default bound, in tokens: about 2 states per token at `BYTES_PER_STATE`, some 25 MB.
SHARED_TOKENS = 65536


class SharedSuffixes:
    """One automaton over the outputs of a worker's finished requests, for the requests that follow (an agent's
    next turn, a client that asks again): a request's own automaton cannot propose what it has not seen.

    Each output is followed by a separator no other holds (a negative id), so no match spans two outputs. Bounded:
    an output that would take it past `max_tokens` first rebuilds it from the newest outputs that fill half of it
    (the oldest are evicted; the rebuild costs what it keeps, so each token is paid for a bounded number of
    times). A row reads it through its own `SharedWalk`, which a rebuild resets. One thread: the loop's."""

    def __init__(self, max_tokens: int = SHARED_TOKENS):
        if max_tokens < 2:
            raise ValueError(f"the shared suffix structure needs at least 2 tokens, got {max_tokens}")
        self.max_tokens = max_tokens
        self.outputs: list[list[int]] = []
        self.generation = 0  # rebuilds so far: a walk made before the last one starts again
        self.sam = SuffixAutomaton(max_tokens + 1)
        self._separators = 0

    @property
    def size(self) -> int:
        return self.sam.size

    def add(self, output: list[int]) -> None:
        """A finished request's output (at most half the bound of it, its end: what a next turn most resembles)."""
        output = output[-(self.max_tokens // 2) :]
        if not output:
            return
        if len(self.sam.tokens) + len(output) + 1 > self.max_tokens:
            self._rebuild(self.max_tokens // 2 - len(output) - 1)
        self._append(output)
        self.outputs.append(output)

    def _append(self, output: list[int]) -> None:
        self._separators += 1
        self.sam.extend_all(output)
        self.sam.extend(-self._separators)

    def _rebuild(self, room: int) -> None:
        kept: list[list[int]] = []
        for out in reversed(self.outputs):
            room -= len(out) + 1
            if room < 0:
                break
            kept.append(out)
        self.outputs, self.sam, self.generation = kept[::-1], SuffixAutomaton(self.max_tokens + 1), self.generation + 1
        for out in self.outputs:
            self._append(out)


class SharedWalk:
    """Where one request's text stands in the shared automaton: the state of the longest suffix of the request
    that occurs in it (matching statistics: each token costs amortised O(1), following suffix links on a miss).

    Made unsynced (a row is made in any thread, the shared automaton changes in the loop's): `add` only records
    the request's last tokens until `match`, in the loop's thread, walks them; a rebuild unsyncs every walk."""

    __slots__ = ("shared", "state", "length", "generation", "recent")

    def __init__(self, shared: SharedSuffixes):
        self.shared = shared
        self.state, self.length, self.generation = 0, 0, -1
        self.recent: list[int] = []  # the request's last tokens, to walk again after a rebuild

    def add(self, tokens: list[int]) -> None:
        self.recent = (self.recent + tokens)[-SUFFIX_WALK_AGAIN:]
        if self.generation == self.shared.generation:
            self._walk(tokens)

    def _walk(self, tokens: list[int]) -> None:
        sam = self.shared.sam
        for t in tokens:
            while self.state and t not in sam.next[self.state]:
                self.state = sam.link[self.state]
                self.length = sam.length[self.state]
            if t in sam.next[self.state]:
                self.state, self.length = sam.next[self.state][t], self.length + 1
            else:
                self.state, self.length = 0, 0

    def match(self, most: int) -> SuffixMatch | None:
        """The longest suffix of the request found in the shared outputs and up to `most` tokens that followed
        it there (up to the end of that output)."""
        if self.generation != self.shared.generation:  # new, or rebuilt since: walk the last tokens again
            self.state, self.length, self.generation = 0, 0, self.shared.generation
            self._walk(self.recent)
        if self.state <= 0 or most < 1:
            return None
        sam = self.shared.sam
        start = sam.end[self.state] + 1
        run = []
        for t in sam.tokens[start : start + most]:
            if t < 0:  # the output ended there
                break
            run.append(t)
        return SuffixMatch(self.length, sam.hits[self.state] + 1, tuple(run)) if run else None


# after a rebuild a walk starts again from this many of the request's last tokens (a longer match is rare)
SUFFIX_WALK_AGAIN = 64
