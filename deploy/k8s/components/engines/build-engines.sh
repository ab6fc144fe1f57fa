#!/usr/bin/env bash
# Init step: the engines engines.toml asks for, built once per engine identity into a folder of their own on the
# engines volume; the folder's path goes to $DFLASH_RUN_DIR/engines-dir, where serve.sh reads it.
#
# identity = sha256 of engines.toml, a stamp of the checkpoints (every file's name, size and mtime: listing a 70B
# checkpoint takes a second where hashing its contents takes minutes at every start), TensorRT-LLM's version and the
# GPUs' architecture (an engine runs only on the architecture it was built for).
#   - ROOT/ID present: done, nothing is hashed or built (the folder appears only complete, see below);
#   - else, under an exclusive flock on ROOT/.lock-ID (one builder per identity: a second group, or a rollout's
#     new group, waits for the first instead of overwriting it; at most ENGINES_LOCK_WAIT_S), `dflash-trt engines`
#     builds into ROOT/.tmp-ID-HOST, which is then renamed to ROOT/ID: a rename within one file system is atomic,
#     so no reader ever sees half an engine folder. The converted TensorRT-LLM checkpoint is deleted by the build
#     itself once the engine exists (dflash_trt/builders/trtllm_target.py, run_plan).
# flock on a ReadWriteMany volume needs a file system with working locks (NFSv4, Lustre, CephFS); see deploy/README.md.
set -euo pipefail
CONFIG="${ENGINES_CONFIG:-/config/engines.toml}"
ROOT="${DFLASH_ENGINES_ROOT:-/engines}"
RUN="${DFLASH_RUN_DIR:-/run/dflash}"
read -r -a ENGINES_CMD <<< "${DFLASH_ENGINES_CMD:-dflash-trt engines}"

# The checkpoint folders the config names; a config without both fails here (set -e), never an identity without
# their stamp (which would reuse an old folder after the checkpoints changed).
CHECKPOINTS=$(python3 - "$CONFIG" <<'PY'
import sys, tomllib
cfg = tomllib.load(open(sys.argv[1], "rb"))
for role in ("target", "drafter"):
    if role not in cfg:
        sys.exit(f"{sys.argv[1]} names no {role} checkpoint: the engines' identity needs both")
    print(cfg[role])
PY
)

identity() {
  cat "$CONFIG"
  local dir
  while IFS= read -r dir; do
    [ -d "$dir" ] || { echo "engines: checkpoint folder $dir not found" >&2; return 1; }
    find -L "$dir" -type f -printf '%P %s %T@\n' | sort
  done <<< "$CHECKPOINTS"
  python3 -c "from importlib import metadata as m
try: print('tensorrt_llm', m.version('tensorrt_llm'))
except m.PackageNotFoundError: print('tensorrt_llm none')"
  if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=compute_cap --format=csv,noheader | sort -u
  else echo "no nvidia-smi"; fi
}

ID=$(identity | sha256sum | cut -c1-16)
DIR="$ROOT/$ID"
mkdir -p "$ROOT" "$RUN"
if [ ! -d "$DIR" ]; then
  exec 9>"$ROOT/.lock-$ID"
  echo "engines $ID: waiting for the build lock" >&2
  if ! flock -w "${ENGINES_LOCK_WAIT_S:-14400}" 9; then
    echo "engines $ID: another builder held $ROOT/.lock-$ID for ${ENGINES_LOCK_WAIT_S:-14400} s" >&2; exit 1
  fi
  if [ ! -d "$DIR" ]; then  # nobody built it while this one waited
    TMP="$ROOT/.tmp-$ID-$(hostname)"
    rm -rf "$TMP"
    "${ENGINES_CMD[@]}" --config "$CONFIG" --out "$TMP"
    mv -T "$TMP" "$DIR"
  fi
  flock -u 9
fi
echo "$DIR" > "$RUN/engines-dir"
echo "{\"event\": \"engines_ready\", \"identity\": \"$ID\", \"dir\": \"$DIR\"}"
