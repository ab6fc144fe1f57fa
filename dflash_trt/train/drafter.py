"""DFlash drafter training, following the paper's recipe (the authors did not publish code).

- frozen: the target, its embedding table and lm_head; trained: drafter layers, fc, norms;
- per sequence, random anchor positions in the RESPONSE (the prompt is context only, as SpecForge's
  loss mask); each anchor a gives a block [x_a, MASK x (B-1)] at positions a..a+B-1 predicting
  x_{a+1}..x_{a+B-1} (labels past the sequence end are masked), with context = target features of 0..a-1;
- all blocks of a sequence go through one forward pass, block-sparse: each block sees its own context
  prefix (one visibility row per block) and its own block, one softmax over both, exactly as a round
  attends at inference (`DFlashDrafter.forward_packed`; no dense [m*B, S + m*B] mask);
- loss: cross-entropy through the frozen lm_head, chunked (no [rows, vocab] fp32 logits kept), weighted by
  block position w_k = exp(-(k-1)/gamma), optionally mixed with a KL term to the target's distribution,
  whose teacher logits are computed only at the positions used (from the target's cached final hidden);
- the target's features (and final hidden, for distillation) are computed ONCE into a disk-backed fp16
  cache, the target run only up to its deepest feature layer when no teacher is needed;
- AdamW, cosine schedule with warm-up, gradient clipping (the step loop shared with `lm.py`); resumable
  checkpoints in the published drafter format.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from ..config import build_target_layer_ids
from ..models.drafter import DFlashDrafter
from .common import autocast, load_state, make_optimizer, run_steps, save_state
from .data import corpus_prompts, regen_prompts_file
from .regen import SequenceSet

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ..models.target import CausalLM

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the paper's choices per block size
STATE_FILE = "trainer_state.pt"
# The `type: ignore[no-untyped-call]`s below: transformers leaves get_decoder, get_output_embeddings and a
# PreTrainedModel's eval unannotated.


def default_gamma(block_size: int) -> float:
    return DEFAULT_GAMMA.get(block_size, max(1.0, block_size / 2))


@dataclass
class DrafterTrainConfig:
    block_size: int = 8
    num_layers: int = 2
    target_layer_ids: tuple[int, ...] | None = None  # default: the reference rule
    mask_token_id: int | None = None  # default: the tokenizer's mask token
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256  # longest sequence trained on (longer ones are cut); fixed-length data: window length
    anchors_per_seq: int = 32
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    clip: float = 1.0
    gamma: float | None = None  # default: DEFAULT_GAMMA
    kd_weight: float = 0.0  # 0 = plain cross-entropy; 1 = distillation only
    kd_temperature: float = 1.0
    init_from_target: bool = True  # start drafter layers from target layers (same shapes)
    # drafter final norm = this x the target's final norm (with init_from_target): a small scale tempers the
    # first steps' overconfident logits (the losses per scale that chose 0.1: docs/benchmarks.md).
    init_norm_scale: float = 0.1
    loss_chunk_rows: int = 1024  # rows per chunk of the lm_head + loss (memory: chunk x vocab fp32)
    save_every: int = 200
    time_budget_s: float | None = None
    bf16: bool = True
    seed: int = 0


# ---------------------------------------------------------------------------------------
# Blocks, mask, weights: the pieces the tests check
# ---------------------------------------------------------------------------------------
def sample_anchors(
    seq_len: int, block_size: int, count: int, generator: torch.Generator, start: int = 1
) -> torch.Tensor:
    """Distinct sorted anchors in [start, seq_len - 2]: each has context before it and at least one
    label after it (labels past the end are masked, so the last tokens, EOS included, are trained too)."""
    start = max(1, start)
    candidates = max(0, seq_len - 1 - start)
    count = min(count, candidates)
    return torch.randperm(candidates, generator=generator)[:count].sort().values + start


def block_sparse_mask(anchors: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    """[m*B, S + m*B] boolean: block j's queries see context keys < a_j and the keys of block j only.
    The dense reference the tests compare `forward_packed` with; training never builds it."""
    m = anchors.shape[0]
    q_block = torch.arange(m).repeat_interleave(block_size)  # block index of each query
    ctx_visible = torch.arange(seq_len)[None, :] < anchors[q_block][:, None]
    blk_visible = q_block[:, None] == q_block[None, :]
    return torch.cat([ctx_visible, blk_visible], dim=1)


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..B-1 (position 0 is the given token)."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def build_blocks(
    tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block ids [m*B], positions [m*B], labels [m, B-1] and label validity [m, B-1] (label inside the
    first `length` tokens) for one sequence."""
    length = tokens.shape[0] if length is None else length
    offsets = torch.arange(block_size)
    positions = (anchors[:, None] + offsets[None, :]).reshape(-1)
    ids = torch.full((anchors.shape[0], block_size), mask_token_id, dtype=torch.long)
    ids[:, 0] = tokens[anchors]
    label_pos = anchors[:, None] + offsets[None, 1:]
    valid = label_pos < length
    labels = tokens[label_pos.clamp(max=tokens.shape[0] - 1)]
    return ids.reshape(-1), positions, labels, valid


