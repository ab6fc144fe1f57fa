#!/usr/bin/env bash
# Init step: build the engines engines.toml asks for into the engines volume. `dflash-trt engines` keys every step
# by the sha256 of its inputs (dflash_trt/builders/engines.py): a restart with the same config and checkpoints
# rebuilds nothing. Then it records which config the volume holds, for the workers of a group (wait-engines.sh).
set -euo pipefail
CONFIG="${ENGINES_CONFIG:-/config/engines.toml}"
ENGINES="${DFLASH_ENGINES:-/engines}"
dflash-trt engines --config "$CONFIG" --out "$ENGINES"
sha256sum "$CONFIG" | cut -d' ' -f1 > "$ENGINES/.built-config"
