# dflash-trt images. NOT BUILT in this project's workplace (no Docker engine, no GPU): written against NVIDIA's
# published container contents, kept minimal and in step with the Makefile.
#
#   GPU: docker build --target gpu -t dflash-trt:gpu .
#        docker run --gpus all --shm-size=2g -p 8000:8000 dflash-trt:gpu          # make engines, then serve
#   CPU: docker build --target cpu -t dflash-trt:cpu . && docker run dflash-trt:cpu   # the demo
#
# GPU base: Triton's TensorRT-LLM container line. From Triton's release compatibility matrix
# (triton-inference-server/server, docs/introduction/compatibility.md): 25.12-26.02 ship TensorRT-LLM 1.1.0 with
# TensorRT 10.13.3; 26.03 ships TensorRT-LLM 1.2.0; 26.04-26.07 ship TensorRT-LLM 1.2.1 with TensorRT 10.14.1.48,
# torch 2.10.0a0 (NVIDIA build), Python 3.12, CUDA 13.1, driver >= 590. 1.2.x is the last TensorRT-LLM line with the
# TensorRT engine path (trtllm-build) that `make engines` uses for the target. TensorRT-LLM 1.2 pins
# transformers==4.57.1, which this project supports (CI leg `make test-tf457`).
ARG TRITON_TRTLLM_IMAGE=nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3

# ---- CPU: the demo on PyTorch + ONNX Runtime -----------------------------------------------------
FROM python:3.11-slim AS cpu
RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*
# constraints-cpu.txt pins torch 2.13.0; PyTorch's CPU index supplies the CPU build of it (PyPI's is CUDA).
ENV PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# The runtime user, never root: uid 10001, as the gpu stage and deploy/k8s (runAsUser); it owns /app and its venv.
RUN groupadd --gid 10001 dflash && useradd --uid 10001 --gid 10001 --create-home --shell /bin/bash dflash && \
    install -d -o 10001 -g 10001 /app
WORKDIR /app
COPY --chown=10001:10001 pyproject.toml README.md Makefile engines.toml constraints-cpu.txt ./
COPY --chown=10001:10001 dflash_trt ./dflash_trt
COPY --chown=10001:10001 scripts ./scripts
COPY --chown=10001:10001 models ./models
USER 10001
RUN make venv
CMD ["make", "demo"]

# ---- GPU: TensorRT plans + tensor-parallel TensorRT-LLM target, served over HTTP -----------------
FROM ${TRITON_TRTLLM_IMAGE} AS gpu
# The launcher of multi-node groups (deploy/k8s/base/scripts/serve.sh): sshd on the workers, ssh on the leader
# (/run/sshd: sshd's privilege separation folder, as kubeflow/mpi-operator's build/base/Dockerfile makes it). The
# image records where its Open MPI lives (/opt/hpcx/ompi in NVIDIA's images) for `mpirun --prefix`, and the build
# fails if there is none: the ssh sessions on other nodes find orted only through that prefix.
# make: `make gpu-smoke` / `make engines` in the image (NVIDIA's images ship without it).
RUN apt-get update && apt-get install -y --no-install-recommends make openssh-server openssh-client && \
    rm -rf /var/lib/apt/lists/* && mkdir -p /run/sshd && \
    dirname "$(dirname "$(readlink -f "$(command -v mpirun)")")" > /etc/dflash-mpi-prefix && \
    test -x "$(cat /etc/dflash-mpi-prefix)/bin/orted" && cat /etc/dflash-mpi-prefix
WORKDIR /app
COPY pyproject.toml README.md Makefile engines.toml constraints-cpu.txt ./
COPY dflash_trt ./dflash_trt
COPY scripts ./scripts
# engines.toml and DFLASH_TRT_MODELS point here: the default command and gpu-smoke need the demo models.
COPY models ./models
# gpu-smoke's tiny random pair (a target whose heads split at tp 2) comes from this factory.
COPY tests/tiny_models.py ./tests/tiny_models.py
# The container's torch, transformers, tensorrt and tensorrt_llm stay as NVIDIA built them: container_install.sh
# pins the installed versions, installs the project (pyproject.toml has ranges: torch>=2.6, transformers>=4.57,<6;
# and onnxruntime + onnxscript, which the drafter export imports and TensorRT-LLM's requirements do not hold)
# under those pins, and fails the build if any of them changed anyway. The same script is what `dflash-trt engines`
# names in a plain NGC container that lacks those modules.
RUN scripts/container_install.sh && \
    mkdir -p .venv/bin && ln -s "$(command -v python3)" .venv/bin/python && \
    ln -s "$(command -v dflash-trt)" .venv/bin/dflash-trt && touch .venv/.installed
# The runtime user, never root: uid 10001 (deploy/k8s runs the pods as it, runAsNonRoot; NVIDIA's images keep 1000
# for their own user). It owns /app, where the default command and gpu-smoke write their engines and results; the
# installed packages stay root's. The ranks of a multi-node group run as root (deploy/k8s/multi-node: IPC_LOCK).
RUN groupadd --gid 10001 dflash && useradd --uid 10001 --gid 10001 --create-home --shell /bin/bash dflash && \
    chown -R 10001:10001 /app
USER 10001
ENV DFLASH_TRT_MODELS=/app/models
EXPOSE 8000
# Engines depend on the GPU they run on, so they are built at start (keyed by their inputs and the GPU
# architecture: a restart rebuilds nothing);
# with tp > 1 in engines.toml the server runs under `mpirun -n tp` (scripts/container_serve.sh).
CMD ["scripts/container_serve.sh"]
