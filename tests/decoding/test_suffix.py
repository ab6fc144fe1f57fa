"""The suffix structures' bounds (decoding/suffix.py): a walk through the shared automaton stays exact while it
grows, the memory gauges count real bytes, a request past its bound keeps drafting from a window, a prompt's
automaton is built in the loop's thread a bounded part a step (of all rows' prompts together), and the shared automaton evicts by request without
rebuilding. (The time a step's suffix work takes is measured by `dflash-trt bench suffix-prior`, not here.)"""

import random
import tracemalloc

from dflash_trt.decoding import BatchDecoder, GenerationConfig
from dflash_trt.decoding import suffix as suffix_module
from dflash_trt.decoding.proposers import RowDrafts
from dflash_trt.decoding.sharing import TenantSuffixes
from dflash_trt.decoding.suffix import (
    ROUND_TOKENS,
    SETTLE_TOKENS,
    Automaton,
    SharedSuffixes,
    SharedWalk,
    StepBudget,
    SuffixAutomaton,
)
from dflash_trt.runtime.torch_backend import TorchTargetEngine


def _longest_in(text: list[int], outputs: list[list[int]], most: int) -> int:
    """Brute force: the longest suffix of `text` (at most `most` tokens) that occurs inside one of `outputs`."""
    best = 0
    for length in range(1, min(most, len(text)) + 1):
        tail = text[-length:]
        if any(o[i : i + length] == tail for o in outputs for i in range(len(o) - length + 1)):
            best = length
        else:
            break  # a longer suffix contains this one: it cannot occur either
    return best


def test_a_walk_keeps_the_longest_match_while_the_shared_automaton_grows():
    """Outputs join the shared automaton between a row's steps: a clone may split the state the walk stands in,
    and a longer suffix of the row may now occur. The walk's match length equals the brute-force longest match
    after every step."""
    rng = random.Random(5)
    wrong = 0
    for _ in range(60):
        shared = SharedSuffixes(max_tokens=100_000)
        walk, text, outputs = SharedWalk(shared), [], []
        walk.add([])
        for _ in range(40):
            if rng.random() < 0.4:
                out = [rng.randint(0, 3) for _ in range(rng.randint(1, 10))]
                shared.add(out)
                shared.settle()
                outputs.append(out)
            tokens = [rng.randint(0, 3) for _ in range(rng.randint(1, 3))]
            text += tokens
            walk.add(tokens)
            walk.match(4)  # in sync with the automaton now
            wrong += walk.length != _longest_in(text, outputs, suffix_module.SUFFIX_WALK_AGAIN)
    assert wrong == 0


def _traced(build):
    """What `build()` returns and the bytes it left allocated (tracemalloc)."""
    tracemalloc.start()
    try:
        made = build()
        size = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return made, size


def test_the_memory_gauges_count_real_bytes():
    """`nbytes` (what the server's dflash_suffix_bytes gauge sums) within 10 % of what tracemalloc measures, on
    prose-like text (many distinct tokens) and on text of few distinct tokens."""
    for vocab in (8, 5000):
        rng = random.Random(vocab)

        def build() -> Automaton:
            sam = Automaton()
            sam.extend_all([rng.randrange(vocab) for _ in range(20_000)])
            return sam

        sam, measured = _traced(build)
        assert abs(sam.nbytes - measured) <= 0.1 * measured, (vocab, sam.nbytes, measured)

        def build_shared() -> SharedSuffixes:
            shared = SharedSuffixes(max_tokens=30_000)
            for _ in range(40):
                shared.add([rng.randrange(vocab) for _ in range(500)])
            shared.settle(None)
            return shared

        shared, measured = _traced(build_shared)
        assert abs(shared.nbytes - measured) <= 0.1 * measured, (vocab, shared.nbytes, measured)


