"""HTTP serving: FastAPI app (`app.create_app`), the round-robin orchestrator, metrics, `dflash-trt serve`."""
