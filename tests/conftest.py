import sys
from pathlib import Path

import pytest
import torch

# tests/ holds the shared helpers (tiny models, fakes, harnesses) that test modules in its subfolders import.
# Its subfolders follow the package's layout; none may be named after an importable package (a folder
# `triton` here would pass for OpenAI's Triton in libraries that probe for it with find_spec).
sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(min(2, torch.get_num_threads()))

from helpers import make_tiny_pair  # noqa: E402


@pytest.fixture(scope="session", params=["qwen3", "llama"])
def tiny_pair(request, tmp_path_factory):
    """(family, target dir, drafter dir, target model, drafter) for a tiny random pair, saved to disk."""
    root = tmp_path_factory.mktemp(f"tiny-{request.param}")
    target, drafter = make_tiny_pair(root, family=request.param, layers=5, drafter_layers=2, block_size=8)
    return request.param, root / "target", root / "drafter", target, drafter
