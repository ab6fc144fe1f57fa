"""DFlash drafter training, following the paper's recipe (the authors did not publish code).

- frozen: the target, its embedding table and lm_head; trained: drafter layers, fc, norms;
- per sequence, random anchor positions; each anchor a gives a block [x_a, MASK x (B-1)] at
  positions a..a+B-1 predicting x_{a+1}..x_{a+B-1}, with context = target features of 0..a-1;
- all blocks of a sequence are packed into one forward pass with a block-sparse attention
  mask: bidirectional inside a block, each block sees only its own context prefix;
- loss: cross-entropy through the frozen lm_head weighted by block position,
  w_k = exp(-(k-1)/gamma), optionally mixed with a KL term to the target's soft distribution;
- AdamW, cosine schedule with warm-up, gradient clipping; resumable checkpoints in the
  published drafter format.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..config import build_target_layer_ids
from ..models.drafter import DFlashDrafter
from ..models.target import extract_features
from .common import autocast, load_state, make_optimizer, save_state

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the paper's choices per block size
STATE_FILE = "trainer_state.pt"


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
    seq_len: int = 256
    anchors_per_seq: int = 32
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    clip: float = 1.0
    gamma: float | None = None  # default: DEFAULT_GAMMA
    kd_weight: float = 0.0  # 0 = plain cross-entropy; 1 = distillation only
    kd_temperature: float = 1.0
    init_from_target: bool = True  # start drafter layers from target layers (same shapes)
    cache_features_gb: float = 4.0  # precompute the frozen target's features once if they fit (no KD)
    save_every: int = 200
    time_budget_s: float | None = None
    bf16: bool = True
    seed: int = 0


# ---------------------------------------------------------------------------------------
# Blocks, mask, weights: the pieces the tests check
# ---------------------------------------------------------------------------------------
def sample_anchors(seq_len: int, block_size: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Distinct sorted anchors in [1, S-B]: each has context before it and B-1 labels after it."""
    candidates = seq_len - block_size
    count = min(count, candidates)
    return torch.randperm(candidates, generator=generator)[:count].sort().values + 1


