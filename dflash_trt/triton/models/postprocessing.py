"""`postprocessing`: the BLS's token ids so far -> the text added by this response.

Inputs per row: output_ids (all tokens generated so far, padded), output_length, new_tokens (how
many of them this response added), finish_reason ("" while running). Output text_output is the
text delta, so a stream's chunks concatenate to exactly the full decoded text.
"""

from __future__ import annotations

from typing import Any

import triton_python_backend_utils as pb_utils

from ...decoding.detokenizer import text_delta
from ..remote import unpad_rows
from .common import error_response, load_text_model, need, strings


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        _, self.tokenizer = load_text_model(args)

    def execute(self, requests: list[Any]) -> list[Any]:  # pb_utils requests -> responses
        responses = []
        for request in requests:
            try:
                rows = unpad_rows(need(request, "output_ids"), need(request, "output_length"))
                new = need(request, "new_tokens").reshape(-1).tolist()
                finish = [
                    v.decode() if isinstance(v, bytes) else str(v) for v in need(request, "finish_reason").reshape(-1)
                ]
                texts = [text_delta(self.tokenizer, ids, int(n), bool(f)) for ids, n, f in zip(rows, new, finish)]
                responses.append(
                    pb_utils.InferenceResponse([pb_utils.Tensor("text_output", strings(texts, rows=len(texts)))])
                )
            except Exception as e:  # noqa: BLE001 - a bad request must not take the model down
                responses.append(error_response(f"postprocessing: {e}"))
        return responses
