"""Run the app under uvicorn: JSON logging, the listening line, drain on the first SIGTERM."""

from __future__ import annotations

import json
import logging
import sys
import threading

LISTENING_EVENT = "listening"  # stderr: {"event": "listening", "host": ..., "port": N} once the socket is bound


def setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("dflash_trt.server")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def serve_app(app, host: str, port: int) -> None:
    """Run uvicorn; the first SIGTERM/SIGINT drains (new requests 503), a second one exits at once."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        draining = False

        def handle_exit(self, sig, frame):
            if self.draining:  # second signal: stop now
                self.force_exit = True
                return super().handle_exit(sig, frame)
            self.draining = True
            threading.Thread(target=self._drain, name="dflash-drain", daemon=True).start()

        def _drain(self):
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
    config = uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=5, lifespan="on")
    sock = config.bind_socket()  # bound here so that --port 0 can report the port it got
    logging.getLogger("dflash_trt.server").info(
        json.dumps({"event": LISTENING_EVENT, "host": host, "port": sock.getsockname()[1]}))
    DrainingServer(config).run(sockets=[sock])
