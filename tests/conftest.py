import inspect
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

# tests/ holds the shared helpers (tiny models, fakes, harnesses) that test modules in its subfolders import.
# Its subfolders follow the package's layout; none may be named after an importable package (a folder
# `triton` here would pass for OpenAI's Triton in libraries that probe for it with find_spec).
sys.path.insert(0, str(Path(__file__).parent))
# One intra-op thread in the test process. The tests' models are tiny (a pass is well under a millisecond of work),
# so a second thread buys nothing, and it costs dearly whenever the cores are shared: a parallel kernel waits at a
# barrier for its other OpenMP thread, and while that thread is off the CPU (a server subprocess, the server's own
# threads, a busy machine) every kernel waits a scheduler slice, and a test's time grows with the machine's load
# rather than with its work. Subprocesses (servers, tritonserver, mpirun ranks) keep their own thread settings:
# those are what the tests of them check.
torch.set_num_threads(1)
# The drafter export cache (dflash_trt/builders/export_cache.py) of this run: one folder that the run's workers and
# every process they start share, never the user's own cache. The controller (or a run without workers) makes it
# before it starts its workers, which inherit the variable, and removes it when the run ends.
# tests/builders/test_export_cache.py points its own tests elsewhere.
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ["DFLASH_TRT_CACHE"] = tempfile.mkdtemp(prefix="dflash-trt-test-exports-")
EXPORT_CACHE = Path(os.environ["DFLASH_TRT_CACHE"])

from clocks import AdversarialClock  # noqa: E402
from helpers import make_tiny_pair  # noqa: E402

# The clock every decoder and cost grid a test builds without a clock of its own reads (tests/clocks.py):
# "adversarial" (the default; "adversarial:SEED" draws other sequences): seeded random seconds between reads,
# spanning 100x, so that a test whose outcome depends on timings fails on a quiet machine too, not only on a
# busy one, and no other test's outcome can depend on the machine's load; "wall": the package's own default
# (perf_counter). A test that means to read the wall clock says so: @pytest.mark.wall_clock.
CLOCK = os.environ.get("DFLASH_TEST_CLOCK", "adversarial")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "wall_clock: the decoders and cost grids this test builds without a clock read the wall clock"
    )
    mode = CLOCK.partition(":")[0]
    if mode not in ("adversarial", "wall"):
        raise pytest.UsageError(f"DFLASH_TEST_CLOCK must be 'adversarial', 'adversarial:SEED' or 'wall', got {CLOCK!r}")


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without workers): after every worker
        shutil.rmtree(EXPORT_CACHE, ignore_errors=True)


def pytest_report_header(config):
    return f"default clock of the decoders under test: {CLOCK} (DFLASH_TEST_CLOCK)"


def _clock_defaults():
    """The functions whose `clock` parameter defaults to the wall clock: the decoding loop (and through its
    timings the chunk pacer, the proposers' prices and the adaptive policy's corrections; the server's decoder
    takes the loaded decoder's clock) and the adaptive policy's start-up cost grid."""
    from dflash_trt.decoding import AdaptiveBlocks, BatchDecoder
    from dflash_trt.decoding.cost import measure_costs

    return [BatchDecoder.__init__, AdaptiveBlocks.measured.__func__, measure_costs]


def _swap_default(monkeypatch, func, name, value):
    """Make `value` the default of `func`'s parameter `name` for this test (restored after it)."""
    param = inspect.signature(func).parameters.get(name)
    if param is None or not (param.default is time.perf_counter or isinstance(param.default, AdversarialClock)):
        raise RuntimeError(
            f"{func.__qualname__} has no parameter {name!r} defaulting to time.perf_counter any more: "
            "update tests/conftest.py's _clock_defaults to the functions that default to the wall clock now"
        )
    if param.kind is inspect.Parameter.KEYWORD_ONLY:
        monkeypatch.setitem(func.__kwdefaults__, name, value)
        return
    positional = [p for p in inspect.signature(func).parameters.values() if p.kind is not p.KEYWORD_ONLY]
    with_default = [p.name for p in positional if p.default is not p.empty]
    defaults = list(func.__defaults__)
    defaults[with_default.index(name)] = value
    monkeypatch.setattr(func, "__defaults__", tuple(defaults))


@pytest.fixture(scope="session", autouse=True)
def _adversarial_default_clock_of_the_session():
    """Under DFLASH_TEST_CLOCK=adversarial (the default), the decoders that fixtures of a wider scope than a test
    build (a module's server) read an `AdversarialClock` of the session."""
    mode, _, seed = CLOCK.partition(":")
    with pytest.MonkeyPatch.context() as monkeypatch:
        if mode == "adversarial":
            clock = AdversarialClock.for_test("session", int(seed or 0))
            for func in _clock_defaults():
                _swap_default(monkeypatch, func, "clock", clock)
        yield


@pytest.fixture(autouse=True)
def _adversarial_default_clock(request, monkeypatch):
    """Under DFLASH_TEST_CLOCK=adversarial (the default), each test's decoders and cost grids built without a
    clock read one `AdversarialClock` seeded by the test's id; under a test marked `wall_clock`, the wall clock."""
    mode, _, seed = CLOCK.partition(":")
    if mode == "adversarial":
        wall = request.node.get_closest_marker("wall_clock") is not None
        clock = time.perf_counter if wall else AdversarialClock.for_test(request.node.nodeid, int(seed or 0))
        for func in _clock_defaults():
            _swap_default(monkeypatch, func, "clock", clock)
    yield


@pytest.fixture(scope="session", autouse=True)
def _startup_grid_measured_once_per_shape():
    """A server's adaptive policy measures a start-up cost grid on its engines (`AdaptiveBlocks.measured`: about
    60 passes, most of a server's start on a CPU). On an `AdversarialClock` that grid's seconds are the clock's
    noise, not the engines' (no test's outcome may depend on them), so a grid of the same shape measured on the
    same kind of engines earlier in the session is as good as a new one: each shape is measured once, on the real
    engines, and every later server starts from a copy. For the same reason that one measurement times each cell
    once after the warm-up pass (`repeats=1`): the fastest of five readings of noise is still noise. A grid on any other clock (a test's virtual clock, the
    wall clock of DFLASH_TEST_CLOCK=wall or a `wall_clock` test) is measured every time; tests of
    `measure_costs` itself call it directly and are not affected."""
    import copy

    from dflash_trt.decoding import adaptive

    measure, grids = adaptive.measure_costs, {}

    def measured_once(target, drafter=None, *args, clock=time.perf_counter, **kw):
        if not isinstance(clock, AdversarialClock):
            return measure(target, drafter, *args, clock=clock, **kw)
        shape = (type(target), type(drafter), int(target.vocab_size), int(target.max_context))
        key = (*shape, getattr(drafter, "block_size", None), args, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in grids:
            grids[key] = measure(target, drafter, *args, clock=clock, **{**kw, "repeats": 1})
        return copy.deepcopy(grids[key])

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(adaptive, "measure_costs", measured_once)
        yield


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
