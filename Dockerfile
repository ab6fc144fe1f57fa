# dflash-trt images. Not built in this workplace (no Docker engine); kept minimal and in step with the Makefile.
#
#   GPU: docker build --target gpu -t dflash-trt:gpu .
#        docker run --gpus all -v $PWD/models:/app/models dflash-trt:gpu          # make engines, then serve
#   CPU: docker build --target cpu -t dflash-trt:cpu . && docker run dflash-trt:cpu   # the demo
#
# GPU base: NVIDIA's Triton + TensorRT-LLM container line, release 25.12 = TensorRT-LLM 1.2.x with
# TensorRT 10.14 (the last line with the TensorRT engine path that `make engines` uses for the target).

# ---- CPU: the demo on PyTorch + ONNX Runtime -----------------------------------------------------
FROM python:3.11-slim AS cpu
RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md Makefile engines.toml ./
COPY dflash_trt ./dflash_trt
COPY scripts ./scripts
RUN make venv
CMD ["make", "demo"]

# ---- GPU: TensorRT plans + tensor-parallel TensorRT-LLM target, served over HTTP -----------------
FROM nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3 AS gpu
WORKDIR /app
COPY pyproject.toml README.md Makefile engines.toml ./
COPY dflash_trt ./dflash_trt
COPY scripts ./scripts
# The container's own torch, tensorrt and tensorrt_llm stay; install the project without touching them.
RUN python3 -m pip install --no-cache-dir --no-deps -e . && \
    python3 -m pip install --no-cache-dir "transformers>=5.0,<6" safetensors tokenizers onnx onnxruntime onnxscript \
        fastapi uvicorn pydantic prometheus-client httpx && \
    mkdir -p .venv/bin && ln -s "$(command -v python3)" .venv/bin/python && \
    ln -s "$(command -v dflash-trt)" .venv/bin/dflash-trt && touch .venv/.installed
ENV DFLASH_TRT_MODELS=/app/models
EXPOSE 8000
# Engines depend on the GPU they run on, so they are built at start (hash-checked: a restart rebuilds nothing).
# With tp > 1 in engines.toml, serve under `mpirun -n <tp> --allow-run-as-root` as TensorRT-LLM requires.
CMD ["bash", "-c", "make engines && .venv/bin/dflash-trt serve --engines engines --host 0.0.0.0 --port 8000"]
