"""One seeded sampled request (temperature 0.8, a fixed block size, one seed) through every entry point under its
defaults gives the same text: the library (`load_decoder`), `dflash-trt generate --json`, a `dflash-trt serve`
process on a real port (/generate and /v1/completions) and the Triton ensemble on a real tritonserver; and each
response that can name the drafter's dtype names the same one.

Why it can fail: the drafter's dtype moves its draft probabilities, and rejection sampling compares the target's
with them, so a bfloat16 drafter keeps other tokens for the same seed than a float32 one. The request's seed is
chosen as one whose text does differ between the two (in this process), and the capability `--drafter-dtype auto`
reads (torch.cpu's AVX512-BF16 probe, `loading.cpu_has_fast_bf16`) is injected as present here and in the CLI and
server processes (a sitecustomize on their PYTHONPATH): an entry point whose default followed `auto` would run
bfloat16 there, on a CPU without bfloat16 instructions too. The Triton repository's drafter is the float32 ONNX
graph on ONNX Runtime; its BLS model names that dtype in its config's parameters.
"""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import pytest
import torch
from helpers import generate_one, make_text_models
from server_harness import HANG_S

from dflash_trt.decoding import GenerationConfig, SamplingParams
from dflash_trt.loading import load_decoder
from dflash_trt.server.process import serve_command, start_serve

PROMPT = "def fibonacci(n):"  # text: the Triton ensemble takes text; healing is off everywhere (Triton does not heal)
MAX_TOKENS = 12
TEMPERATURE = 0.8
INJECT = "import torch\ntorch.cpu._is_avx512_bf16_supported = lambda: True  # the test's injected capability\n"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The models, the environment that injects the bfloat16 capability into child processes, and the request:
    a seed whose text differs between a float32 and a bfloat16 drafter, with the library's answer under its
    defaults (this process's capability injected too)."""
    root = tmp_path_factory.mktemp("seeded-everywhere")
    target, drafter = make_text_models(root)
    inject = root / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(INJECT)
    path = os.pathsep.join(p for p in (str(inject), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "DFLASH_TRT_API_KEY": ""}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
        library = load_decoder(target, drafter)  # the library's defaults
        auto = load_decoder(target, drafter, drafter_dtype_name="auto")
        assert auto.drafter.dtype == "bfloat16"  # the injection reaches the rule
        block = library.drafter.block_size  # the trained size: what the Triton BLS runs every request at
        ids = library.encode(PROMPT)

        def config(seed: int) -> GenerationConfig:
            sampling = SamplingParams(TEMPERATURE, seed=seed)
            return GenerationConfig(MAX_TOKENS, sampling, block_size=block, stop_token_ids=library.default_stop_ids())

        seed = next((s for s in range(32) if generate_one(library, ids, config(s)).token_ids
                     != generate_one(auto, ids, config(s)).token_ids), None)  # fmt: skip
        assert seed is not None, "no seed in 0..31 gives other text with a bfloat16 drafter: the test cannot tell"
        expected = generate_one(library, ids, config(seed))
    assert expected.stats.drafted_tokens > 0  # the drafter took part
    return {
        "root": root,
        "target": target,
        "drafter": drafter,
        "env": env,
        "block": block,
        "seed": seed,
        "library_dtype": library.drafter.dtype,
        "expected": expected,
    }


def cli_generate(case, *extra: str) -> dict:
    cmd = [
        *serve_command(),
        "generate",
        "--target",
        str(case["target"]),
        "--drafter",
        str(case["drafter"]),
        "--prompt",
        PROMPT,
        "--no-heal-prompt",
        "--max-new-tokens",
        str(MAX_TOKENS),
        "--temperature",
        str(TEMPERATURE),
        "--seed",
        str(case["seed"]),
        "--block-size",
        str(case["block"]),
        "--json",
        *extra,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **case["env"]}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out: dict = json.loads(done.stdout)
    return out


def test_library_cli_and_server_give_the_same_seeded_text_and_name_the_same_drafter_dtype(case):
    expected = case["expected"]
    assert case["library_dtype"] == "float32"  # the default: the target's dtype, bfloat16 capability or not

    cli = cli_generate(case)
    assert (cli["token_ids"], cli["text"]) == (expected.token_ids, expected.text)
    assert cli["drafter_dtype"] == "float32"
    # the same flag asks for bfloat16 (the injected capability reaches the child), and the output says so
    auto = cli_generate(case, "--drafter-dtype", "auto")
    assert auto["drafter_dtype"] == "bfloat16" and auto["token_ids"] != expected.token_ids

    proc, url = start_serve(
        ["--target", str(case["target"]), "--drafter", str(case["drafter"]), "--threads", "1"],
        case["root"] / "serve.log",
        env=case["env"],
        timeout_s=HANG_S,
    )
    try:
        request = {"temperature": TEMPERATURE, "seed": case["seed"], "block_size": case["block"], "heal_prompt": False}
        native = httpx.post(
            url + "/generate", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, **request}, timeout=120
        )
        assert native.status_code == 200, native.text
        body = native.json()
        assert (body["token_ids"], body["text"]) == (expected.token_ids, expected.text)
        assert body["spec"]["drafter_dtype"] == "float32"

        openai = httpx.post(
            url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, **request}, timeout=120
        )
        assert openai.status_code == 200, openai.text
        completion = openai.json()
        assert completion["choices"][0]["text"] == expected.text
        assert completion["system_fingerprint"] == "drafter-float32"
        assert completion["spec"]["drafter_dtype"] == "float32"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_triton_gives_the_same_seeded_text_and_names_the_same_drafter_dtype(case):
    pytest.importorskip("tritonclient.http", reason="tritonclient is part of the dev extra")
    import tritonclient.http as httpclient

    from dflash_trt.builders.triton_repo import BLS_SYNC, write_repository
    from dflash_trt.triton.client import generate
    from dflash_trt.triton.server import TritonServer, TritonUnavailable, server_env

    try:
        server_env()
    except TritonUnavailable as e:
        pytest.skip(f"no tritonserver on this machine: {e}")
    repo = write_repository(case["root"] / "repo", target=case["target"], drafter=case["drafter"])
    server = TritonServer(repo, log_path=case["root"] / "tritonserver.log")
    try:
        server.start(timeout_s=HANG_S)
        config = httpclient.InferenceServerClient(server.http_url).get_model_config(BLS_SYNC)
        assert config["parameters"]["drafter_dtype"]["string_value"] == case["library_dtype"] == "float32"
        reply = generate(
            server.http_url,
            [PROMPT],
            protocol="http",
            max_tokens=MAX_TOKENS,
            temperature=TEMPERATURE,
            seed=case["seed"],
        )
    finally:
        server.stop()
    assert not server.alive()
    assert reply.texts == [case["expected"].text]
