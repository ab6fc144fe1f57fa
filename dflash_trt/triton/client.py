"""`dflash-trt triton-client`: the reference client for the `dflash` ensembles (tritonclient).

HTTP and unary gRPC call `dflash_sync` (one response); `--stream` (gRPC) calls the decoupled
`dflash` ensemble and prints each verified round's text as it arrives.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# tritonclient is untyped: its InferInput, results and errors are Any here.


@dataclass
class Reply:
    texts: list[str]  # one per prompt
    finish_reasons: list[str]
    chunks: list[list[str]] = field(default_factory=list)  # per response (streaming): one text per prompt


def _module(protocol: str) -> Any:  # tritonclient.http or tritonclient.grpc (untyped)
    if protocol not in ("http", "grpc"):
        raise ValueError(f"protocol must be http or grpc, got {protocol!r}")
    try:
        if protocol == "http":
            import tritonclient.http as mod
        else:
            import tritonclient.grpc as mod
    except ImportError as e:
        raise RuntimeError("the Triton client needs `tritonclient`: pip install 'dflash-trt[triton]'") from e
    return mod


def build_inputs(
    mod: Any,
    prompts: list[str],
    max_tokens: int | None = None,
    temperature: float | None = None,
    seed: int | None = None,
    stream: bool | None = None,
    proposer: str | None = None,
) -> list[Any]:
    n = len(prompts)

    def add(name: str, dtype: str, array: np.ndarray) -> None:
        t = mod.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        out.append(t)

    out: list[Any] = []
    add("text_input", "BYTES", np.array([[p.encode("utf-8")] for p in prompts], dtype=np.object_))
    if max_tokens is not None:
        add("max_tokens", "INT32", np.full((n, 1), max_tokens, dtype=np.int32))
    if temperature is not None:
        add("temperature", "FP32", np.full((n, 1), temperature, dtype=np.float32))
    if seed is not None:
        add("seed", "UINT64", np.full((n, 1), seed, dtype=np.uint64))
    if stream is not None:
        add("stream", "BOOL", np.full((n, 1), stream, dtype=bool))
    if proposer is not None:
        add("proposer", "BYTES", np.array([[proposer.encode("utf-8")]] * n, dtype=np.object_))
    return out


def _strings(result: Any, name: str) -> list[str]:
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in result.as_numpy(name).reshape(-1)]


def generate(
    url: str,
    prompts: list[str],
    *,
    protocol: str = "grpc",
    stream: bool = False,
    max_tokens: int | None = None,
    temperature: float | None = None,
    seed: int | None = None,
    proposer: str | None = None,
    on_chunk: Callable[[list[str]], None] | None = None,
    timeout_s: float = 300,
) -> Reply:
    mod = _module(protocol)
    if stream and protocol != "grpc":
        raise ValueError("streaming needs gRPC (Triton's HTTP endpoint refuses decoupled models)")
    client = mod.InferenceServerClient(url)
    if not stream:
        result = client.infer(
            "dflash_sync", build_inputs(mod, prompts, max_tokens, temperature, seed, proposer=proposer)
        )
        return Reply(_strings(result, "text_output"), _strings(result, "finish_reason"))
    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()  # (result, error)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("dflash", build_inputs(mod, prompts, max_tokens, temperature, seed, True, proposer))
        reply = Reply([""] * len(prompts), [""] * len(prompts))
        while not all(reply.finish_reasons):
            result, error = responses.get(timeout=timeout_s)
            if error is not None:
                raise error
            chunk = _strings(result, "text_output")
            reply.chunks.append(chunk)
            reply.texts = [a + b for a, b in zip(reply.texts, chunk)]
            reply.finish_reasons = _strings(result, "finish_reason")
            if on_chunk:
                on_chunk(chunk)
        return reply
    finally:
        client.stop_stream()
        client.close()
