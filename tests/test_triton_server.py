"""A real tritonserver (nvidia-pytriton's binary + python backend, from .venv-triton: `make triton-env`)
serving the repository that `dflash-trt triton-repo` writes for tiny models, called with tritonclient.

One server per module, started on free loopback ports and always stopped in the fixture's teardown.
Skipped only when the server venv / binary is absent; a server that fails to start is a failure.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc", reason="tritonclient is part of the dev extra")

import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402
from triton_fixtures import tiny_text_pair  # noqa: E402

from dflash_trt.loading import load_decoder  # noqa: E402
from dflash_trt.spec import GenerationConfig  # noqa: E402
from dflash_trt.triton.client import build_inputs, generate  # noqa: E402
from dflash_trt.triton.repo import write_repository  # noqa: E402
from dflash_trt.triton.server import TritonServer, TritonUnavailable, server_env  # noqa: E402

PROMPTS = ["def fibonacci(n):", "for i in range(10):", "class Point:", "import os"]
MAX_TOKENS = 14

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-server")
    target, drafter = tiny_text_pair(root)
    return root, target, drafter


@pytest.fixture(scope="module")
def server(models):
    root, target, drafter = models
    try:
        server_env()
    except TritonUnavailable as e:
        pytest.skip(f"no tritonserver on this machine: {e}")
    repo = write_repository(root / "repo", target=target, drafter=drafter)
    server = TritonServer(repo, log_path=root / "tritonserver.log")
    try:
        server.start(timeout_s=240)
        yield server
    finally:
        server.stop()
    assert not server.alive()


@pytest.fixture(scope="module")
def reference(models):
    """What `dflash-trt generate` computes on the same checkpoints (SpeculativeDecoder.generate), in this process."""
    _, target, drafter = models
    decoder = load_decoder(target, drafter)

    def run(prompt: str, max_tokens: int = MAX_TOKENS):
        config = GenerationConfig(max_new_tokens=max_tokens, stop_token_ids=decoder.default_stop_ids())
        return decoder.generate(decoder.encode(prompt), config)

    return run


def test_greedy_reference_is_the_target_alone(models, reference):
    """The reference itself is lossless: speculative greedy == the target's own greedy decoding."""
    _, target, _ = models
    alone = load_decoder(target, None)
    for prompt in PROMPTS[:2]:
        ids = alone.encode(prompt)
        plain = alone.generate(ids, GenerationConfig(max_new_tokens=MAX_TOKENS, stop_token_ids=alone.default_stop_ids()))
        assert reference(prompt).token_ids == plain.token_ids


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_ensemble_text_equals_generate(server, reference, protocol):
    url = server.http_url if protocol == "http" else server.grpc_url
    for prompt in PROMPTS:
        reply = generate(url, [prompt], protocol=protocol, max_tokens=MAX_TOKENS)
        expected = reference(prompt)
        assert reply.texts == [expected.text], prompt
        assert reply.finish_reasons == [expected.finish_reason]


def test_grpc_stream_one_response_per_round(server, reference):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for prompt in PROMPTS[:2]:
            client.async_stream_infer("dflash", build_inputs(grpcclient, [prompt], MAX_TOKENS, stream=True))
            chunks, counts, finish = [], [], ""
            while not finish:
                result, error = responses.get(timeout=120)
                assert error is None, error
                chunks.append(result.as_numpy("text_output")[0, 0].decode())
                counts.append(int(result.as_numpy("num_tokens")[0, 0]))
                finish = result.as_numpy("finish_reason")[0, 0].decode()
            expected = reference(prompt)
            # the prefill's first token, then one response per verified round, each with that round's tokens
            assert counts == [1] + expected.stats.acceptance_lengths
            assert len(chunks) == expected.stats.rounds + 1
            assert "".join(chunks) == expected.text
            assert finish == expected.finish_reason
    finally:
        client.stop_stream()
        client.close()


def test_batch_returns_independent_results(server, reference):
    prompts = PROMPTS[:3]
    reply = generate(server.http_url, prompts, protocol="http", max_tokens=MAX_TOKENS)
    assert reply.texts == [reference(p).text for p in prompts]
    streamed = generate(server.grpc_url, prompts, protocol="grpc", stream=True, max_tokens=MAX_TOKENS)
    assert streamed.texts == reply.texts


def test_concurrent_requests_are_independent(server, reference):
    """Requests in flight together (batched by Triton into one BLS execute) each get their own answer."""
    results: dict[int, list[str]] = {}

    def call(i: int) -> None:
        results[i] = generate(server.grpc_url, [PROMPTS[i]], protocol="grpc", stream=True, max_tokens=MAX_TOKENS).texts

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results[i] for i in range(3)] == [[reference(PROMPTS[i]).text] for i in range(3)]


def _raw_infer(server, inputs):
    return httpclient.InferenceServerClient(server.http_url).infer("dflash_sync", inputs)


@pytest.mark.parametrize("case", ["empty text", "max_tokens 0", "max_tokens huge", "wrong dtype"])
def test_bad_inputs_are_triton_errors_and_server_stays_up(server, reference, case):
    if case == "wrong dtype":
        inputs = build_inputs(httpclient, ["def f"])
        wrong = httpclient.InferInput("max_tokens", [1, 1], "FP32")
        wrong.set_data_from_numpy(np.array([[4.0]], dtype=np.float32))
        inputs.append(wrong)
        expected = "data-type is 'FP32', but model 'dflash_sync' expects 'INT32'"
    else:
        prompt, max_tokens, expected = {
            "empty text": ("", 4, "text_input is empty"),
            "max_tokens 0": ("def f", 0, "max_new_tokens must be >= 1"),
            "max_tokens huge": ("def f", 2_000_000_000, "exceeds the target's context length"),
        }[case]
        inputs = build_inputs(httpclient, [prompt], max_tokens)
    with pytest.raises(InferenceServerException, match=expected):
        _raw_infer(server, inputs)
    assert server.alive() and server.ready()
    reply = generate(server.http_url, ["import os"], protocol="http", max_tokens=4)
    assert reply.texts == [reference("import os", 4).text]


def test_cli_client(server, reference, capsys):
    from dflash_trt.cli import main

    assert main(["triton-client", "--url", server.grpc_url, "--prompt", PROMPTS[0], "--max-tokens", str(MAX_TOKENS),
                 "--stream"]) == 0
    assert capsys.readouterr().out == reference(PROMPTS[0]).text + "\n"
    assert main(["triton-client", "--url", server.http_url, "--protocol", "http", "--prompt", "",
                 "--max-tokens", "3"]) == 1
    assert "text_input is empty" in capsys.readouterr().err
