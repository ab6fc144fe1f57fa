"""Tiny models with a real tokenizer, and a Triton model repository for them (shared by the Triton tests)."""

from __future__ import annotations

from pathlib import Path

from helpers import make_tokenizer

from dflash_trt.models.tiny import make_tiny_drafter, make_tiny_target


def tiny_text_pair(root: Path) -> tuple[Path, Path]:
    """A target (with tokenizer) and a drafter, small enough to serve in seconds."""
    tok = make_tokenizer(root / "target", vocab_size=200)
    target = make_tiny_target(root / "target", vocab_size=len(tok), layers=4)
    tok.save_pretrained(root / "target")
    make_tiny_drafter(target.config, root / "drafter", layers=1, block_size=4)
    return root / "target", root / "drafter"
