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
from helpers import generate_one, make_text_models  # noqa: E402
from server_harness import HANG_S  # noqa: E402
from triton_fixtures import CHAT_PRE, add_chat_preprocessing  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from dflash_trt.builders.triton_repo import write_repository  # noqa: E402
from dflash_trt.decoding import GenerationConfig  # noqa: E402
from dflash_trt.loading import load_decoder  # noqa: E402
from dflash_trt.triton.client import build_inputs, generate  # noqa: E402
from dflash_trt.triton.server import TritonServer, TritonUnavailable, server_env  # noqa: E402

PROMPTS = ["def fibonacci(n):", "for i in range(10):", "class Point:", "import os"]
MAX_TOKENS = 14


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-server")
    target, drafter = make_text_models(root)
    return root, target, drafter


@pytest.fixture(scope="module")
def server(models):
    root, target, drafter = models
    try:
        server_env()
    except TritonUnavailable as e:
        pytest.skip(f"no tritonserver on this machine: {e}")
    repo = write_repository(root / "repo", target=target, drafter=drafter)
    chat_tokenizer = add_chat_preprocessing(repo)
    server = TritonServer(repo, log_path=root / "tritonserver.log")
    server.chat_tokenizer = chat_tokenizer  # the chat preprocessing model's tokenizer folder
    try:
        server.start(timeout_s=HANG_S)
        yield server
    finally:
        server.stop()
    assert not server.alive()


@pytest.fixture(scope="module")
def reference(models):
    """What `dflash-trt generate` computes on the same checkpoints (BatchDecoder.generate, one request alone), in this process."""
    _, target, drafter = models
    decoder = load_decoder(target, drafter)

    def run(prompt: str, max_tokens: int = MAX_TOKENS):
        config = GenerationConfig(max_new_tokens=max_tokens, stop_token_ids=decoder.default_stop_ids())
        return generate_one(decoder, decoder.encode(prompt), config)

    return run


def test_greedy_reference_is_the_target_alone(models, reference):
    """The reference itself is lossless: speculative greedy == the target's own greedy decoding."""
    _, target, _ = models
    alone = load_decoder(target, None)
    for prompt in PROMPTS[:2]:
        ids = alone.encode(prompt)
        plain = generate_one(
            alone, ids, GenerationConfig(max_new_tokens=MAX_TOKENS, stop_token_ids=alone.default_stop_ids())
        )
        assert reference(prompt).token_ids == plain.token_ids


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_ensemble_text_equals_generate(server, reference, protocol):
    url = server.http_url if protocol == "http" else server.grpc_url
    for prompt in PROMPTS:
        reply = generate(url, [prompt], protocol=protocol, max_tokens=MAX_TOKENS)
        expected = reference(prompt)
        assert reply.texts == [expected.text], prompt
        assert reply.finish_reasons == [expected.finish_reason]


@pytest.mark.parametrize("proposer", ["suffix", "hybrid"])
def test_the_proposer_input_keeps_the_text(server, reference, proposer):
    """The BLS model's optional `proposer` input (decoding/proposers.py): greedy text is the target's whatever
    drafts it; an unknown proposer is a request error."""
    for prompt in PROMPTS[:2]:
        reply = generate(server.grpc_url, [prompt], protocol="grpc", max_tokens=MAX_TOKENS, proposer=proposer)
        assert reply.texts == [reference(prompt).text], prompt
    with pytest.raises(Exception, match="proposer must be one of"):
        generate(server.grpc_url, [PROMPTS[0]], protocol="grpc", max_tokens=4, proposer="eagle")


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

    assert (
        main(
            [
                "triton-client",
                "--url",
                server.grpc_url,
                "--prompt",
                PROMPTS[0],
                "--max-tokens",
                str(MAX_TOKENS),
                "--stream",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == reference(PROMPTS[0]).text + "\n"
    assert (
        main(["triton-client", "--url", server.http_url, "--protocol", "http", "--prompt", "", "--max-tokens", "3"])
        == 1
    )
    assert "text_input is empty" in capsys.readouterr().err


def _target_call(client, sid: int, tokens: list[int], cache_length: int, release: bool = False):
    inputs = []
    for name, dtype, value in (
        ("session_id", "UINT64", np.array([sid], np.uint64)),
        ("token_ids", "INT64", np.array(tokens, np.int64)),
        ("cache_length", "INT64", np.array([cache_length], np.int64)),
        ("release", "BOOL", np.array([release])),
    ):
        t = httpclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        inputs.append(t)
    return client.infer("dflash_target", inputs)


def test_target_session_released_or_expired_is_an_error(server):
    """dflash_target never silently restarts an unknown session at position 0 (wrong logits)."""
    client = httpclient.InferenceServerClient(server.http_url)
    sid = 123456789
    assert int(_target_call(client, sid, [5, 6, 7], 0).as_numpy("length")[0]) == 3
    assert int(_target_call(client, sid, [8], 3).as_numpy("length")[0]) == 4
    with pytest.raises(InferenceServerException, match="holds 4 cached tokens but its caller expects 9"):
        _target_call(client, sid, [9], 9)
    _target_call(client, sid, [], 0, release=True)
    with pytest.raises(InferenceServerException, match=f"session expired: {sid} "):
        _target_call(client, sid, [9], 4)
    assert server.alive()


def test_chat_template_preprocessing(server):
    """chat_template on: the prompt is one user message rendered by the tokenizer's template (as the
    HTTP server's chat route does), then encoded; before the fix this mode failed on every request."""
    from transformers import AutoTokenizer

    from dflash_trt.decoding.prompting import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(server.chat_tokenizer)
    text = httpclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"def f"]], dtype=np.object_))
    result = httpclient.InferenceServerClient(server.http_url).infer(CHAT_PRE, [text])
    ids = result.as_numpy("input_ids")[0, : int(result.as_numpy("input_length")[0, 0])].tolist()
    assert tok.decode(ids) == "<user>def f<assistant>"
    assert ids == chat_prompt_ids(tok, [{"role": "user", "content": "def f"}])


