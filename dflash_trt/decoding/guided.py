"""A row's grammar inside the loop (`GuidedRow`): its proposal walked through the grammar, the target's scores
masked position by position, and the matcher settled on what the round committed.

Lossless, as the acceptance rules' proofs ask (acceptance.py): the target's distribution at a block position is
its distribution under the grammar's mask after the committed tokens and the drafts before that position (the
matcher advanced through the draft; `constrain`), so a round emits what the target alone would emit under the
same masks. Each draft token x_i must be distributed, given the tokens before it, as the proposal q_i that judges
it; the walk (`propose`) keeps that true while it makes the draft follow the grammar:

    forced     where the grammar admits one string from here, its next token (llguidance's forced tokens) is
               drafted: a function of the tokens before it, so q_i is one-hot on it (drafting it where the drafter
               offered something else, or nothing, changes no later position's law: a DFlash draft's positions
               are drawn given the committed context alone)
    sampled    a drafter's x_i ~ q_i: q_i restricted to the tokens the grammar admits, renormalised (q'_i); x_i is
               kept where it is admitted (then it is distributed as q'_i) and drawn again from q'_i where not, so
               x_i ~ q'_i, which judges it. Where q_i gives the admitted tokens no mass the draft ends there
    one-hot    a draft chosen without sampling (greedy or exact-match drafts, suffix and n-gram runs): kept while
               admitted; the draft ends at the first token the grammar forbids (where it ends is a function of
               the tokens before it)

A draft that ends early is a shorter block, and rejection sampling holds for any number of drafts decided before
the target is read. Every committed token is admitted by the mask it was drawn under, so the matcher takes it.
"""

from __future__ import annotations

import torch

from .acceptance import Proposal
from .grammar import CompiledGrammar, GrammarMatcher
from .sampling import sample


def restrict(q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
    """A draft distribution `q` [vocab] restricted to the tokens `mask` admits, renormalised (None: no mass
    there)."""
    q = q * mask.to(q.device)
    total = q.sum()
    return q / total if total > 0 else None


class GuidedRow:
    """One row's grammar state: the matcher after the row's committed tokens, and during a round the masks of the
    block being verified (row i: what the grammar admits after the committed tokens and the first i drafts)."""

    def __init__(self, grammar: CompiledGrammar):
        self.matcher: GrammarMatcher = grammar.matcher()
        self.end_ids = grammar.end_ids
        self.walked = 0  # draft tokens the matcher has taken beyond the committed ones
        self.masks: torch.Tensor | None = None  # [k + 1, vocab] of the round's block (None: not walked yet)

    def propose(self, proposal: Proposal, most: int, forced: bool, generator: torch.Generator) -> Proposal:
        """The round's draft under the grammar (the module's rules): at most `most` tokens; the proposal's own
        tokens in their positions, the grammar's forced tokens (where `forced`) ahead of, between and after them."""
        allowed = [self.matcher.allowed()]
        tokens: list[int] = []
        rows: list[torch.Tensor | None] = []  # each draft's proposal distribution (None: one-hot on it)
        own = proposal.ids
        while len(tokens) < most:
            j, mask = len(tokens), allowed[-1]
            run = self.matcher.forced() if forced else []
            q: torch.Tensor | None = None
            if run:
                token = run[0]
            elif j < len(own):
                token = own[j]
                if proposal.probs is not None:
                    q = restrict(proposal.probs[j], mask)
                    if q is None:
                        break
                    if not mask[token]:
                        token = int(sample(q, generator))
                elif not mask[token]:
                    break
            else:
                break
            if not self.matcher.accept(token):
                break  # cannot happen for an admitted token; the draft ends rather than the row failing
            tokens.append(token)
            rows.append(q)
            allowed.append(self.matcher.allowed())
        self.walked, self.masks = len(tokens), torch.stack(allowed)
        ids = torch.tensor(tokens, dtype=torch.long)
        if proposal.probs is None or not tokens:
            return Proposal(ids)
        probs = torch.zeros(len(tokens), proposal.probs.shape[-1], device=proposal.probs.device)
        for i, (token, q) in enumerate(zip(tokens, rows)):
            if q is None:
                probs[i, token] = 1.0
            else:
                probs[i] = q
        return Proposal(ids, probs)

    def constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's logits [R, vocab] of the block (row i after the committed tokens and i drafts) with what the
        grammar forbids at each position at -inf (a copy)."""
        if self.masks is None:  # the prompt's last position: the grammar's first token
            self.masks = self.matcher.allowed().unsqueeze(0)
        masks = self.masks[: logits.shape[0]].to(logits.device)
        return logits.masked_fill(~masks, float("-inf"))

    def settle(self, accepted: int, new: list[int]) -> None:
        """The round committed `accepted` of the walked drafts and then `new[-1]` (the bonus, or a prefill's first
        token): the matcher goes back over the rejected drafts and takes it."""
        self.matcher.rollback(self.walked - accepted)
        self.matcher.accept(new[-1])
        self.walked, self.masks = 0, None
