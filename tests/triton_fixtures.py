"""A chat-template preprocessing model beside a Triton model repository (shared by the Triton tests)."""

from __future__ import annotations

import shutil
from pathlib import Path

from helpers import CHAT_TEMPLATE

CHAT_PRE = "preprocessing_chat"


def add_chat_preprocessing(repo: Path) -> Path:
    """Beside the repository's `preprocessing`, the same model as `preprocessing_chat` with
    `chat_template: "true"` and a tokenizer that has CHAT_TEMPLATE. Returns that tokenizer's folder."""
    from transformers import AutoTokenizer

    from dflash_trt.triton.config import parse_config, write_config

    shutil.copytree(repo / "preprocessing", repo / CHAT_PRE)
    cfg = parse_config(repo / CHAT_PRE / "config.pbtxt")
    cfg.name = CHAT_PRE
    cfg.parameters["chat_template"].string_value = "true"
    write_config(repo / CHAT_PRE, cfg)
    tok_dir = repo / CHAT_PRE / "1" / "tokenizer"
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(tok_dir)
    return tok_dir
