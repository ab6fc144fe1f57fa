"""`preprocessing`: text_input [N, 1] -> input_ids [N, L] (padded) + input_length [N, 1].

Encodes as `dflash-trt generate --prompt` does (no special tokens); with the parameter
`chat_template: "true"` the text is one user message rendered by the tokenizer's chat template
(dflash_trt.decoding.prompting, as the HTTP server's /v1/chat/completions does).
"""

from __future__ import annotations

from typing import Any

import triton_python_backend_utils as pb_utils

from ...decoding.prompting import chat_prompt_ids
from ..remote import pad_rows
from .common import error_response, load_text_model, need


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        params, self.tokenizer = load_text_model(args)
        self.chat = params.get("chat_template", "false") == "true"
        if self.chat and not getattr(self.tokenizer, "chat_template", None):
            raise RuntimeError("chat_template is on but the tokenizer has no chat template")

    def encode(self, text: str) -> list[int]:
        if self.chat:  # the HTTP server's chat route renders prompts the same way
            return chat_prompt_ids(self.tokenizer, [{"role": "user", "content": text}])
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def execute(self, requests: list[Any]) -> list[Any]:  # pb_utils requests -> responses
        responses = []
        for request in requests:
            try:
                texts = [
                    v.decode("utf-8") if isinstance(v, bytes) else str(v)
                    for v in need(request, "text_input").reshape(-1)
                ]
                if any(not t for t in texts):
                    raise ValueError("text_input is empty")
                rows = [self.encode(t) for t in texts]
                if any(not r for r in rows):
                    raise ValueError("text_input encodes to no tokens")
                ids, lengths = pad_rows(rows)
                responses.append(
                    pb_utils.InferenceResponse(
                        [pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("input_length", lengths)]
                    )
                )
            except (ValueError, UnicodeDecodeError) as e:
                responses.append(error_response(f"preprocessing: {e}"))
        return responses
