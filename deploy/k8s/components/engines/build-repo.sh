#!/usr/bin/env bash
# Init step of the Triton variant: the engines (once per identity, see build-engines.sh), then the model repository
# that serves them (dflash-trt triton-repo, validated as it is written).
set -euo pipefail
bash /engine-scripts/build-engines.sh
dflash-trt triton-repo --engines "$(cat "${DFLASH_RUN_DIR:-/run/dflash}/engines-dir")" --out /repo --force
