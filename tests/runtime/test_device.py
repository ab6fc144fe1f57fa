"""`--device` / `--dtype` for the PyTorch engines (generate, serve, bench). This machine has no GPU: the tests
cover the plumbing and the refusals; `make gpu-smoke` runs the same commands on CUDA (scripts/gpu_smoke.py)."""

import inspect
import json

import pytest
import torch
from tiny_models import make_tiny_drafter, make_tiny_target

from dflash_trt.cli import main
from dflash_trt.cli.main import build_parser
from dflash_trt.cli.options import serve_worker_rank
from dflash_trt.loading import DTYPES, load_decoder, resolve_device
from dflash_trt.settings import DRAFTER_DTYPE

NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("device")
    target = make_tiny_target(root / "target", vocab_size=64, layers=4)
    make_tiny_drafter(target.config, root / "drafter", layers=1, block_size=4)
    return root / "target", root / "drafter"


@pytest.mark.parametrize("command", [["generate", "--input-ids", "1"], ["serve"], ["bench"]])
def test_every_pytorch_command_takes_device_and_dtype(command):
    args = build_parser().parse_args([*command, "--device", "cuda:1", "--dtype", "bf16"])
    assert (args.device, args.dtype) == ("cuda:1", "bf16")
    assert DTYPES[args.dtype] is torch.bfloat16
    assert build_parser().parse_args(command).device == "cpu"  # the default stays the CPU