def _target_calls(client, model: str = "dflash_target") -> int:
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]["inference_stats"]
    return sum(int(stats[k].get("count", 0)) for k in ("success", "fail"))


def test_cancelled_stream_stops_the_loop(server, reference, models):
    """A client that cancels its stream stops the BLS within a round: dflash_target gets no more calls
    (without the is_cancelled check it ran on to max_tokens).

    When the cancelled loop has ended is read from Triton's order, not from a quiet second: dflash_bls has one
    instance and a synchronous execute, so a later request to it runs only after the cancelled one's execute
    returned. Its answer marks the end; its own target calls (those of one more such request) are taken off."""
    from transformers import AutoTokenizer

    max_tokens = 160
    expected = reference(PROMPTS[0], max_tokens)
    assert expected.finish_reason == "length" and expected.stats.rounds >= 40  # a long run to cut short
    ids = AutoTokenizer.from_pretrained(models[1]).encode(PROMPTS[0], add_special_tokens=False)

    def bls_inputs(tokens: int, stream: bool) -> list:
        inputs = []
        for name, dtype, value in (
            ("input_ids", "INT64", np.array([ids], np.int64)),
            ("input_length", "INT32", np.array([[len(ids)]], np.int32)),
            ("max_tokens", "INT32", np.array([[tokens]], np.int32)),
            ("stream", "BOOL", np.array([[stream]])),
        ):
            t = grpcclient.InferInput(name, list(value.shape), dtype)
            t.set_data_from_numpy(value)
            inputs.append(t)
        return inputs

    def target_calls_of_one_short_request() -> int:
        """dflash_target's calls up to the answer of one unstreamed 2-token request to dflash_bls."""
        start, answers = _target_calls(client), queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            client.async_stream_infer("dflash_bls", bls_inputs(2, stream=False))
            result, error = answers.get(timeout=120)
            assert error is None, error
        finally:
            client.stop_stream()
        return _target_calls(client) - start

    client = grpcclient.InferenceServerClient(server.grpc_url)
    before = _target_calls(client)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("dflash_bls", bls_inputs(max_tokens, stream=True))
        for _ in range(2):
            result, error = responses.get(timeout=60)
            assert error is None, error
    finally:
        client.stop_stream(cancel_requests=True)
    target_calls_of_one_short_request()  # answered once the cancelled request's execute has returned
    after = _target_calls(client)
    short = target_calls_of_one_short_request()  # greedy: the same calls again, alone
    assert short > 0
    calls = after - before - short
    client.close()
    print(f"target calls after cancelling: {calls} of {expected.stats.rounds} rounds")
    assert calls < expected.stats.rounds // 2, (calls, expected.stats.rounds)
    assert server.alive()


def test_batched_request_equals_each_row_alone_in_fewer_target_calls(server):
    """Every row of a request is a row of one batched step: greedy, a batch returns what each prompt returns
    alone, and dflash_target is called once per step for all rows (not once per row and round)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)  # for the call counts
    alone, alone_calls = [], 0
    for prompt in PROMPTS:
        before = _target_calls(client)
        alone.append(generate(server.http_url, [prompt], protocol="http", max_tokens=MAX_TOKENS).texts[0])
        alone_calls += _target_calls(client) - before
    before = _target_calls(client)
    drafts = [_target_calls(client, m) for m in ("dflash_drafter", "dflash_drafter_batch")]
    batched = generate(server.http_url, PROMPTS, protocol="http", max_tokens=MAX_TOKENS).texts
    batch_calls = _target_calls(client) - before
    assert batched == alone
    # every drafting row of a step in one call of the batched graph; the single-sequence drafter unused
    assert _target_calls(client, "dflash_drafter") == drafts[0]
    assert 0 < _target_calls(client, "dflash_drafter_batch") - drafts[1] < batch_calls
    print(f"dflash_target calls: {batch_calls} for the batch of {len(PROMPTS)}, {alone_calls} one by one")
    assert batch_calls < alone_calls
    client.close()
