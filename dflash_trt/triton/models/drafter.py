"""`dflash_drafter` on the python backend: the exported ONNX round graph through onnxruntime.

Stateless: the context cache comes in as past_k/past_v and goes out as present_k/present_v, the
same tensors a `tensorrt_plan` drafter model takes, so the BLS drives either the same way.
Imports only onnxruntime, numpy and dflash_trt.formats (no torch), so the model loads fast.
With `graph: batch` it serves the batched round graph instead (dflash_drafter_batch: BATCH_DRAFTER_INPUTS,
a batch axis over rows, ragged via block_lengths / new_lengths / past_lengths).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from ...formats import (
    BATCH_DRAFTER_INPUTS,
    BATCH_DRAFTER_OUTPUTS,
    BATCH_GRAPH_FILES,
    DRAFTER_INPUTS,
    DRAFTER_OUTPUTS,
    GRAPH_FILES,
)
from ...runtime.cpu_threads import ort_session_options
from .common import error_response, load_config, need, resolve


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        import onnxruntime as ort

        _, params, folder = load_config(args)
        batch = params.get("graph", "single") == "batch"
        files = BATCH_GRAPH_FILES if batch else GRAPH_FILES
        self.inputs: tuple[str, ...]
        self.outputs: tuple[str, ...]
        self.inputs, self.outputs = (
            (BATCH_DRAFTER_INPUTS, BATCH_DRAFTER_OUTPUTS) if batch else (DRAFTER_INPUTS, DRAFTER_OUTPUTS)
        )
        path = resolve(folder, params.get("onnx_dir", "drafter-onnx")) / files[params.get("precision", "fp32")]
        options = ort_session_options(ort, int(params.get("threads", "0")))  # no spinning next to the target
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def execute(self, requests: list[Any]) -> list[Any]:  # pb_utils requests -> responses
        responses = []
        for request in requests:
            try:
                feeds = {name: np.ascontiguousarray(need(request, name)) for name in self.inputs}
                outs = self.session.run(list(self.outputs), feeds)
                responses.append(
                    pb_utils.InferenceResponse(
                        [pb_utils.Tensor(name, np.ascontiguousarray(a)) for name, a in zip(self.outputs, outs)]
                    )
                )
            except Exception as e:  # noqa: BLE001 - report to the caller, keep serving
                responses.append(error_response(f"dflash_drafter: {type(e).__name__}: {e}"))
        return responses
