"""`dflash_bls`: the batched draft-and-verify step (dflash_trt.decoding.BatchDecoder) over dflash_target
and dflash_drafter.

Inputs per row: input_ids [N, L] + input_length [N, 1] from preprocessing; optional max_tokens
INT32, temperature FP32, seed UINT64, stream BOOL, proposer STRING (a name of
decoding/proposers.PROPOSERS: where the row's drafts come from; default: the model's `proposer` parameter, else
"dflash") ([N, 1]). Batches: every row of every request in
one execute() call is a row of ONE BatchDecoder, so a step is one dflash_target call that verifies every
row (several sessions per call) and one dflash_drafter_batch call for every drafting row (the batched
graph; with only the single-sequence dflash_drafter, one call per drafting row); each row keeps its own
sampling settings and seed.
Decoupled: with stream on, each step sends one response per request (the tokens committed that step);
with it off, one response at the end. A cancelled request leaves the batch at the next step. A failing
step (a target call error) fails every request still running in this execute(), as they share the pass.
Outputs: output_ids (all tokens so far, padded), output_length, new_tokens (added by this response),
finish_reason ("" until done).
No structured outputs: it takes no JSON schema or other grammar. A grammar is compiled against the tokenizer's
vocabulary (decoding/grammar.py), and this model decodes token ids without the tokenizer, which only the
preprocessing and postprocessing models load; `dflash-trt serve` takes them (docs/api.md).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from ...decoding import BatchDecoder, BatchRow, GenerationConfig, InputError, SamplingParams
from ...runtime.base import DrafterEngine
from ..remote import RemoteDrafterEngine, RemoteTargetEngine, pad_rows, unpad_rows
from .common import error_response, load_config, need, scalar, strings, texts

# Triton's python backend (triton_python_backend_utils) is untyped: requests, responses and senders are Any.


def bls_infer(model: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
    """One synchronous call of another model in this server (Business Logic Scripting)."""
    request = pb_utils.InferenceRequest(
        model_name=model,
        requested_output_names=list(outputs),
        inputs=[pb_utils.Tensor(k, np.ascontiguousarray(v)) for k, v in inputs.items()],
    )
    response = request.exec()
    if response.has_error():
        raise RuntimeError(response.error().message())
    return {name: pb_utils.get_output_tensor_by_name(response, name).as_numpy() for name in outputs}


class Job:
    """One request: its rows in the step's BatchDecoder, and how it wants its responses."""

    def __init__(self, request: Any, rows: list[BatchRow], stream: bool):
        self.request, self.rows, self.stream = request, rows, stream

    @property
    def done(self) -> bool:
        return all(r.done for r in self.rows)

    def cancelled(self) -> bool:
        return bool(self.request.is_cancelled())

    def error(self) -> str | None:
        failed = [r for r in self.rows if r.finish_reason == "error"]
        return None if not failed else f"{type(failed[0].error).__name__}: {failed[0].error}"


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config, params, _ = load_config(args)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.target = RemoteTargetEngine(
            bls_infer,
            params.get("target_model", "dflash_target"),
            int(params["vocab_size"]),
            int(params["max_context"]),
            json.loads(params["feature_layer_ids"]),
        )
        meta = json.loads(params["drafter_meta"])
        self.drafter: DrafterEngine
        dtype = params.get("drafter_dtype", "float32")  # what the drafter model computes in (triton-repo writes it)
        if params.get("drafter_batch_model"):  # the batched graph: one drafter call per step
            self.drafter = RemoteDrafterEngine(
                bls_infer, params["drafter_batch_model"], meta, batched=True, dtype=dtype
            )
        else:  # the single-sequence graph: one call per drafting row
            self.drafter = RemoteDrafterEngine(
                bls_infer, params.get("drafter_model", "dflash_drafter"), meta, dtype=dtype
            )
        self.stop_ids = tuple(json.loads(params.get("stop_token_ids", "[]")))
        self.default_max_tokens = int(params.get("default_max_tokens", "64"))
        self.proposer = params.get("proposer", "dflash")

    def _job(self, decoder: BatchDecoder, request: Any) -> Job:
        prompts = unpad_rows(need(request, "input_ids"), need(request, "input_length"))
        n = len(prompts)
        max_tokens = scalar(request, "max_tokens", self.default_max_tokens, n)
        temperature = scalar(request, "temperature", 0.0, n)
        seed = scalar(request, "seed", None, n)
        stream = any(scalar(request, "stream", False, n))
        proposer = texts(request, "proposer", self.proposer, n)
        rows: list[BatchRow] = []
        try:
            for prompt, mt, t, s, p in zip(prompts, max_tokens, temperature, seed, proposer):
                config = GenerationConfig(
                    max_new_tokens=int(mt),
                    sampling=SamplingParams(float(t), seed=s),
                    stop_token_ids=self.stop_ids,
                    proposer=p,
                )
                rows.append(decoder.add(prompt, config))
        except BaseException:
            for r in rows:
                decoder.cancel(r)
            raise
        return Job(request, rows, stream and self.decoupled)

    @staticmethod
    def _response(job: Job, new: list[int]) -> Any:
        ids, lengths = pad_rows([r.generated for r in job.rows])
        return pb_utils.InferenceResponse(
            [
                pb_utils.Tensor("output_ids", ids),
                pb_utils.Tensor("output_length", lengths),
                pb_utils.Tensor("new_tokens", np.array(new, dtype=np.int32).reshape(-1, 1)),
                pb_utils.Tensor("finish_reason", strings([r.finish_reason or "" for r in job.rows], rows=1)),
            ]
        )

    def execute(self, requests: list[Any]) -> list[Any] | None:  # None when decoupled (responses were sent)
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        results: dict[int, object] = {}  # request index -> its one response (not decoupled)
        senders = [r.get_response_sender() for r in requests] if self.decoupled else []
        decoder = BatchDecoder(self.target, self.drafter)  # this call's rows; their sessions end with it

        def finish(i: int, response: Any) -> None:
            """The request's last response. Never raises: a client that is gone cannot be told more."""
            if not self.decoupled:
                results[i] = response
                return
            try:
                senders[i].send(response, flags=final)
            except Exception:  # noqa: BLE001
                pass

        def end(i: int, job: Job, response: Any) -> None:
            for r in job.rows:
                decoder.cancel(r)  # frees its rows now (a no-op for finished ones)
            finish(i, response)

        jobs: list[tuple[int, Job]] = []
        for i, request in enumerate(requests):
            try:
                jobs.append((i, self._job(decoder, request)))
            except (InputError, ValueError, TypeError) as e:
                finish(i, error_response(f"dflash_bls: {e}"))
            except Exception as e:  # noqa: BLE001 - e.g. the target unreachable: this request fails, not the batch
                finish(i, error_response(f"dflash_bls: {type(e).__name__}: {e}"))
        started = list(jobs)
        totals = {i: [0] * len(job.rows) for i, job in jobs}
        try:
            while jobs:
                live = []
                for i, job in jobs:  # the client went away: its rows leave the batch before the next step
                    if job.cancelled():
                        end(i, job, error_response("dflash_bls: request cancelled", cancelled=True))
                    else:
                        live.append((i, job))
                jobs = live
                if not jobs:
                    break
                try:
                    rounds = decoder.step()  # one verified round of every live row
                except Exception as e:  # noqa: BLE001 - the rows share the pass: every request still running fails
                    for i, job in jobs:
                        end(i, job, error_response(f"dflash_bls: {type(e).__name__}: {e}"))
                    break
                committed = {id(row): len(rnd.token_ids) for row, rnd in rounds}
                still = []
                for i, job in jobs:
                    try:
                        new = [committed.get(id(r), 0) for r in job.rows]
                        totals[i] = [a + b for a, b in zip(totals[i], new)]
                        if job.error():
                            end(i, job, error_response(f"dflash_bls: {job.error()}"))
                            continue
                        if job.done:
                            end(i, job, self._response(job, new if job.stream else totals[i]))
                            continue
                        if job.stream and any(new):
                            senders[i].send(self._response(job, new))
                        still.append((i, job))
                    except Exception as e:  # noqa: BLE001 - one failing request must not stop the others
                        end(i, job, error_response(f"dflash_bls: {type(e).__name__}: {e}"))
                jobs = still
        finally:  # even if something escaped the loop, no session outlives this call
            for _, job in started:
                for r in job.rows:
                    decoder.cancel(r)
        return None if self.decoupled else [results[i] for i in range(len(requests))]
