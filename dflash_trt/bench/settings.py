"""The benchmark's settings and its report cells, apart from the runner so that the summary module can name
them without importing the runner (the package keeps no import circle)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..settings import DRAFTER_DTYPE
from .prompts import PROMPT_SETS

if TYPE_CHECKING:
    from .methods import Run

# (temperature, max_new_tokens, prompt set, method name): one cell of the report
CellKey = tuple[float, int, str, str]

FAMILIES = ("baseline", "hf-generate", "dflash-torch", "dflash-ort", "hf-assisted", "prompt-lookup")


@dataclass
class BenchSettings:
    target: Path
    drafter: Path | None
    ar_draft: Path | None
    out: Path
    methods: tuple[str, ...] = FAMILIES
    block_sizes: tuple[int, ...] = (4, 8, 16)
    # where the DFlash methods' drafts come from (decoding/proposers.py): one method per proposer and block size,
    # named <family>-b<B> for dflash and <family>-<proposer>-b<B> for the others
    proposers: tuple[str, ...] = ("dflash",)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    max_new_tokens: tuple[int, ...] = (128, 512)
    prompt_sets: tuple[str, ...] = tuple(PROMPT_SETS)
    prompts_per_set: int = 3
    long_prompts_per_set: int = 1  # for max_new_tokens > long_threshold
    long_threshold: int = 128
    repeats: int = 1
    threads: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    drafter_dtype: str | None = DRAFTER_DTYPE  # see loading.drafter_dtype (the default: the target's)
    onnx_drafter: Path | None = None  # an exported drafter folder; None: export into a scratch folder
    prompt_lookup_tokens: int = 10
    max_ngram: int = 2
    assistant_tokens: int | None = None  # None: Hugging Face's default
    timing_reps: int = 20
    tie_tolerance: float = 1e-3
    corrupt_method: str | None = None  # self-test: corrupt this method's greedy outputs
    max_minutes: float | None = None  # stop starting new prompt groups after this (all methods of a group run)
    plots: bool = True
    progress: bool = True


@dataclass
class Cell:
    """All runs of one method on one prompt set at one temperature and length."""

    runs: dict[int, list[Run]] = field(default_factory=lambda: defaultdict(list))  # prompt index -> [Run per repeat]
    peak_mb: list[float | None] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
