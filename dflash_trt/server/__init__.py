"""HTTP serving: FastAPI app (`app.create_app`), the batching orchestrator, metrics, `dflash-trt serve`."""
