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


@pytest.fixture(autouse=True)
def _server_logger_restored():
    """`dflash-trt serve` run in process (main(["serve", ...])) gives the server's logger a handler on the
    sys.stderr of that moment: pytest's capture of that test, closed when it ends. Left in place, every later
    server log line (a uvicorn thread of another test) fails with "I/O operation on closed file"; each test
    leaves the logger as it found it."""
    import logging

    logger = logging.getLogger("dflash_trt.server")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    for h in logger.handlers:
        if h not in handlers:
            logger.removeHandler(h)
            h.close()
    logger.setLevel(level)
    logger.propagate = propagate
