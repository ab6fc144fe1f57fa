"""Run the app under uvicorn: JSON logging, the listening line, drain on the first SIGTERM."""

from __future__ import annotations

import gc
import json
import logging
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio
    import socket
    from types import FrameType

    import uvicorn
    from fastapi import FastAPI

LISTENING_EVENT = "listening"  # stderr: {"event": "listening", "host": ..., "port": N} once connections are accepted


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]  # its stream is sys.stderr, whatever it is
    """Writes each record to sys.stderr as it is at that moment, not the stream of the moment it was made:
    `serve` run inside a process that swaps sys.stderr (a test's capture, closed when the test ends) would
    otherwise leave a handler that fails on every later record."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # StreamHandler.__init__ sets it; the property decides


def setup_logging() -> None:
    """The server's log lines, bare (each is JSON), on stderr; called again, it adds no second handler."""
    logger = logging.getLogger("dflash_trt.server")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _http_protocol() -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools if installed, else h11), whose answer to a request it cannot
    parse (a negative Content-Length, a broken request line) is our JSON error body, not plain text."""
    if TYPE_CHECKING:  # uvicorn picks one of the two at import time; both have the same interface
        from uvicorn.protocols.http.h11_impl import H11Protocol as AutoHTTPProtocol
    else:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from .schemas import error_body

    class JsonErrorProtocol(AutoHTTPProtocol):
        def send_400_response(self, msg: str) -> None:
            body = json.dumps(error_body(f"malformed HTTP request: {msg}", code="bad_http_request")).encode()
            head = (
                b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            )
            self.transport.write(head + body)
            self.transport.close()

    return JsonErrorProtocol


def serve_app(app: FastAPI, host: str, port: int) -> None:
    """Run uvicorn; the first SIGTERM/SIGINT drains (new requests 503), a second one exits at once. The process's
    heap as it stands (the modules, the engines) is first frozen out of the garbage collector (`freeze_heap`)."""
    server, sock = make_server(app, host, port)
    freeze_heap()
    server.run(sockets=[sock])


def freeze_heap() -> None:
    """Collect, then move every object alive into the collector's permanent generation (`gc.freeze`), as vLLM
    does once its server has started (`freeze_gc_heap`, vllm/utils/gc_utils.py): a full collection otherwise
    walks every object that torch, transformers and the engines made at start-up, a pause of tens of ms on the
    loop's thread at an unforeseeable step. Objects made later are still collected. For a serving process only:
    what it freezes is never freed."""
    gc.collect()
    gc.freeze()


def make_server(app: FastAPI, host: str, port: int) -> tuple[uvicorn.Server, socket.socket]:
    """(uvicorn server, its bound socket): `server.run(sockets=[sock])` serves until told to stop."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        draining = False

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:  # the app started and the socket listens: a client may connect now
                assert sockets is not None  # serve_app runs it with its socket
                logging.getLogger("dflash_trt.server").info(
                    json.dumps({"event": LISTENING_EVENT, "host": host, "port": sockets[0].getsockname()[1]})
                )

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.draining:  # second signal: stop now
                self.force_exit = True
                return super().handle_exit(sig, frame)
            self.draining = True
            threading.Thread(target=self._drain, name="dflash-drain", daemon=True).start()

        def _drain(self) -> None:
            server = app.state.server
            orch, limit = server.orchestrator, server.settings.drain_timeout_s
            log = logging.getLogger("dflash_trt.server")
            log.info('{"event": "drain", "in_flight": %d, "limit_s": %s}', orch.busy, limit)
            orch.begin_drain()
            if not orch.wait_idle(limit):
                orch.cancel_all("shutdown", "the server is shutting down (drain limit reached)")
                orch.wait_idle(5.0)
            self.should_exit = True

    # access_log off: the app writes its own JSON line per request; "info" keeps uvicorn's "running on" line.
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
        http=_http_protocol(),
    )
    sock = config.bind_socket()  # bound here so that --port 0 can report the port it got
    return DrainingServer(config), sock