@dataclass
class Batch:
    """Right-padded sequences; anchors come from [prompt_len, length - 2] of each."""

    tokens: torch.Tensor  # [b, S]
    lengths: torch.Tensor  # [b]
    prompt_lens: torch.Tensor  # [b]
    features: torch.Tensor | None = None  # [b, S, F] the target's features, when cached
    teacher: torch.Tensor | None = None  # [b, S, H] the target's final (normed) hidden, for distillation


def pad_batch(seqs: list[np.ndarray], prompt_lens: list[int]) -> Batch:
    s = max(len(x) for x in seqs)
    tokens = torch.zeros(len(seqs), s, dtype=torch.long)
    for r, x in enumerate(seqs):
        tokens[r, : len(x)] = torch.from_numpy(x.astype(np.int64))
    return Batch(tokens, torch.tensor([len(x) for x in seqs]), torch.tensor(prompt_lens))


# ---------------------------------------------------------------------------------------
# Model set-up
# ---------------------------------------------------------------------------------------
def new_drafter_for(target: CausalLM, cfg: DrafterTrainConfig, mask_token_id: int) -> DFlashDrafter:
    tc = target.config.get_text_config()
    n_target = tc.num_hidden_layers
    layer_ids = list(cfg.target_layer_ids or build_target_layer_ids(n_target, cfg.num_layers))
    raw = {
        "hidden_size": tc.hidden_size,
        "intermediate_size": tc.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": tc.num_attention_heads,
        "num_key_value_heads": tc.num_key_value_heads,
        "head_dim": getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        "rms_norm_eps": tc.rms_norm_eps,
        "vocab_size": tc.vocab_size,
        "max_position_embeddings": tc.max_position_embeddings,
        "rope_parameters": getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0},
        "hidden_act": getattr(tc, "hidden_act", "silu"),
        "block_size": cfg.block_size,
        "num_target_layers": n_target,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": layer_ids, "block_size": cfg.block_size},
    }
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter.from_config(raw)
    for name, p in drafter.named_parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    if cfg.init_from_target:
        _init_layers_from_target(drafter, target, layer_ids, cfg.init_norm_scale)
    return drafter


def _init_layers_from_target(
    drafter: DFlashDrafter, target: CausalLM, layer_ids: list[int], norm_scale: float = 1.0
) -> None:
    """Copy the target layers just after the feature taps into the drafter: a warm start with
    the same shapes (a heuristic of ours; the paper does not say how drafters are initialised)."""
    layers = target.model.layers
    picks = [min(len(layers) - 1, i + 1) for i in build_target_layer_ids(len(layers), len(drafter.layers))]
    for d_layer, t_idx in zip(drafter.layers, picks):
        src = layers[t_idx].state_dict()
        dst = d_layer.state_dict()
        shared = {k: v for k, v in src.items() if k in dst and dst[k].shape == v.shape}
        d_layer.load_state_dict(shared, strict=False)
    # the drafter's last hidden goes through the target's lm_head as the target's final hidden does:
    # start from the target's final norm, scaled by `norm_scale` (< 1 tempers the first steps' logits)
    final_norm = getattr(target.get_decoder(), "norm", None)  # type: ignore[no-untyped-call]
    if final_norm is not None and final_norm.weight.shape == drafter.norm.weight.shape:
        drafter.norm.weight.data.copy_(final_norm.weight.data * norm_scale)


# ---------------------------------------------------------------------------------------
# The frozen target's features: run only as deep as needed, cached once on disk
# ---------------------------------------------------------------------------------------
class _Deep(Exception):
    """Raised by a hook after the deepest layer needed: the rest of the target is not run."""


