"""`dflash_bls`: the draft-and-verify loop (dflash_trt.decoding, unchanged) over dflash_target and dflash_drafter.

Inputs per row: input_ids [N, L] + input_length [N, 1] from preprocessing; optional max_tokens
INT32, temperature FP32, seed UINT64, stream BOOL ([N, 1]). Batches: every row of every request in
one execute() call is its own Generation, and the loop steps them round-robin, one verified round
each per pass, so sequences never wait for each other's whole generation. Decoupled: with stream
on, each pass sends one response per request (the tokens committed that round); with it off, one
response at the end. Outputs: output_ids (all tokens so far, padded), output_length, new_tokens
(added by this response), finish_reason ("" until done).
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from ...decoding import GenerationConfig, InputError, SamplingParams, SpeculativeDecoder
from ..bls import RemoteDrafterEngine, RemoteTargetEngine, pad_rows, unpad_rows
from .common import error_response, get, load_config, scalar, strings


def bls_infer(model: str, inputs: dict, outputs: list) -> dict:
    """One synchronous call of another model in this server (Business Logic Scripting)."""
    request = pb_utils.InferenceRequest(model_name=model, requested_output_names=list(outputs),
                                        inputs=[pb_utils.Tensor(k, np.ascontiguousarray(v)) for k, v in inputs.items()])
    response = request.exec()
    if response.has_error():
        raise RuntimeError(response.error().message())
    return {name: pb_utils.get_output_tensor_by_name(response, name).as_numpy() for name in outputs}


class Job:
    """One request: its rows' generations, and how it wants its responses."""

    def __init__(self, request, generations, stream: bool):
        self.request, self.generations, self.stream = request, generations, stream
        self.closed = False

    @property
    def done(self) -> bool:
        return all(g.done for g in self.generations)

    def cancelled(self) -> bool:
        return bool(self.request.is_cancelled())

    def close(self) -> None:
        """Release the target sessions now (idempotent; their TTL is only the last resort)."""
        if not self.closed:
            self.closed = True
            for g in self.generations:
                g.target_session.close()


class TritonPythonModel:
    def initialize(self, args):
        config, params, _ = load_config(args)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        target = RemoteTargetEngine(bls_infer, params.get("target_model", "dflash_target"), int(params["vocab_size"]),
                                    int(params["max_context"]), json.loads(params["feature_layer_ids"]))
        drafter = RemoteDrafterEngine(bls_infer, params.get("drafter_model", "dflash_drafter"),
                                      json.loads(params["drafter_meta"]))
        self.decoder = SpeculativeDecoder(target, drafter, None)
        self.stop_ids = tuple(json.loads(params.get("stop_token_ids", "[]")))
        self.default_max_tokens = int(params.get("default_max_tokens", "64"))

    def _job(self, request) -> Job:
        prompts = unpad_rows(get(request, "input_ids"), get(request, "input_length"))
        n = len(prompts)
        max_tokens = scalar(request, "max_tokens", self.default_max_tokens, n)
        temperature = scalar(request, "temperature", 0.0, n)
        seed = scalar(request, "seed", None, n)
        stream = any(scalar(request, "stream", False, n))
        gens = []
        try:
            for prompt, mt, t, s in zip(prompts, max_tokens, temperature, seed):
                config = GenerationConfig(max_new_tokens=int(mt), sampling=SamplingParams(float(t), seed=s),
                                          stop_token_ids=self.stop_ids)
                gens.append(self.decoder.start(prompt, config))
        except BaseException:
            for g in gens:
                g.target_session.close()
            raise
        return Job(request, gens, stream and self.decoupled)

    @staticmethod
    def _response(job: Job, new: list[int]):
        ids, lengths = pad_rows([g.generated for g in job.generations])
        return pb_utils.InferenceResponse([
            pb_utils.Tensor("output_ids", ids),
            pb_utils.Tensor("output_length", lengths),
            pb_utils.Tensor("new_tokens", np.array(new, dtype=np.int32).reshape(-1, 1)),
            pb_utils.Tensor("finish_reason", strings([g.finish_reason or "" for g in job.generations], rows=1)),
        ])

    def execute(self, requests):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        results: dict[int, object] = {}  # request index -> its one response (not decoupled)
        jobs: list[tuple[int, Job]] = []

        senders = [r.get_response_sender() for r in requests] if self.decoupled else []

        def finish(i: int, response) -> None:
            """The request's last response. Never raises: a client that is gone cannot be told more."""
            if not self.decoupled:
                results[i] = response
                return
            try:
                senders[i].send(response, flags=final)
            except Exception:  # noqa: BLE001
                pass

        for i, request in enumerate(requests):
            try:
                job = self._job(request)
            except (InputError, ValueError, TypeError) as e:
                finish(i, error_response(f"dflash_bls: {e}"))
                continue
            except Exception as e:  # noqa: BLE001 - e.g. the target unreachable: this request fails, not the batch
                finish(i, error_response(f"dflash_bls: {type(e).__name__}: {e}"))
                continue
            jobs.append((i, job))
        started = [job for _, job in jobs]
        # Round-robin: one verified round of every live sequence per pass.
        totals = {i: [0] * len(job.generations) for i, job in jobs}
        try:
            while jobs:
                still = []
                for i, job in jobs:
                    # Everything one job does in a pass, sending included, is in here: whatever fails
                    # ends that job (sessions released, error + FINAL sent) and only that job.
                    try:
                        if job.cancelled():  # the client went away: stop spending rounds on it
                            job.close()
                            finish(i, error_response("dflash_bls: request cancelled", cancelled=True))
                            continue
                        new = [len(g.step().token_ids) if not g.done else 0 for g in job.generations]
                        totals[i] = [a + b for a, b in zip(totals[i], new)]
                        if job.done:
                            job.close()
                            finish(i, self._response(job, new if job.stream else totals[i]))
                            continue
                        if job.stream and any(new):
                            senders[i].send(self._response(job, new))
                        still.append((i, job))
                    except Exception as e:  # noqa: BLE001 - one failing request must not stop the others
                        job.close()
                        finish(i, error_response(f"dflash_bls: {type(e).__name__}: {e}"))
                jobs = still
        finally:  # even if something escaped the loop, no session outlives this call
            for job in started:
                job.close()
        return None if self.decoupled else [results[i] for i in range(len(requests))]
