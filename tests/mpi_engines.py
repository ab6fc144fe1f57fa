"""What the MPI launch tests share (tests/deploy/test_mpi_serve.py on loopback, test_netns_launch.py across two
network namespaces): an engines folder whose target is a TensorRT-LLM engine folder that tests/mpi_rank.py's FAKE
executor loads, and the JSON event lines the ranks print."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import make_tiny_pair


def fake_trtllm_engines(root: Path) -> Path:
    """engines/ as `make engines` writes it on a GPU machine: the ONNX drafter built for real, the target as a
    TensorRT-LLM engine folder (config.json + dflash_target.json) that the fake executor loads."""
    from dflash_trt.builders.engines import build_engines, read_config
    from dflash_trt.config import load_drafter_config

    make_tiny_pair(root, vocab_size=96, seed=3)  # no tokenizer: a request for N tokens runs exactly N
    (root / "engines.toml").write_text('target = "target"\ndrafter = "drafter"\noutput = "engines"\n')
    build_engines(read_config(root / "engines.toml", root), log=lambda *_: None)
    out = root / "engines"
    _, spec = load_drafter_config(root / "drafter")
    folder = out / "target_trtllm"
    (folder / "engine").mkdir(parents=True)
    build = {"max_seq_len": 256, "max_num_tokens": 256, "plugin_config": {"tokens_per_block": 4}}
    config = {"pretrained_config": {"vocab_size": 96, "hidden_size": 64, "dtype": "float32"}, "build_config": build}
    (folder / "engine" / "config.json").write_text(json.dumps(config))
    layers = list(spec.target_layer_ids)
    meta = {
        "engine_dir": "engine",
        "feature_layer_ids": layers,
        "feature_outputs": [f"dflash_feature_{i}" for i in layers],
        "final_hidden_output": "dflash_final_hidden",
        "target_dir": str(root / "target"),
    }
    (folder / "dflash_target.json").write_text(json.dumps(meta))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["engines"]["target_tensorrt_llm"] = {"backend": "tensorrt_llm", "role": "target", "dir": "target_trtllm"}
    manifest["serve"]["target"] = "target_tensorrt_llm"
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def json_events(text: str, name: str) -> list[dict]:
    """The JSON event lines named `name` in a job's output (mpirun may put two ranks' lines on one line)."""
    decoder, out = json.JSONDecoder(), []
    i = text.find('{"')
    while i != -1:
        try:
            e, end = decoder.raw_decode(text, i)
        except ValueError:
            end = i + 1
        else:
            if isinstance(e, dict) and e.get("event") == name:
                out.append(e)
        i = text.find('{"', end)
    return out