@torch.no_grad()
def target_hidden(
    target: CausalLM, tokens: torch.Tensor, layer_ids: Sequence[int], teacher: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Features [b, S, len(ids)*H] (outputs of decoder layers `layer_ids`, = `hidden_states[i + 1]`) and,
    with `teacher`, the final normed hidden [b, S, H] whose lm_head product is the target's logits.
    Without a teacher the target stops after its deepest feature layer; the lm_head never runs. Both come
    back on the target's device."""
    decoder = target.get_decoder()  # type: ignore[no-untyped-call]
    tokens = tokens.to(target.device)
    layers = decoder.layers
    last = len(layers) - 1
    outs: dict[int, torch.Tensor] = {}
    deepest = max(layer_ids)
    stop_early = not teacher and deepest < last

    def hook(idx: int) -> Callable[[torch.nn.Module, Any, Any], None]:
        def fn(module: torch.nn.Module, args: Any, output: Any) -> None:
            outs[idx] = output[0] if isinstance(output, tuple) else output
            if stop_early and idx == deepest:
                raise _Deep

        return fn

    handles = [layers[i].register_forward_hook(hook(i)) for i in set(layer_ids)]
    try:
        final = decoder(input_ids=tokens, use_cache=False).last_hidden_state
    except _Deep:
        final = None
    finally:
        for h in handles:
            h.remove()
    if last in layer_ids:  # HF's hidden_states[-1] is the normed output: match what inference reads
        outs[last] = final if final is not None else decoder(input_ids=tokens, use_cache=False).last_hidden_state
    feats = torch.cat([outs[i] for i in layer_ids], dim=-1).float()
    return feats, (final.float() if teacher else None)


class CacheMeta(TypedDict):
    """A feature cache's `meta.json`: what it holds, and how many sequences are done."""

    layer_ids: list[int]
    feature_size: int
    hidden_size: int
    teacher: bool
    sequences: int
    tokens: int
    ids_hash: str
    done: int


class FeatureCache:
    """The target's features (and teacher hidden) of every token of a SequenceSet, fp16 in memory-mapped
    files, aligned with the set's flat token array. Built once (resumably); `meta.json` says what it holds."""

    def __init__(
        self,
        folder: Path,
        data: SequenceSet,
        layer_ids: Sequence[int],
        feature_size: int,
        hidden_size: int,
        teacher: bool,
    ):
        self.folder, self.data = folder, data
        self.meta: CacheMeta = {
            "layer_ids": list(layer_ids),
            "feature_size": feature_size,
            "hidden_size": hidden_size,
            "teacher": teacher,
            "sequences": len(data),
            "tokens": int(data.offsets[-1]),
            "ids_hash": hash_ids(data.ids),
            "done": 0,
        }
        self.features: np.memmap | None = None
        self.teacher: np.memmap | None = None

    def _files(self) -> tuple[Path, Path, Path]:
        return self.folder / "features.f16", self.folder / "teacher.f16", self.folder / "meta.json"

    def open_or_build(self, target: CausalLM, batch_tokens: int = 8192) -> FeatureCache:
        feat_file, teacher_file, meta_file = self._files()
        want = {k: v for k, v in self.meta.items() if k != "done"}
        mode: Literal["r+", "w+"] = "r+"
        if meta_file.is_file():
            have = json.loads(meta_file.read_text())
            if {k: v for k, v in have.items() if k != "done"} == want:
                self.meta["done"] = have["done"]
            elif self._extends(have):  # more regenerated shards after the same ones: compute only the new part
                print(
                    f"feature cache {self.folder}: {len(self.data) - have['sequences']} new sequences, extending",
                    flush=True,
                )
                self._check_space(self.meta["tokens"] - have["tokens"])
                for f, width in (
                    (feat_file, self.meta["feature_size"]),
                    (teacher_file, self.meta["hidden_size"] if self.meta["teacher"] else 0),
                ):
                    if width:
                        with open(f, "r+b") as fh:
                            fh.truncate(self.meta["tokens"] * width * 2)
                self.meta["done"] = have["done"]
                meta_file.write_text(json.dumps(self.meta))
            else:
                print(f"feature cache {self.folder}: data or layers changed, rebuilding", flush=True)
                shutil.rmtree(self.folder)
        if not meta_file.is_file():
            self.folder.mkdir(parents=True, exist_ok=True)
            self._check_space(self.meta["tokens"])
            mode = "w+"
        n_tok = self.meta["tokens"]
        self.features = np.memmap(feat_file, np.float16, mode, shape=(n_tok, self.meta["feature_size"]))
        if self.meta["teacher"]:
            self.teacher = np.memmap(teacher_file, np.float16, mode, shape=(n_tok, self.meta["hidden_size"]))
        if mode == "w+":
            meta_file.write_text(json.dumps(self.meta))
        self._build(target, batch_tokens)
        return self

    def _check_space(self, tokens: int) -> None:
        need = tokens * (self.meta["feature_size"] + self.meta["hidden_size"] * self.meta["teacher"]) * 2
        free = shutil.disk_usage(self.folder).free
        if need > free * 0.9:
            raise OSError(f"needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free in {self.folder}")

    def _extends(self, have: dict[str, Any]) -> bool:
        """The cache on disk holds the first sequences of this set (same layers): regenerating appends shards."""
        n = int(have.get("sequences", 0))
        same_kind = all(have.get(k) == self.meta[k] for k in ("layer_ids", "feature_size", "hidden_size", "teacher"))
        return (
            same_kind
            and 0 < n < len(self.data)
            and have.get("tokens") == int(self.data.offsets[n])
            and have.get("ids_hash") == hash_ids(self.data.ids[:n])
        )

    def _build(self, target: CausalLM, batch_tokens: int) -> None:
        n, done = len(self.data), self.meta["done"]
        if done >= n:
            return
        lengths = self.data.lengths
        t0, tokens_done = time.perf_counter(), 0
        bar = tqdm(total=n, initial=done, desc="target features", unit="seq")
        assert self.features is not None  # open_or_build maps the files first
        i = done
        while i < n:
            j = i + 1  # as many sequences as fit in `batch_tokens` (padded)
            while j < n and (j + 1 - i) * max(lengths[i : j + 1]) <= batch_tokens:
                j += 1
            batch = pad_batch([self.data.sequence(k) for k in range(i, j)], [0] * (j - i))
            # right padding needs no attention mask: causal attention never looks at later (pad) tokens
            feats, final = target_hidden(target, batch.tokens, self.meta["layer_ids"], teacher=self.meta["teacher"])
            for r, k in enumerate(range(i, j)):
                a, b = self.data.offsets[k], self.data.offsets[k + 1]
                self.features[a:b] = feats[r, : b - a].half().cpu().numpy()
                if final is not None and self.teacher is not None:
                    self.teacher[a:b] = final[r, : b - a].half().cpu().numpy()
            tokens_done += int(batch.lengths.sum())
            i = j
            self.features.flush()
            if self.teacher is not None:
                self.teacher.flush()
            self.meta["done"] = i
            self._files()[2].write_text(json.dumps(self.meta))  # progress after the data: resumable
            bar.update(batch.tokens.shape[0])
            bar.set_postfix(tok_s=f"{tokens_done / (time.perf_counter() - t0):.0f}")
        bar.close()
        print(
            f"target features: {tokens_done} tokens in {time.perf_counter() - t0:.0f}s "
            f"({tokens_done / (time.perf_counter() - t0):.0f} tokens/s) -> {self.folder}",
            flush=True,
        )

    def get(self, k: int) -> tuple[np.ndarray, np.ndarray | None]:
        a, b = self.data.offsets[k], self.data.offsets[k + 1]
        assert self.features is not None  # open_or_build maps the files first
        return self.features[a:b], (self.teacher[a:b] if self.teacher is not None else None)


def hash_ids(ids: np.ndarray) -> str:
    import hashlib

    return hashlib.sha1("\n".join(map(str, ids.tolist())).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------
def _rows_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    teacher: torch.Tensor | None,
    lm_head: torch.Tensor,
    drafter: DFlashDrafter,
    kd_weight: float,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted loss sum and correctness of a chunk of rows; logits exist only inside this chunk."""
    logits = drafter.logits(hidden, lm_head).float()
    loss = F.cross_entropy(logits, labels, reduction="none")
    if teacher is not None and kd_weight > 0:
        t = F.log_softmax(F.linear(teacher, lm_head).float() / temperature, -1)
        s = F.log_softmax(logits / temperature, -1)
        kl = (t.exp() * (t - s)).sum(-1) * temperature**2
        loss = (1 - kd_weight) * loss + kd_weight * kl
    return (loss * weights).sum(), (logits.detach().argmax(-1) == labels)


def chunked_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    teacher: torch.Tensor | None,
    lm_head: torch.Tensor,
    drafter: DFlashDrafter,
    cfg: DrafterTrainConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over rows of the weighted loss, in chunks of `cfg.loss_chunk_rows` whose logits are recomputed
    in backward (activation checkpointing): memory O(chunk x vocab), not O(rows x vocab)."""
    total = hidden.new_zeros((), dtype=torch.float32)
    correct: list[torch.Tensor] = []
    for i in range(0, hidden.shape[0], cfg.loss_chunk_rows):
        sl = slice(i, i + cfg.loss_chunk_rows)
        t = teacher[sl] if teacher is not None else None
        args = (hidden[sl], labels[sl], weights[sl], t, lm_head, drafter, cfg.kd_weight, cfg.kd_temperature)
        if torch.is_grad_enabled() and hidden.requires_grad:
            part, ok = checkpoint(_rows_loss, *args, use_reentrant=False)
        else:
            part, ok = _rows_loss(*args)
        total = total + part
        correct.append(ok)
    return total, torch.cat(correct) if correct else hidden.new_zeros(0, dtype=torch.bool)


def drafter_loss(
    drafter: DFlashDrafter,
    target: CausalLM,
    tokens: torch.Tensor,
    cfg: DrafterTrainConfig,
    generator: torch.Generator,
    features: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    prompt_lens: torch.Tensor | None = None,
    teacher: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and top-1 accuracy per block position for right-padded sequences [b, S] (`lengths`, default
    all S; anchors from `prompt_lens` on, default 1). `features` / `teacher`: the target's, when cached
    (else the target runs here, as deep as needed).

    The loss is computed on the drafter's device. Anchors and blocks are drawn on the CPU (the generator
    is a CPU one, so a run draws the same blocks on any device) and moved there with the features."""
    b, s = tokens.shape
    B = cfg.block_size
    device = drafter.fc.weight.device
    tokens = tokens.cpu()
    lengths = torch.full((b,), s) if lengths is None else lengths.cpu()
    prompt_lens = torch.ones(b, dtype=torch.long) if prompt_lens is None else prompt_lens.cpu()
    want_teacher = cfg.kd_weight > 0
    if features is None or (want_teacher and teacher is None):
        features, teacher = target_hidden(target, tokens, drafter.spec.target_layer_ids, teacher=want_teacher)
    # cached features arrive in fp16 (half the bytes to move); float32 from here, as the target computed them
    features = features.to(device).float()
    teacher = None if teacher is None else teacher.to(device).float()
    embed = cast(torch.Tensor, target.get_input_embeddings().weight)
    lm_head: torch.Tensor = target.get_output_embeddings().weight  # type: ignore[no-untyped-call]
    per_seq = [
        sample_anchors(int(lengths[i]), B, cfg.anchors_per_seq, generator, start=int(prompt_lens[i])) for i in range(b)
    ]
    m = max(1, max(len(a) for a in per_seq))
    id_rows: list[torch.Tensor] = []
    pos_rows: list[torch.Tensor] = []
    label_rows: list[torch.Tensor] = []
    valid_rows: list[torch.Tensor] = []
    anchor_rows: list[torch.Tensor] = []
    for i, a in enumerate(per_seq):
        n_real = len(a)
        a = torch.cat([a, torch.ones(m - n_real, dtype=torch.long)])  # padding blocks carry no loss
        blk_ids, blk_pos, blk_labels, blk_valid = build_blocks(
            tokens[i], a, B, drafter.spec.mask_token_id, int(lengths[i])
        )
        blk_valid[n_real:] = False
        id_rows.append(blk_ids)
        pos_rows.append(blk_pos)
        label_rows.append(blk_labels)
        valid_rows.append(blk_valid)
        anchor_rows.append(a)
    ids, positions, labels = (torch.stack(x).to(device) for x in (id_rows, pos_rows, label_rows))
    valid, anchors = torch.stack(valid_rows).to(device), torch.stack(anchor_rows).to(device)
    with autocast(cfg.bf16, device):
        hidden = drafter.forward_packed(features, drafter.embed_block(ids, embed), positions, anchors)
    hidden = hidden.view(b, m, B, -1)[:, :, 1:]  # predictions for block positions 1..B-1
    weights = position_weights(B, cfg.gamma or default_gamma(B)).to(device).expand(b, m, B - 1)
    rows_teacher = None
    if want_teacher:
        # the target's distribution for the token at a+k comes from its logits at a+k-1
        assert teacher is not None  # given, or computed above when wanted
        idx = (anchors[:, :, None] + torch.arange(B - 1, device=device)[None, None, :]).clamp(max=s - 1)
        rows_teacher = teacher[torch.arange(b, device=device)[:, None, None], idx][valid]
    with autocast(cfg.bf16, device):
        total, correct = chunked_loss(hidden[valid], labels[valid], weights[valid], rows_teacher, lm_head, drafter, cfg)
    loss = total / weights[valid].sum().clamp(min=1e-6)
    hits = torch.zeros(b, m, B - 1, device=device)
    hits[valid] = correct.float()
    accuracy = hits.sum((0, 1)) / valid.sum((0, 1)).clamp(min=1)
    return loss, accuracy


# ---------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------
def as_sequence_set(sequences: np.ndarray | SequenceSet, seq_len: int) -> SequenceSet:
    """Fixed-length token rows [N, L] (plain text or old-style regenerated data) -> windows of `seq_len`
    without a prompt (anchors from position 1)."""
    if isinstance(sequences, SequenceSet):
        return sequences
    seqs = np.asarray(sequences)
    if seqs.shape[1] < seq_len:
        raise ValueError(f"sequences of {seqs.shape[1]} tokens are shorter than seq_len {seq_len}")
    per_row = seqs.shape[1] // seq_len
    windows = seqs[:, : per_row * seq_len].reshape(-1, seq_len)
    return SequenceSet.from_arrays(
        windows.reshape(-1), [seq_len] * len(windows), [1] * len(windows), [str(i) for i in range(len(windows))]
    )


def open_feature_cache(
    folder: Path | None, data: SequenceSet, drafter: DFlashDrafter, target: CausalLM, teacher: bool
) -> FeatureCache | None:
    """The disk cache of the target's features, built if needed; None (with a loud message) when it cannot
    be written: then every step re-runs the target, several times slower."""
    if folder is None:
        return None
    hidden = target.config.get_text_config().hidden_size
    try:
        return FeatureCache(
            folder, data, drafter.spec.target_layer_ids, drafter.feature_size, hidden, teacher
        ).open_or_build(target)
    except OSError as e:
        print(
            "\n" + "!" * 78 + f"\nWARNING: feature cache {folder} cannot be written ({e}).\n"
            "Training continues WITHOUT it: the target runs again at every step (several times slower).\n"
            + "!" * 78
            + "\n",
            file=sys.stderr,
            flush=True,
        )
        return None


def train_drafter(
    drafter: DFlashDrafter,
    target: CausalLM,
    sequences: np.ndarray | SequenceSet,
    out: Path,
    cfg: DrafterTrainConfig,
    resume: bool = False,
    feature_cache: Path | None | str = "default",
) -> dict[str, Any]:
    """Train on regenerated sequences (SequenceSet) or fixed-length token rows [N, >= seq_len]; writes
    checkpoints (published format) into `out`. `feature_cache`: folder of the target-feature cache
    (default `out/feature-cache`; None: no cache, the target runs every step). The drafter trains on the
    target's device (move the target to a GPU to train there); batches are assembled on the CPU."""
    out.mkdir(parents=True, exist_ok=True)
    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()  # type: ignore[no-untyped-call]
    drafter.to(target.device)
    data = as_sequence_set(sequences, cfg.seq_len)
    opt, sched = make_optimizer(drafter.parameters(), cfg.lr, cfg.steps, cfg.warmup_ratio)
    start_step, history = 0, []
    if resume and (out / STATE_FILE).exists():
        state = load_state(out / STATE_FILE, opt, sched)
        start_step, history = state["step"], state.get("history", [])
        print(f"resuming from step {start_step}", flush=True)
    folder = out / "feature-cache" if feature_cache == "default" else feature_cache
    cache = open_feature_cache(Path(folder) if folder else None, data, drafter, target, teacher=cfg.kd_weight > 0)
    drafter.train()
    gen = torch.Generator().manual_seed(cfg.seed + start_step)
    t_start = time.perf_counter()
    last_acc = [torch.zeros(cfg.block_size - 1)]

    def step_fn(step: int) -> tuple[torch.Tensor, int, dict[str, Any]]:
        rows = torch.randint(0, len(data), (cfg.batch_size,), generator=gen).tolist()
        seqs = [data.sequence(k)[: cfg.seq_len] for k in rows]
        batch = pad_batch(seqs, [int(data.prompt_lens[k]) for k in rows])
        feats = teacher = None
        if cache is not None:  # kept in the cache's fp16 until drafter_loss has moved them to the device
            s = batch.tokens.shape[1]
            feats = torch.zeros(len(rows), s, drafter.feature_size, dtype=torch.float16)
            hidden = cache.meta["hidden_size"]
            teacher = torch.zeros(len(rows), s, hidden, dtype=torch.float16) if cache.teacher is not None else None
            for r, k in enumerate(rows):
                f, t = cache.get(k)
                n = len(seqs[r])
                feats[r, :n] = torch.from_numpy(np.asarray(f[:n]))
                if teacher is not None and t is not None:  # both exactly when the cache holds a teacher
                    teacher[r, :n] = torch.from_numpy(np.asarray(t[:n]))
        loss, acc = drafter_loss(
            drafter,
            target,
            batch.tokens,
            cfg,
            gen,
            features=feats,
            lengths=batch.lengths,
            prompt_lens=batch.prompt_lens,
            teacher=teacher,
        )
        last_acc[0] = acc
        predicted = int((batch.lengths - batch.prompt_lens).clamp(min=0).sum())
        return loss, predicted, {"acc1": f"{float(acc[0]):.2f}"}

    def on_every(step: int, running: float, elapsed: float, last: bool) -> None:
        history.append(
            {
                "step": step,
                "loss": round(running, 4),
                "accuracy_by_position": [round(float(a), 3) for a in last_acc[0]],
                "seconds": round(elapsed, 1),
            }
        )
        tqdm.write(json.dumps(history[-1]))
        _save_checkpoint(drafter, out)
        save_state(out / STATE_FILE, step, opt, sched, {"history": history})

    step = run_steps(
        drafter.parameters(),
        opt,
        sched,
        step_fn,
        start=start_step,
        total=cfg.steps,
        clip=cfg.clip,
        every=cfg.save_every,
        on_every=on_every,
        time_budget_s=cfg.time_budget_s,
        desc="train-drafter",
    )
    drafter.eval()
    summary = {
        "steps": step,
        "history": history,
        "config": asdict(cfg),
        "seconds": round(time.perf_counter() - t_start),
    }
    (out / "training.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def _save_checkpoint(drafter: DFlashDrafter, out: Path) -> None:
    """Weights + config written aside, then renamed into place: a run killed mid-save (a background run
    on a shared machine) leaves the previous checkpoint whole."""
    tmp = out / ".saving"
    drafter.save_pretrained(tmp)
    for f in tmp.iterdir():
        f.replace(out / f.name)
    tmp.rmdir()


def train_drafter_on_sequences(
    target: CausalLM, data: SequenceSet, out: Path, feature_dir: Path, cfg: DrafterTrainConfig, train: bool = True
) -> dict[str, Any]:
    """The recipe script's entry: a new drafter (or the checkpoint in `out`, resumed), the feature cache
    in `feature_dir`, then training (or only the cache when `train` is False)."""
    mask = cfg.mask_token_id
    if mask is None:
        raise ValueError("mask_token_id is required")
    if (out / STATE_FILE).exists():
        drafter = DFlashDrafter.from_pretrained(out)
    else:
        drafter = new_drafter_for(target, cfg, mask)
    n = sum(p.numel() for p in drafter.parameters())
    print(
        f"drafter: {n / 1e6:.2f}M parameters, {cfg.num_layers} layers, block {cfg.block_size}, features of "
        f"target layers {list(drafter.spec.target_layer_ids)}; {len(data)} sequences, "
        f"{data.response_tokens} response tokens",
        flush=True,
    )
    if not train:
        open_feature_cache(feature_dir, data, drafter, target, teacher=cfg.kd_weight > 0)
        return {"steps": 0}
    return train_drafter(drafter, target, data, out, cfg, resume=True, feature_cache=feature_dir)


# ---------------------------------------------------------------------------------------
# Data for the CLI and the demo script: fixed-length continuations of corpus prompts
# ---------------------------------------------------------------------------------------
@torch.no_grad()
def regenerate(
    target: CausalLM, prompts: torch.Tensor, new_tokens: int, temperature: float = 0.0, batch: int = 32, seed: int = 0
) -> np.ndarray:
    """The target's own continuations of equal-length prompts: [N, prompt_len + new_tokens]."""
    torch.manual_seed(seed)
    outs = []
    for i in tqdm(range(0, prompts.shape[0], batch), desc="regenerate", unit="batch"):
        chunk = prompts[i : i + batch].to(target.device)
        gen = target.generate(
            chunk,
            attention_mask=torch.ones_like(chunk),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_p=None,
            top_k=None,
            pad_token_id=0,
            eos_token_id=None,
        )
        outs.append(gen.cpu().numpy())
    return np.concatenate(outs)


def corpus_sequences(tokens: np.ndarray, length: int) -> np.ndarray:
    n = len(tokens) // length
    return tokens[: n * length].reshape(n, length)


def load_training_sequences(
    data: str | Path,
    tokenizer: PreTrainedTokenizerBase | None,
    seq_len: int,
    regenerate_with: CausalLM | None = None,
    n_sequences: int = 512,
    prompt_len: int = 64,
    temperature: float = 0.0,
) -> np.ndarray | SequenceSet:
    """`data`: a .npy of token sequences, regenerated responses (a .npz or a folder of shard-*.npz from
    `train.regen`: anchors in the responses only), or text (file, folder, 'stdlib'). With
    `regenerate_with` (the target), prompts cut from the text are continued by the target itself."""
    from .data import read_texts, text_files, tokenize_corpus

    if str(data).endswith(".npy"):
        rows: np.ndarray = np.load(data)
        return rows
    if str(data).endswith(".npz") or (Path(data).is_dir() and any(Path(data).glob("shard-*.npz"))):
        return SequenceSet.load(Path(data))
    if tokenizer is None:
        raise ValueError(f"training on text ({data}) needs the target's tokenizer; the target folder has none")
    tokens = tokenize_corpus(tokenizer, read_texts(text_files(data)))
    if regenerate_with is None:
        return corpus_sequences(tokens, seq_len)
    prompts = corpus_prompts(tokens, n_sequences, prompt_len)
    return regenerate(regenerate_with, prompts, max(seq_len - prompt_len, 1), temperature)


def regenerate_dataset(
    target_dir: Path,
    out: Path,
    n_sequences: int,
    prompt_len: int,
    new_tokens: int,
    temperature: float = 0.0,
    seed: int = 1,
    device: str = "cpu",
    batch: int = 32,
) -> None:
    """For the demo: prompts from the training split of the stdlib corpus, continued by the target. The prompts
    come from out's folder: regen-prompts-seed{seed}.npy when there (`regen_prompts_file`: what another machine
    drew, so a GPU host continues exactly those), else drawn from train.npy there, else from this interpreter's
    standard library."""
    from ..models.target import load_target, load_tokenizer
    from .data import read_texts, stdlib_files, tokenize_corpus

    target = load_target(target_dir, device=device)
    tok = load_tokenizer(target_dir)
    if tok is None:
        raise ValueError(f"{target_dir} has no tokenizer")
    drawn = regen_prompts_file(out.parent, seed)
    if drawn.exists():
        prompts = torch.from_numpy(np.load(drawn).astype(np.int64))
        if prompts.shape[0] < n_sequences or prompts.shape[1] != prompt_len:
            raise ValueError(f"{drawn} holds {tuple(prompts.shape)} prompts; wanted {n_sequences} x {prompt_len}")
        prompts = prompts[:n_sequences]
        print(f"regen: {n_sequences} prompts from {drawn}", flush=True)
    else:
        cached = out.parent / "train.npy"
        tokens = np.load(cached) if cached.exists() else tokenize_corpus(tok, read_texts(stdlib_files("train")))
        prompts = corpus_prompts(tokens, n_sequences, prompt_len, seed=seed)
    t = time.perf_counter()
    seqs = regenerate(target, prompts, new_tokens, temperature, batch=batch)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, seqs.astype(np.uint16 if len(tok) < 65536 else np.int32))
    print(f"regenerated {seqs.shape[0]} sequences x {seqs.shape[1]} tokens in {time.perf_counter() - t:.0f}s")


def train_drafter_from_dirs(
    target_dir: Path, data: Path, out: Path, cfg: DrafterTrainConfig, resume: bool = False, device: str = "cpu"
) -> dict[str, Any]:
    from ..models.target import load_target, load_tokenizer

    target = load_target(target_dir, device=device)
    tok = load_tokenizer(target_dir)
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else getattr(tok, "mask_token_id", None)
    if mask is None:
        raise ValueError("no mask token: the tokenizer has none; pass --mask-token-id")
    sequences = load_training_sequences(data, tok, cfg.seq_len)
    if resume and (out / "config.json").exists():
        drafter = DFlashDrafter.from_pretrained(out)
    else:
        drafter = new_drafter_for(target, cfg, mask)
    n = sum(p.numel() for p in drafter.parameters())
    print(
        f"drafter: {n / 1e6:.2f}M parameters, {cfg.num_layers} layers, block {cfg.block_size}, "
        f"features of target layers {list(drafter.spec.target_layer_ids)}; {len(sequences)} sequences"
    )
    return train_drafter(drafter, target, sequences, out, cfg, resume=resume)
