"""DFlash 2's two additions to the drafter (z-lab's `dflash` 0.1.0, `DFlash2DraftModel`), written here from
its architecture; parameter names are the reference checkpoints'.

Grouped dynamic causal convolution (`attention_conv`, `mlp_conv` in every layer): before the attention (and
before the MLP) the normed block hidden is convolved along the block, causally (position t sees t-K+1..t,
zeros before the block's start), with a kernel per channel that is a learned base (`base_kernel[0]`) plus a
dynamic part predicted from the hidden at t (`kernel_projection`, one value per channel group and tap). A
second kernel (`base_kernel[1]` and the other half of the projection, predicted from the same input) is then
applied the same way to the attention's (MLP's) output. Only the block's queries go through it: the context
K/V come from the target features as in DFlash 1, so the drafter's context cache is unchanged.

Candidate selector (`candidate_selector`): the drafter's logits give the top-k candidates of every block
position and their scores (unary); a path through them is chosen position by position, the score of candidate
j after predecessor token a being unary[j] + <pred(a) * h, succ(cand[j])>, where pred / succ are rank-r
codebooks over the vocabulary and h is a rank-r projection of the position's hidden. Position 0's predecessor
is the block's anchor (the last committed token). Greedy takes the best-scoring candidate at each position;
at T > 0 a candidate is drawn from softmax(scores / T) over the k candidates (temperature only, as the
reference), and those k probabilities are the proposal distribution rejection sampling judges
(decoding/acceptance.py).

Because each predecessor is either the anchor or one of the previous position's k candidates, every score a
path can need is known after the forward pass: `step_scores[p, i, j]`, the score of candidate j at position p
after candidate i at position p-1 (position 0: after the anchor, the same for every i). Engines compute them
with the forward (inside the ONNX / TensorRT graph: top-k, two gathers, one einsum) and return them with the
candidates; the walk through them (`greedy_path`, `acceptance.sample_path`) runs beside the graph, on at most
B-1 small rows, so greedy and sampled decoding share one graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _grouped_causal_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """x [b, n, H]; dynamic [b, n, K, G] (one value per tap and channel group); base [K, H].
    out[t] = sum_o (base[o] + dynamic[t, o]) * x[t - o], x before position 0 being zero."""
    b, n, hidden = x.shape
    taps, groups = dynamic.shape[-2], dynamic.shape[-1]
    per_channel = dynamic[..., None].expand(b, n, taps, groups, hidden // groups).reshape(b, n, taps, hidden)
    padded = F.pad(x, (0, 0, taps - 1, 0))
    out = torch.zeros_like(x)
    for o in range(taps):
        shifted = padded[:, taps - 1 - o : taps - 1 - o + n]  # x[t - o]
        out = out + base[o].to(x.dtype) * shifted
        out = out + per_channel[:, :, o] * shifted
    return out


class GroupedDynamicConv(nn.Module):
    """One pair of kernels (before / after a sublayer); see the module docstring."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.groups = kernel_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The input convolution, and the dynamic kernel `finish` applies to the sublayer's output."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return _grouped_causal_conv(x, dynamic[..., 0, :, :], self.base_kernel[0]), dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return _grouped_causal_conv(x, dynamic, self.base_kernel[1])


class CandidateSelector(nn.Module):
    """The codebooks and the hidden projection; `step_scores` turns a block's logits into the scores of every
    (predecessor, candidate) pair (module docstring)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def step_scores(
        self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [b, P, H] and logits [b, P, V] of the drafted positions, anchor [b] (block position 0's
        token). Returns candidates [b, P, k] (best first) and step_scores [b, P, k, k] float32: row i of
        position p holds the scores of position p's candidates after candidate i of position p-1 (position 0:
        after the anchor, every row)."""
        unary, candidates = torch.topk(logits.float(), self.top_k, dim=-1)
        h = self.hidden_projection(hidden).float()  # [b, P, r]
        first = self.predecessor_codebook(anchor).float()[:, None, None, :]  # [b, 1, 1, r]
        b, p, k = candidates.shape
        before = self.predecessor_codebook(candidates[:, :-1]).float()  # [b, P-1, k, r]
        predecessors = torch.cat([first.expand(b, 1, k, first.shape[-1]), before], dim=1)  # [b, P, k, r]
        successors = self.successor_codebook(candidates).float()  # [b, P, k, r]
        pair = torch.einsum("bpir,bpjr->bpij", predecessors * h[:, :, None, :], successors)
        return candidates, unary[:, :, None, :] + pair


def greedy_path(candidates: torch.Tensor, step_scores: torch.Tensor) -> torch.Tensor:
    """The greedy walk: at each position the best-scoring candidate after the one chosen before.
    candidates [..., P, k], step_scores [..., P, k, k] -> tokens [..., P]."""
    lead = candidates.shape[:-2]
    cand = candidates.reshape(-1, *candidates.shape[-2:])
    scores = step_scores.reshape(-1, *step_scores.shape[-3:])
    rows = torch.arange(cand.shape[0], device=cand.device)
    chosen = torch.zeros(cand.shape[0], dtype=torch.long, device=cand.device)
    path = []
    for p in range(cand.shape[1]):
        chosen = scores[rows, p, chosen].argmax(-1)
        path.append(cand[rows, p, chosen])
    if not path:
        return cand.new_zeros(*lead, 0)
    return torch.stack(path, dim=-1).reshape(*lead, cand.shape[1])
