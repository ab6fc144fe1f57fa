"""What the routes share, handed to them by dependency injection (`ServerDep`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from .metrics import ServerMetrics
from .scheduler import Orchestrator
from .schemas import Limits, request_models
from .tokenizer import with_serialized_tokenizer


@dataclass
class ServerSettings:
    api_key: str | None = None
    model_name: str = "dflash-trt"
    max_active: int = 8  # generations advanced concurrently (each holds its own KV caches)
    max_queue: int = 64  # waiting requests beyond max_active; more get 429
    request_timeout_s: float = 300.0
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256  # chat requests without max_tokens (clipped to the context)
    # (completions without max_tokens get OpenAI's 16, /generate its documented 128)
    drain_timeout_s: float = 30.0


class Server:
    """The decoder, the orchestrator, the metrics, the settings, and the limits the request models enforce."""

    def __init__(self, decoder, settings: ServerSettings):
        self.decoder, self.settings = with_serialized_tokenizer(decoder), settings
        self.limits = Limits.from_decoder(self.decoder, settings.model_name)
        self.models = request_models(self.limits)
        self.metrics = ServerMetrics()
        self.orchestrator = Orchestrator(self.decoder, self.metrics, settings.max_active, settings.max_queue)
        self.started = False


def get_server(request: Request) -> Server:
    return request.app.state.server


ServerDep = Annotated[Server, Depends(get_server)]