def block_sparse_mask(anchors: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    """[m*B, S + m*B] boolean: block j's queries see context keys < a_j and the keys of block j only."""
    m = anchors.shape[0]
    q_block = torch.arange(m).repeat_interleave(block_size)  # block index of each query
    ctx_visible = torch.arange(seq_len)[None, :] < anchors[q_block][:, None]
    blk_visible = q_block[:, None] == q_block[None, :]
    return torch.cat([ctx_visible, blk_visible], dim=1)


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..B-1 (position 0 is the given token)."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def build_blocks(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """Block ids [m*B], positions [m*B] and labels [m, B-1] for one sequence."""
    offsets = torch.arange(block_size)
    positions = (anchors[:, None] + offsets[None, :]).reshape(-1)
    ids = torch.full((anchors.shape[0], block_size), mask_token_id, dtype=torch.long)
    ids[:, 0] = tokens[anchors]
    labels = tokens[anchors[:, None] + offsets[None, 1:]]
    return ids.reshape(-1), positions, labels


# ---------------------------------------------------------------------------------------
# Model set-up
# ---------------------------------------------------------------------------------------
def new_drafter_for(target, cfg: DrafterTrainConfig, mask_token_id: int) -> DFlashDrafter:
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
        _init_layers_from_target(drafter, target, layer_ids)
    return drafter


def _init_layers_from_target(drafter: DFlashDrafter, target, layer_ids: list[int]) -> None:
    """Copy the target layers just after the feature taps into the drafter: a warm start with
    the same shapes (a heuristic of ours; the paper does not say how drafters are initialised)."""
    layers = target.model.layers
    picks = [min(len(layers) - 1, i + 1) for i in build_target_layer_ids(len(layers), len(drafter.layers))]
    for d_layer, t_idx in zip(drafter.layers, picks):
        src = layers[t_idx].state_dict()
        dst = d_layer.state_dict()
        shared = {k: v for k, v in src.items() if k in dst and dst[k].shape == v.shape}
        d_layer.load_state_dict(shared, strict=False)


# ---------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------
@torch.no_grad()
def target_features(target, tokens: torch.Tensor, layer_ids, bf16: bool, logits: bool = False):
    """The frozen target's features of `layer_ids` (and optionally its logits) for [b, S] tokens."""
    with autocast(bf16):
        out = target(input_ids=tokens, output_hidden_states=True)
    return extract_features(out.hidden_states, layer_ids).float(), (out.logits.float() if logits else None)


def drafter_loss(drafter, target, tokens: torch.Tensor, cfg: DrafterTrainConfig, generator: torch.Generator,
                 features: torch.Tensor | None = None):
    """Loss and top-1 accuracy per block position for a batch of token sequences [b, S].
    `features`: the target's features for these tokens when precomputed (then no target pass)."""
    b, s = tokens.shape
    B = cfg.block_size
    target_logits = None
    if features is None or cfg.kd_weight > 0:
        features, target_logits = target_features(target, tokens, drafter.spec.target_layer_ids, cfg.bf16,
                                                   logits=cfg.kd_weight > 0)
    embed = target.get_input_embeddings().weight
    lm_head = target.get_output_embeddings().weight
    ids, positions, labels, masks, anchors_all = [], [], [], [], []
    for i in range(b):
        anchors = sample_anchors(s, B, cfg.anchors_per_seq, generator)
        blk_ids, blk_pos, blk_labels = build_blocks(tokens[i], anchors, B, drafter.spec.mask_token_id)
        ids.append(blk_ids)
        positions.append(blk_pos)
        labels.append(blk_labels)
        masks.append(block_sparse_mask(anchors, B, s))
        anchors_all.append(anchors)
    ids, positions, labels = torch.stack(ids), torch.stack(positions), torch.stack(labels)
    mask = torch.stack(masks)[:, None]
    with autocast(cfg.bf16):
        hidden = drafter.forward_packed(features, drafter.embed_block(ids, embed), positions, mask)
        m = labels.shape[1]
        hidden = hidden.view(b, m, B, -1)[:, :, 1:]  # predictions for block positions 1..B-1
        logits = drafter.logits(hidden, lm_head).float()
    weights = position_weights(B, cfg.gamma or default_gamma(B))
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(b, m, B - 1)
    loss = (ce * weights).sum(-1).mean() / weights.sum()
    if cfg.kd_weight > 0:
        # the target's distribution for the token at a+k comes from its logits at a+k-1
        idx = torch.stack(anchors_all)[:, :, None] + torch.arange(B - 1)[None, None, :]
        soft = target_logits[torch.arange(b)[:, None, None], idx] / cfg.kd_temperature
        kl = F.kl_div(F.log_softmax(logits / cfg.kd_temperature, -1), F.log_softmax(soft, -1),
                      log_target=True, reduction="none").sum(-1) * cfg.kd_temperature**2
        kd = (kl * weights).sum(-1).mean() / weights.sum()
        loss = (1 - cfg.kd_weight) * loss + cfg.kd_weight * kd
    accuracy = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
    return loss, accuracy


def train_drafter(drafter: DFlashDrafter, target, sequences: np.ndarray, out: Path, cfg: DrafterTrainConfig,
                  resume: bool = False) -> dict:
    """Train on token sequences [N, >= seq_len]; writes checkpoints (published format) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()
    drafter.train()
    opt, sched = make_optimizer(drafter.parameters(), cfg.lr, cfg.steps, cfg.warmup_ratio)
    start_step, history = 0, []
    if resume and (out / STATE_FILE).exists():
        state = load_state(out / STATE_FILE, opt, sched)
        start_step, history = state["step"], state.get("history", [])
        print(f"resuming from step {start_step}")
    gen = torch.Generator().manual_seed(cfg.seed + start_step)
    seqs = torch.from_numpy(sequences.astype(np.int64))
    if seqs.shape[1] < cfg.seq_len:
        raise ValueError(f"sequences of {seqs.shape[1]} tokens are shorter than seq_len {cfg.seq_len}")
    cached = _precompute_features(drafter, target, seqs, cfg)
    t0 = time.perf_counter()
    tokens_done = 0
    bar = tqdm(range(start_step, cfg.steps), desc="train-drafter", unit="step", initial=start_step, total=cfg.steps)
    running = None
    step = start_step
    for step in bar:
        rows = torch.randint(0, seqs.shape[0], (cfg.batch_size,), generator=gen)
        offset = int(torch.randint(0, seqs.shape[1] - cfg.seq_len + 1, (1,), generator=gen)) if cached is None else 0
        batch = seqs[rows, offset : offset + cfg.seq_len]
        feats = cached[rows].float() if cached is not None else None
        loss, acc = drafter_loss(drafter, target, batch, cfg, gen, features=feats)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tokens_done += batch.numel()
        running = float(loss.detach()) if running is None else 0.95 * running + 0.05 * float(loss.detach())
        elapsed = time.perf_counter() - t0
        bar.set_postfix(loss=f"{running:.3f}", acc1=f"{acc[0]:.2f}", tok_s=f"{tokens_done / elapsed:.0f}")
        last = step + 1 == cfg.steps or (cfg.time_budget_s is not None and elapsed > cfg.time_budget_s)
        if (step + 1) % cfg.save_every == 0 or last:
            history.append({"step": step + 1, "loss": round(running, 4),
                            "accuracy_by_position": [round(float(a), 3) for a in acc], "seconds": round(elapsed, 1)})
            tqdm.write(json.dumps(history[-1]))
            drafter.save_pretrained(out)
            save_state(out / STATE_FILE, step + 1, opt, sched, {"history": history})
        if last:
            break
    drafter.eval()
    summary = {"steps": step + 1, "history": history, "config": asdict(cfg), "seconds": round(time.perf_counter() - t0)}
    (out / "training.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def _precompute_features(drafter, target, seqs: torch.Tensor, cfg: DrafterTrainConfig) -> torch.Tensor | None:
    """The target is frozen, so its features of a fixed data set never change: compute them once
    (fp16) instead of every step, when they fit in `cache_features_gb` and sequences are one window."""
    size_gb = seqs.shape[0] * seqs.shape[1] * drafter.feature_size * 2 / 1e9
    if cfg.kd_weight > 0 or seqs.shape[1] != cfg.seq_len or size_gb > cfg.cache_features_gb:
        return None
    chunks = []
    for i in tqdm(range(0, seqs.shape[0], 16), desc="target features", unit="batch"):
        f, _ = target_features(target, seqs[i : i + 16], drafter.spec.target_layer_ids, cfg.bf16)
        chunks.append(f.half())
    return torch.cat(chunks)


# ---------------------------------------------------------------------------------------
# Data: sequences regenerated by the target itself (the paper's recipe) or plain corpus text
# ---------------------------------------------------------------------------------------
@torch.no_grad()
def regenerate(target, prompts: torch.Tensor, new_tokens: int, temperature: float = 0.0, batch: int = 32,
               seed: int = 0) -> np.ndarray:
    """The target's own continuations of equal-length prompts: [N, prompt_len + new_tokens]."""
    torch.manual_seed(seed)
    outs = []
    for i in tqdm(range(0, prompts.shape[0], batch), desc="regenerate", unit="batch"):
        chunk = prompts[i : i + batch]
        gen = target.generate(
            chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
            top_p=None, top_k=None, pad_token_id=0, eos_token_id=None,
        )
        outs.append(gen.numpy())
    return np.concatenate(outs)


def corpus_prompts(tokens: np.ndarray, n: int, length: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - length - 1, (n,), generator=gen).tolist()
    return torch.from_numpy(np.stack([tokens[s : s + length].astype(np.int64) for s in starts]))


def corpus_sequences(tokens: np.ndarray, length: int) -> np.ndarray:
    n = len(tokens) // length
    return tokens[: n * length].reshape(n, length)


def load_training_sequences(data: str | Path, tokenizer, seq_len: int, regenerate_with=None,
                            n_sequences: int = 512, prompt_len: int = 64, temperature: float = 0.0) -> np.ndarray:
    """`data`: a .npy of token sequences, or text (file, folder, 'stdlib'). With `regenerate_with`
    (the target), prompts cut from the text are continued by the target itself."""
    from .data import read_texts, text_files, tokenize_corpus

    if str(data).endswith(".npy"):
        return np.load(data)
    tokens = tokenize_corpus(tokenizer, read_texts(text_files(data)))
    if regenerate_with is None:
        return corpus_sequences(tokens, seq_len)
    prompts = corpus_prompts(tokens, n_sequences, prompt_len)
    return regenerate(regenerate_with, prompts, max(seq_len - prompt_len, 1), temperature)


def regenerate_dataset(target_dir: Path, out: Path, n_sequences: int, prompt_len: int, new_tokens: int,
                       temperature: float = 0.0) -> None:
    """For the demo: prompts from the training split of the stdlib corpus, continued by the target."""
    from ..models.target import load_target, load_tokenizer
    from .data import read_texts, stdlib_files, tokenize_corpus

    target = load_target(target_dir)
    tok = load_tokenizer(target_dir)
    cached = out.parent / "train.npy"
    tokens = np.load(cached) if cached.exists() else tokenize_corpus(tok, read_texts(stdlib_files("train")))
    prompts = corpus_prompts(tokens, n_sequences, prompt_len, seed=1)
    t = time.perf_counter()
    seqs = regenerate(target, prompts, new_tokens, temperature)
    np.save(out, seqs.astype(np.uint16 if len(tok) < 65536 else np.int32))
    print(f"regenerated {seqs.shape[0]} sequences x {seqs.shape[1]} tokens in {time.perf_counter() - t:.0f}s")


def train_drafter_from_dirs(target_dir: Path, data: Path, out: Path, cfg: DrafterTrainConfig,
                            resume: bool = False) -> dict:
    from ..models.target import load_target, load_tokenizer

    target = load_target(target_dir)
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
    print(f"drafter: {n / 1e6:.2f}M parameters, {cfg.num_layers} layers, block {cfg.block_size}, "
          f"features of target layers {list(drafter.spec.target_layer_ids)}; {sequences.shape[0]} sequences")
    return train_drafter(drafter, target, sequences, out, cfg, resume=resume)