def test_resolve_device_refusals():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("gpu0")
    with pytest.raises(ValueError, match="only cpu and cuda"):
        resolve_device("meta")
    if NO_CUDA:
        with pytest.raises(ValueError, match="no CUDA GPU visible"):
            resolve_device("cuda")
    else:
        with pytest.raises(ValueError, match="CUDA GPU\\(s\\) visible"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal on a machine without CUDA")
def test_cuda_on_a_cpu_machine_is_one_clear_line(pair, capsys):
    target, drafter = pair
    code = main(
        ["generate", "--target", str(target), "--drafter", str(drafter), "--input-ids", "1,2", "--device", "cuda"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "no CUDA GPU visible" in err[0] and "--device cpu" in err[0]


def test_dtype_and_device_reach_both_engines(pair, capsys):
    target, drafter = pair
    decoder = load_decoder(target, drafter, "bf16", "cpu")
    assert decoder.target.model.dtype is torch.bfloat16 and decoder.target.device == torch.device("cpu")
    assert next(decoder.drafter.drafter.parameters()).dtype is torch.bfloat16
    assert decoder.drafter.embed_weight.device == decoder.target.device
    code = main(
        [
            "generate",
            "--target",
            str(target),
            "--drafter",
            str(drafter),
            "--input-ids",
            "1,2,3",
            "--max-new-tokens",
            "6",
            "--device",
            "cpu",
            "--dtype",
            "fp16",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and len(out["token_ids"]) == 6


def test_non_leader_rank_serves_the_engine_only():
    class Target:
        def __init__(self, leader):
            self.is_leader, self.served = leader, False

        def serve_worker(self):
            self.served = True

    class Decoder:
        def __init__(self, leader):
            self.target = Target(leader)

    worker, leader = Decoder(False), Decoder(True)
    assert serve_worker_rank(worker) and worker.target.served
    assert not serve_worker_rank(leader) and not leader.target.served


PYTORCH_COMMANDS = [["generate", "--input-ids", "1"], ["serve"], ["bench"]]


@pytest.mark.parametrize("command", PYTORCH_COMMANDS)
def test_every_pytorch_command_takes_a_drafter_dtype(command):
    assert build_parser().parse_args(command).drafter_dtype == DRAFTER_DTYPE  # one default: settings.py's
    assert build_parser().parse_args([*command, "--drafter-dtype", "bf16"]).drafter_dtype == "bf16"


def test_every_entry_point_resolves_one_drafter_dtype_on_a_cpu_with_bfloat16(monkeypatch):
    """Seeded sampled text depends on the drafter's dtype, so the library, every command and the Triton
    repository's drafter resolve the same one, also where `auto` would pick bfloat16 (the capability injected):
    the target's float32, which is the dtype of the ONNX graph the Triton BLS drafts with."""
    from dflash_trt.bench.settings import BenchSettings
    from dflash_trt.builders.triton_repo import ONNX_PRECISION
    from dflash_trt.formats import PRECISION_DTYPES
    from dflash_trt.loading import drafter_dtype
    from dflash_trt.runtime.base import dtype_name

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    cpu = torch.device("cpu")
    assert drafter_dtype("auto", torch.float32, cpu) is torch.bfloat16  # the capability is there for `auto`
    library = inspect.signature(load_decoder).parameters["drafter_dtype_name"].default
    commands = [build_parser().parse_args(c).drafter_dtype for c in PYTORCH_COMMANDS]
    assert {library, BenchSettings.drafter_dtype, *commands} == {DRAFTER_DTYPE}
    resolved = dtype_name(drafter_dtype(DRAFTER_DTYPE, DTYPES["float32"], cpu))
    assert resolved == PRECISION_DTYPES[ONNX_PRECISION] == "float32"


def test_drafter_dtype_resolution(monkeypatch):
    from dflash_trt.loading import drafter_dtype

    cpu = torch.device("cpu")
    assert drafter_dtype(None, torch.float32, cpu) is torch.float32  # the library default: the target's
    assert drafter_dtype(None, torch.bfloat16, cpu) is torch.bfloat16
    assert drafter_dtype("fp16", torch.float32, cpu) is torch.float16
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert drafter_dtype("auto", torch.float32, cpu) is torch.bfloat16
    assert drafter_dtype("auto", torch.float16, cpu) is torch.float16  # only next to a float32 target
    assert drafter_dtype("auto", torch.float32, torch.device("cuda")) is torch.float32
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)  # AMD Zen 4: no AMX, bf16 dot products
    assert drafter_dtype("auto", torch.float32, cpu) is torch.bfloat16
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)  # emulated: slower than float32
    assert drafter_dtype("auto", torch.float32, cpu) is torch.float32
    with pytest.raises(ValueError, match="drafter dtype"):
        drafter_dtype("int8", torch.float32, cpu)


def test_drafter_in_its_own_dtype_shares_nothing_it_cannot(pair):
    same = load_decoder(*pair)
    assert same.drafter.embed_weight is same.target.embed_weight  # shared, not copied
    mixed = load_decoder(*pair, drafter_dtype_name="bfloat16")
    d = mixed.drafter
    assert (same.drafter.dtype, d.dtype) == ("float32", "bfloat16")  # what the responses report
    assert d.drafter.fc.weight.dtype is torch.bfloat16
    assert d.embed_weight.dtype is torch.bfloat16 and d.lm_head_weight.dtype is torch.bfloat16
    assert torch.equal(d.embed_weight, mixed.target.embed_weight.to(torch.bfloat16))
    assert mixed.target.embed_weight.dtype is torch.float32


def test_pass_clock_waits_for_each_cuda_device_once(monkeypatch):
    """Timings of CUDA passes wait for the device first (kernels run asynchronously); CPU passes need no wait."""
    import time
    from types import SimpleNamespace

    from dflash_trt.runtime.base import cuda_devices, pass_clock

    cpu, none = SimpleNamespace(device="cpu"), object()
    assert pass_clock(cpu, none) is time.perf_counter and cuda_devices(cpu, none) == []
    waits: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    a, b, c = (
        SimpleNamespace(device="cuda:0"),
        SimpleNamespace(device=torch.device("cuda", 0)),
        SimpleNamespace(device="cuda:1"),
    )
    clock = pass_clock(a, b, c, cpu)
    t0 = clock()
    assert clock() >= t0 and waits == [torch.device("cuda", 0), torch.device("cuda", 1)] * 2