def _longest_repeat(tokens: list[int]) -> int:
    n = len(tokens)
    for length in range(n - 1, 0, -1):
        tail = tokens[n - length :]
        if any(tokens[e - length + 1 : e + 1] == tail for e in range(length - 1, n - 1)):
            return length
    return 0


def test_a_request_past_its_bound_keeps_drafting_from_a_window():
    """Past `max_tokens` a request's structure keeps the automaton of its recent tokens (at least half the bound):
    its match is the longest repeated suffix within them, never nothing, and its memory stays bounded."""
    rng = random.Random(7)
    bound = 60
    sam, text = SuffixAutomaton(max_tokens=bound), []
    for i in range(600):
        text.append(rng.randint(0, 5))
        sam.extend(text[-1])
        found = sam.match(4)
        window = list(sam.tokens)
        assert len(window) >= min(len(text), bound // 2) and window == text[-len(window) :]
        length = _longest_repeat(window)
        assert (found.length if found is not None else 0) == length, (i, found, length)
        assert sam.size <= 2 * (bound + bound // 2) + 2
    assert len(text) > 5 * bound


def test_a_prompt_is_taken_in_by_the_loop_a_bounded_part_a_step():
    """A row is made in the thread that received the request: its prompt only waits there. The loop's thread
    takes it in through the row's matches, SETTLE_TOKENS a step at most, and drafts from it once it is in."""
    drafts = RowDrafts(SuffixAutomaton())
    phrase = list(range(100, 140))
    prompt = [i % 7 for i in range(3 * SETTLE_TOKENS)] + phrase + [1, 2] + phrase[:10]
    drafts.add(prompt)
    assert drafts.suffix is not None and drafts.suffix.size == 1  # nothing built in the request's thread
    steps = 0
    while drafts.match(8) is None:
        steps += 1
        assert len(drafts.suffix.tokens) == min(len(prompt), steps * SETTLE_TOKENS)
    found = drafts.match(8)
    assert found is not None and found.continuation == tuple(phrase[10:18])
    assert steps == -(-len(prompt) // SETTLE_TOKENS) - 1


def test_many_rows_joining_take_in_a_bounded_part_a_step_in_all():
    """Rows joining together share one step's budget: a step takes in at most SETTLE_TOKENS of their prompts in all
    (not SETTLE_TOKENS each), first come first served, while a drafting row's last round (at most ROUND_TOKENS)
    enters whether or not the budget is spent; every row drafts once its prompt is in."""
    budget = StepBudget()
    phrase = list(range(100, 120))
    rows = []
    for k in range(16):
        drafts = RowDrafts(SuffixAutomaton(), budget=budget)
        drafts.add([k] * (2 * SETTLE_TOKENS) + phrase + [1] + phrase[:4])
        rows.append(drafts)
    drafting = RowDrafts(SuffixAutomaton(), budget=budget)
    drafting.add(phrase + [1] + phrase[:4])
    assert drafting.match(4) is not None  # in, before the others join
    waiting = sum(len(d.suffix.backlog) for d in rows if d.suffix is not None)
    steps = 0
    while any(d.suffix is not None and d.suffix.backlog for d in rows):
        budget.renew()
        before = sum(len(d.suffix.tokens) for d in rows if d.suffix is not None)
        was_ready = sum(d.suffix is not None and not d.suffix.backlog for d in rows)
        left = sum(len(d.suffix.backlog) for d in rows if d.suffix is not None)
        found = [d.match(4) for d in rows]
        taken = sum(len(d.suffix.tokens) for d in rows if d.suffix is not None) - before
        ready = [f is not None for f in found]
        assert ready == sorted(ready, reverse=True)  # first come, first served
        # the budget, and each prompt's last ROUND_TOKENS or fewer, which enter as a round's would
        assert taken <= SETTLE_TOKENS + ROUND_TOKENS * (sum(ready) - was_ready)
        assert taken >= min(SETTLE_TOKENS, left)  # the budget is spent, not left idle
        drafting.add(phrase[4 : 4 + ROUND_TOKENS // 2])  # its round's tokens: in at once, budget or not
        assert drafting.suffix is not None and drafting.match(4) is not None and not drafting.suffix.backlog
        steps += 1
    assert steps <= -(-waiting // SETTLE_TOKENS)
    assert all(d.match(4) is not None for d in rows)


def test_the_loop_gives_its_rows_one_budget_renewed_each_step(tiny_pair, monkeypatch):
    decoder = BatchDecoder(TorchTargetEngine(tiny_pair[3]))
    rows = [decoder.add([3, 4, 5] * 40, GenerationConfig(max_new_tokens=6, proposer="suffix")) for _ in range(3)]
    assert all(row.drafts.budget is decoder.suffix_budget for row in rows)
    renewed = []
    monkeypatch.setattr(StepBudget, "renew", lambda self: (renewed.append(self), setattr(self, "left", self.tokens)))
    steps = 0
    while not all(row.done for row in rows):
        decoder.step()
        steps += 1
    assert renewed == [decoder.suffix_budget] * steps


def test_the_shared_automaton_evicts_by_request_without_rebuilding(monkeypatch):
    """The shared automaton past its bound drops its oldest outputs whole by handing over to the automaton of the
    newest ones, built as they came: each output's token is extended at most twice, a step's `settle` extends
    at most SETTLE_TOKENS, and a walk made before the hand-over still matches after it."""
    extended = []
    real = Automaton.extend
    monkeypatch.setattr(Automaton, "extend", lambda self, t: (extended.append(t), real(self, t))[1])
    shared = SharedSuffixes(max_tokens=40)
    walk = SharedWalk(shared)
    added = 0
    for i in range(30):
        shared.add([100 + i, 1, 2, 3])
        added += 5  # with its separator
        before = len(extended)
        shared.settle()
        assert len(extended) - before <= SETTLE_TOKENS
        assert len(shared.sam.tokens) <= 40 and len(extended) <= 2 * added
    assert shared.generation > 0  # handed over at least once
    assert shared.outputs[0][0] > 100 and shared.outputs[-1][0] == 129  # the newest kept, the oldest gone
    walk.add([129, 1])
    found = walk.match(4)
    assert found is not None and found.length == 2 and found.continuation == (2, 3)
    big = SharedSuffixes(max_tokens=100_000)
    big.add(list(range(5000)))
    steps = 0
    while big._queue:
        before = len(extended)
        big.settle()
        steps += 1
        assert len(extended) - before <= SETTLE_TOKENS
    assert steps == -(-5001 // SETTLE_TOKENS)


def test_the_tenants_outputs_enter_a_bounded_part_a_step_in_all():
    """Finished outputs of many tenants wait together: one step's `settle` takes in at most SETTLE_TOKENS of them
    across all tenants (the step's suffix work does not grow with the tenants), every tenant's turn comes, and
    `nbytes` (the gauge) is the sum of the tenants' structures."""
    tenants = TenantSuffixes(max_tokens=100_000, max_tenants=8)
    structures = [tenants.of(f"t{k}") for k in range(8)]
    for k, shared in enumerate(structures):
        assert shared is not None
        shared.add(list(range(k * 1000, k * 1000 + SETTLE_TOKENS)))
    steps = 0
    while any(shared is not None and shared.waiting for shared in structures):
        assert tenants.settle() <= SETTLE_TOKENS
        steps += 1
    assert steps == 8 + 1  # 8 outputs of SETTLE_TOKENS tokens and a separator each: one step more than 8
    for k, shared in enumerate(structures):
        assert shared is not None
        walk = SharedWalk(shared)
        walk.add([k * 1000 + 5, k * 1000 + 6])
        found = walk.match(2)
        assert found is not None and found.continuation == (k * 1000 + 7, k * 1000 + 8)
    assert tenants.nbytes == sum(shared.nbytes for shared in structures if shared is not None)
    assert tenants.settle() == 0
