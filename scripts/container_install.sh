#!/usr/bin/env bash
# Install this checkout into a GPU container's own Python (NVIDIA's TensorRT-LLM / Triton images), keeping what the
# container ships: the gpu image's Dockerfile runs it, and `dflash-trt engines` names it when the drafter export's
# modules are missing (a plain NGC container: TensorRT-LLM's requirements.txt holds onnx, neither onnxruntime nor
# onnxscript, as read at NVIDIA/TensorRT-LLM 000867d9 on the 1.2 line; the 1.3 line adds onnxscript). Run from the repository root, as the user that owns the container's Python (root in NVIDIA's images):
#
#   scripts/container_install.sh
#
# pyproject.toml's dependencies (onnxruntime and onnxscript among them) are installed under pins of the container's
# torch, transformers, tensorrt, tensorrt_llm, numpy, ... (scripts/container_pins.py), and the run fails if any of
# those changed anyway.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
PINS="$(mktemp "${TMPDIR:-/tmp}/container-pins.XXXXXX")"
trap 'rm -f "$PINS"' EXIT
"$PYTHON" scripts/container_pins.py > "$PINS"
cat "$PINS"
"$PYTHON" -m pip install --no-cache-dir -c "$PINS" -e .
"$PYTHON" scripts/container_pins.py --check "$PINS"
