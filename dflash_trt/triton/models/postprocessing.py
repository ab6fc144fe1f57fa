"""`postprocessing`: the BLS's token ids so far -> the text added by this response.

Inputs per row: output_ids (all tokens generated so far, padded), output_length, new_tokens (how
many of them this response added), finish_reason ("" while running). Output text_output is the
text delta, so a stream's chunks concatenate to exactly the full decoded text.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from ...decoding.detokenizer import text_delta
from ..remote import unpad_rows
from .common import error_response, get, load_text_model, strings


class TritonPythonModel:
    def initialize(self, args):
        _, self.tokenizer = load_text_model(args)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                rows = unpad_rows(get(request, "output_ids"), get(request, "output_length"))
                new = get(request, "new_tokens").reshape(-1).tolist()
                finish = [v.decode() if isinstance(v, bytes) else str(v) for v in get(request, "finish_reason").reshape(-1)]
                texts = [text_delta(self.tokenizer, ids, int(n), bool(f)) for ids, n, f in zip(rows, new, finish)]
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", strings(texts, rows=len(texts)))]))
            except Exception as e:  # noqa: BLE001 - a bad request must not take the model down
                responses.append(error_response(f"postprocessing: {e}"))
        return responses
