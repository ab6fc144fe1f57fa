"""`dflash_drafter` on the python backend: the exported ONNX round graph through onnxruntime.

Stateless: the context cache comes in as past_k/past_v and goes out as present_k/present_v, the
same tensors a `tensorrt_plan` drafter model takes, so the BLS drives either the same way.
Imports only onnxruntime and numpy (no torch), so the model loads fast.
"""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from .common import error_response, get, load_config, resolve

# The graph's tensor names (dflash_trt.builders.onnx_drafter.INPUT_NAMES / OUTPUT_NAMES; not imported: torch).
INPUT_NAMES = ("block_ids", "features", "past_k", "past_v")
OUTPUT_NAMES = ("logits", "draft_tokens", "present_k", "present_v")
GRAPHS = {"fp32": "drafter.onnx", "fp16": "drafter_fp16.onnx"}


class TritonPythonModel:
    def initialize(self, args):
        import onnxruntime as ort

        _, params, folder = load_config(args)
        path = resolve(folder, params.get("onnx_dir", "drafter-onnx")) / GRAPHS[params.get("precision", "fp32")]
        options = ort.SessionOptions()
        threads = int(params.get("threads", "0"))
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                feeds = {name: np.ascontiguousarray(get(request, name)) for name in INPUT_NAMES}
                outs = self.session.run(list(OUTPUT_NAMES), feeds)
                responses.append(pb_utils.InferenceResponse(
                    [pb_utils.Tensor(name, np.ascontiguousarray(a)) for name, a in zip(OUTPUT_NAMES, outs)]))
            except Exception as e:  # noqa: BLE001 - report to the caller, keep serving
                responses.append(error_response(f"dflash_drafter: {type(e).__name__}: {e}"))
        return responses
