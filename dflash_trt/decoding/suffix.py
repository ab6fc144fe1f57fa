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
  seen     how often the state was the match and the next token then came (a prediction resolved);
  agreed   how often that next token was the one the run read after the earlier occurrence predicted.
`seen` and `agreed` are the counts a continuation probability is made of (`proposers.continuation_probs`), as
SuffixDecoding's tree makes one from its nodes' counts: a short context seen often with many different
continuations has a low `agreed / seen`, however often it recurred.

Memory: at most 2n states and 3n transitions for n tokens, in flat arrays and a transition dict per state
(`Automaton.nbytes` counts them in real bytes). A request's structure (`SuffixAutomaton`) is a window past its
bound: it keeps the automaton of its last `max_tokens` tokens at most, a second one starting halfway so that it
hands over without a rebuild. Work: a request's tokens wait in a backlog until the loop's thread asks for a match,
and at most `SETTLE_TOKENS` of all rows' waiting prompts enter a step (`StepBudget`: a long prompt's automaton, or
the automata of many requests joining at once, are built over several steps, in the loop's thread, not in the
thread that received the request); a drafting row's last round enters whole.
"""

from __future__ import annotations

import sys
from array import array
from typing import NamedTuple

# A request's automaton covers at most its last this many tokens: the longest context served here fits, and a
# client's runaway request cannot take more memory than that (the window then slides: `SuffixAutomaton`).
MAX_TOKENS = 65536
# Waiting tokens taken in per step of the loop's thread, by all rows' automata together (`StepBudget`) and by the
# shared structure: bounds the suffix work a step does, whatever the number of rows (a long prompt is taken in
# over several steps).
SETTLE_TOKENS = 256
# A backlog this short, of a row whose prompt is in, enters whole outside the step's budget: a row's tokens
# committed since its last step (a round's: at most a block or a run of SUFFIX_MAX_RUN drafts, and the bonus token)
# never wait.
ROUND_TOKENS = 32
_INT_BYTES = sys.getsizeof(1 << 20)  # an int object past the small cached ones (a state id, a token id)


class SuffixMatch(NamedTuple):
    """The longest suffix of the text so far that occurred earlier, and what followed it there."""

    length: int  # tokens of the matched suffix
    hits: int  # times this context has recurred so far (1: the first repeat)
    continuation: tuple[int, ...]  # the tokens that followed its earlier occurrence (at most the asked length)
    # per continuation token, (seen, agreed) of its context: the match, then the match extended by the run's
    # tokens before it (fewer entries than tokens: the rest have no counts, only their context's length)
    counts: tuple[tuple[int, int], ...] = ()


def _counts_along(sam: Automaton, state: int, run: list[int]) -> tuple[tuple[int, int], ...]:
    """(seen, agreed) of the contexts along `run` from `state`: the state, then the state its context extended by
    each run token reaches (until the run leaves what the automaton holds)."""
    out = []
    for t in run:
        out.append((sam.seen[state], sam.agreed[state]))
        state = sam.next[state].get(t, -1)
        if state < 0:
            break
    return tuple(out)


class Automaton:
    """The suffix automaton of a token sequence, extended one token at a time (`extend`), unbounded."""

    __slots__ = (
        "tokens",
        "next",
        "link",
        "length",
        "end",
        "seen",
        "agreed",
        "last",
        "_state_of_match",
        "_after",
        "_measured",
    )

    def __init__(self) -> None:
        self.tokens = array("q")
        self.next: list[dict[int, int]] = [{}]  # per state: token -> state
        self.link, self.length, self.end = array("q", [-1]), array("q", [0]), array("q", [-1])
        self.seen, self.agreed = array("q", [0]), array("q", [0])
        self.last = 0
        self._state_of_match, self._after = 0, -1  # the match state and where its earlier occurrence ended
        self._measured = (0, 0)  # (states, bytes) of the transition dicts when last measured

    @property
    def size(self) -> int:
        """States held."""
        return len(self.link)

    @property
    def nbytes(self) -> int:
        """Bytes held, in real bytes: the arrays' buffers, the list of transition dicts and their tables, and the
        int objects they hold (a state id per state, a token id per token taken in, at most). The dicts are
        measured whole once the states grew by an eighth since the last measure (amortised O(1) a state), and
        scaled by the states in between."""
        arrays = (self.tokens, self.link, self.length, self.end, self.seen, self.agreed)
        objects = _INT_BYTES * (len(self.link) + len(self.tokens))
        states, dicts = self._measured
        if len(self.next) > states + states // 8:
            states, dicts = len(self.next), sum(map(sys.getsizeof, self.next))
            self._measured = (states, dicts)
        dicts = dicts * len(self.next) // states
        return sum(sys.getsizeof(a) for a in arrays) + sys.getsizeof(self.next) + dicts + objects

    def extend_all(self, tokens: list[int]) -> None:
        for t in tokens:
            self.extend(t)

    def extend(self, token: int) -> None:
        """Append one token: the last match's prediction is resolved (`seen`, `agreed`); then the standard
        online construction (a new state for the whole text; a clone where an existing state's strings split);
        then the match state records this occurrence (`_matched`)."""
        s, pos = self._state_of_match, len(self.tokens)
        if s > 0 and self._after >= 0:
            self.seen[s] += 1
            self.agreed[s] += self.tokens[self._after + 1] == token
        self.tokens.append(token)
        nxt, link, length = self.next, self.link, self.length
        cur = self._state(length[self.last] + 1, pos, {})
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p == -1:
            link[cur] = 0
        else:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = self._state(length[p] + 1, self.end[q], dict(nxt[q]), self.seen[q], self.agreed[q])
                link[clone] = link[q]
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur
        self._matched(pos)

    def _state(self, length: int, end: int, nxt: dict[int, int], seen: int = 0, agreed: int = 0) -> int:
        self.next.append(nxt)
        self.link.append(-1)
        self.length.append(length)
        self.end.append(end)
        self.seen.append(seen)
        self.agreed.append(agreed)
        return len(self.link) - 1

    def _matched(self, pos: int) -> None:
        """The longest repeated suffix (the whole text's suffix link) now also ends at `pos`: its recorded end
        (an earlier occurrence, < pos) is where `match` reads the run, and `pos` becomes its recorded end. Every
        end a state records is an end of all its strings (a state's end positions only grow), so a clone may
        start from its original's."""
        s = self.link[self.last]
        self._state_of_match, self._after = s, -1
        if s > 0:
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
        if s <= 0 or self._after < 0 or most < 1:
            return None
        start = self._after + 1
        run = list(self.tokens[start : start + most])
        distance = len(run)
        for j in range(distance, most if distance else 0):
            run.append(run[j - distance])
        if not run:
            return None
        return SuffixMatch(self.length[s], self.seen[s] + 1, tuple(run), _counts_along(self, s, run))


class StepBudget:
    """The waiting tokens the rows' automata may take in during one step, together: SETTLE_TOKENS, first come
    first served in the order the loop asks its rows. A row whose prompt is in takes in a backlog of at most
    ROUND_TOKENS (its last round) outside it, so a step takes in at most SETTLE_TOKENS + ROUND_TOKENS a drafting row
    (and the shared structure its own SETTLE_TOKENS). Without it, 64 rows joining at once would each take in
    SETTLE_TOKENS of their prompts in one step. One per loop, in the loop's thread; `renew` at each step's start."""

    __slots__ = ("tokens", "left")

    def __init__(self, tokens: int = SETTLE_TOKENS):
        self.tokens = self.left = tokens

    def renew(self) -> None:
        self.left = self.tokens

    def grant(self, waiting: int, started: bool) -> int:
        """How many of a backlog of `waiting` tokens may enter now (spending the step's budget); `started`: the
        row's prompt is in (its backlog is its rounds' tokens)."""
        if started and waiting <= ROUND_TOKENS:
            return waiting
        n = min(waiting, self.left)
        self.left -= n
        return n


class SuffixAutomaton:
    """A request's suffix structure: the automaton of its last `max_tokens` tokens at most (a window), taken in
    through a backlog.

    The window: tokens enter the current automaton; once it holds half the bound they also enter a second one, and
    when the current one is full the second (the last half-bound of tokens) takes its place. Each token is
    extended at most twice, nothing is rebuilt, and a request past the bound keeps drafting from its recent text.
    The backlog: `extend` / `extend_all` only record (any thread: a row is made where its request arrived);
    `match`, in the loop's thread, first takes in up to SETTLE_TOKENS of them, and proposes nothing while some
    still wait (the automaton's text must end where the request's does)."""

    __slots__ = ("max_tokens", "current", "spare", "backlog")

    def __init__(self, max_tokens: int = MAX_TOKENS):
        self.max_tokens = max_tokens
        self.current = Automaton()
        self.spare: Automaton | None = None  # the next window's automaton, once the current one is half full
        self.backlog: list[int] = []

    @property
    def tokens(self) -> array[int]:
        """The window's tokens (those taken in)."""
        return self.current.tokens

    @property
    def size(self) -> int:
        """States held (both automata)."""
        return self.current.size + (self.spare.size if self.spare is not None else 0)

    @property
    def nbytes(self) -> int:
        """Bytes held, in real bytes (both automata and the backlog)."""
        spare = self.spare.nbytes if self.spare is not None else 0
        return self.current.nbytes + spare + sys.getsizeof(self.backlog)

    def extend(self, token: int) -> None:
        self.backlog.append(token)

    def extend_all(self, tokens: list[int]) -> None:
        self.backlog += tokens

    def settle(self, budget: int | None = SETTLE_TOKENS) -> bool:
        """Take in up to `budget` waiting tokens (None: all); whether none waits now."""
        if self.max_tokens < 1:
            self.backlog.clear()
            return True
        todo = self.backlog if budget is None else self.backlog[:budget]
        half = max(1, self.max_tokens // 2)
        for t in todo:
            if self.spare is None and len(self.current.tokens) >= self.max_tokens - half:
                self.spare = Automaton()  # it holds the last half-bound of tokens when the current one is full
            self.current.extend(t)
            if self.spare is not None:
                self.spare.extend(t)
            if len(self.current.tokens) >= self.max_tokens:
                self.current, self.spare = self.spare or Automaton(), None
        del self.backlog[: len(todo)]
        return not self.backlog

    def match(self, most: int, budget: StepBudget | None = None) -> SuffixMatch | None:
        """The window's longest repeated suffix and its run (`Automaton.match`); None while tokens still wait. It
        first takes in what the step's `budget` grants (None: up to SETTLE_TOKENS)."""
        started = len(self.current.tokens) > 0
        if not self.settle(SETTLE_TOKENS if budget is None else budget.grant(len(self.backlog), started)):
            return None
        return self.current.match(most)


# The shared automaton's default bound, in tokens.
SHARED_TOKENS = 65536


class SharedSuffixes:
    """Automata over the outputs of a worker's finished requests, for the requests that follow (an agent's next
    turn, a client that asks again): a request's own automaton cannot propose what it has not seen.

    Each output is followed by a separator no other holds (a negative id), so no match spans two outputs. Bounded,
    and evicted by request, never rebuilt: outputs enter the current automaton (`sam`) and, once it holds half
    the bound, a second one too; an output that would take the current one past the bound makes the second one
    current (it holds the newest outputs, about half the bound) and starts none: the oldest outputs go with the
    old one. An output is extended at most twice. `add` only queues an output; `settle`, once a step in the loop's
    thread, takes in up to SETTLE_TOKENS queued tokens, so a long output finishing costs no step more than that.
    A row reads it through its own `SharedWalk`. One thread: the loop's."""

    def __init__(self, max_tokens: int = SHARED_TOKENS):
        if max_tokens < 2:
            raise ValueError(f"the shared suffix structure needs at least 2 tokens, got {max_tokens}")
        self.max_tokens = max_tokens
        self.outputs: list[list[int]] = []  # the outputs the current automaton holds, oldest first
        self.sam = Automaton()
        self.generation = 0  # hand-overs so far: a walk made before the last one starts again
        self.version = 0  # changes whenever the current automaton does: a walk behind it walks again
        self._spare: Automaton | None = None
        self._spare_outputs: list[list[int]] = []
        self._queue: list[list[int]] = []  # outputs added, not yet (wholly) taken in
        self._taken = 0  # tokens of the queue's first output taken in (its separator is its last)
        self._into: list[Automaton] = []  # the automata the first queued output goes into
        self._separators = 0

    @property
    def size(self) -> int:
        return self.sam.size + (self._spare.size if self._spare is not None else 0)

    @property
    def nbytes(self) -> int:
        """Bytes held, in real bytes (both automata; the outputs' lists share their tokens' int objects)."""
        spare = self._spare.nbytes if self._spare is not None else 0
        kept = sum(sys.getsizeof(o) for o in self.outputs) + sum(sys.getsizeof(o) for o in self._spare_outputs)
        return self.sam.nbytes + spare + kept

    def add(self, output: list[int]) -> None:
        """A finished request's output (at most half the bound of it, its end: what a next turn most resembles),
        queued for `settle`."""
        output = list(output[-(self.max_tokens // 2) :])
        if output:
            self._queue.append(output)

    def settle(self, budget: int | None = SETTLE_TOKENS) -> int:
        """Take in up to `budget` queued tokens (None: all), in the loop's thread; how many it took in."""
        done = 0
        while self._queue and (budget is None or done < budget):
            output = self._queue[0]
            if self._taken == 0:
                self._start(output)
            todo = len(output) + 1 - self._taken
            n = todo if budget is None else min(todo, budget - done)
            for i in range(self._taken, self._taken + n):
                t = output[i] if i < len(output) else -self._separators
                for sam in self._into:
                    sam.extend(t)
            self._taken += n
            done += n
            self.version += 1
            if self._taken == len(output) + 1:
                self._queue.pop(0)
                self._taken = 0
                if self._spare is None and len(self.sam.tokens) >= self.max_tokens // 2:
                    self._spare = Automaton()
        return done

    @property
    def waiting(self) -> bool:
        """Whether outputs wait to be taken in (`settle`)."""
        return bool(self._queue)

    def _start(self, output: list[int]) -> None:
        """Where the next output goes: a hand-over first if it would not fit in the current automaton."""
        if len(self.sam.tokens) + len(output) + 1 > self.max_tokens:
            self.sam, self.outputs = self._spare or Automaton(), self._spare_outputs
            self._spare, self._spare_outputs = None, []
            self.generation += 1
        self._separators += 1
        self.outputs.append(output)
        self._into = [self.sam]
        if self._spare is not None:
            self._spare_outputs.append(output)
            self._into.append(self._spare)


class SharedWalk:
    """Where one request's text stands in the shared automaton: the state of the longest suffix of the request
    that occurs in it (matching statistics: each token costs amortised O(1), following suffix links on a miss).

    The automaton changes under a walk (outputs taken in, a hand-over): a state the walk stood in may have been
    split by a clone, and a longer suffix of the request may now occur. So a walk is only trusted against the
    version it walked: behind it, `match` walks the request's last SUFFIX_WALK_AGAIN tokens again. Made unsynced
    (a row is made in any thread): `add` only records the request's last tokens until the walk is in sync."""

    __slots__ = ("shared", "state", "length", "version", "recent")

    def __init__(self, shared: SharedSuffixes):
        self.shared = shared
        self.state, self.length, self.version = 0, 0, -1
        self.recent: list[int] = []  # the request's last tokens, to walk again

    def add(self, tokens: list[int]) -> None:
        self.recent = (self.recent + tokens)[-SUFFIX_WALK_AGAIN:]
        if self.version == self.shared.version:
            self._walk(tokens)

    def _walk(self, tokens: list[int]) -> None:
        sam = self.shared.sam
        nxt, link, length = sam.next, sam.link, sam.length
        state, matched = self.state, self.length
        for t in tokens:
            while state and t not in nxt[state]:
                state = link[state]
                matched = length[state]
            to = nxt[state].get(t, -1)
            state, matched = (to, matched + 1) if to >= 0 else (0, 0)
        self.state, self.length = state, matched

    def match(self, most: int) -> SuffixMatch | None:
        """The longest suffix of the request found in the shared outputs and up to `most` tokens that followed
        it there (up to the end of that output)."""
        if self.version != self.shared.version:  # new, or the automaton changed since: walk the last tokens again
            self.state, self.length, self.version = 0, 0, self.shared.version
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
        if not run:
            return None
        return SuffixMatch(self.length, sam.seen[self.state] + 1, tuple(run), _counts_along(sam, self.state, run))


# a walk behind the shared automaton walks again from this many of the request's last tokens (a longer match is
# rare; it then reads as this long)
SUFFIX_WALK_AGAIN = 64
