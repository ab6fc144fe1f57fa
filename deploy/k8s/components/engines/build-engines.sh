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
#
# Old identities are removed, or the shared volume fills with one engine set per config, checkpoint and image ever
# deployed: every start touches ROOT/.used-ID, and then, under ROOT/.lock-prune (one pruner at a time; a start that
# finds it held skips pruning), every identity but the ENGINES_KEEP (default 2: this one and the one a rollback
# returns to) most recently used is renamed out of sight (.trash-ID, so that no start ever sees half a folder)
# and deleted, with the temporary folders of builds that died (a .tmp-ID-HOST whose .lock-ID nobody holds).
set -euo pipefail
CONFIG="${ENGINES_CONFIG:-/config/engines.toml}"
ROOT="${DFLASH_ENGINES_ROOT:-/engines}"
RUN="${DFLASH_RUN_DIR:-/run/dflash}"
read -r -a ENGINES_CMD <<< "${DFLASH_ENGINES_CMD:-dflash-trt engines}"
# The drafter's ONNX graphs, kept on the volume by what they are made from (dflash_trt/builders/export_cache.py): a
# new identity of the same drafter and target (another max_batch_size, another TensorRT-LLM) copies them instead of
# exporting again. The pruning below leaves this folder alone; the cache keeps its own few entries.
export DFLASH_TRT_CACHE="${DFLASH_TRT_CACHE:-$ROOT/.export-cache}"

# Both folders written below must be writable by this process (the image's uid 10001 in the single-node and
# Triton pods): checked before anything is hashed or built. A pod's fsGroup does not make a ReadWriteMany claim
# writable: the kubelet applies it only where the volume's CSI driver says so (kubernetes pkg/apis/storage/types.go:
# the default FSGroupPolicy, ReadWriteOnceWithFSType, applies it to ReadWriteOnce volumes with an fsType only).
writable() {  # a real write (access(2) can answer wrongly on NFS): a file made and removed
  local probe="$1/.write-probe-$$"
  mkdir -p "$1" 2>/dev/null && : > "$probe" 2>/dev/null && rm -f "$probe"
}
if ! writable "$ROOT"; then
  cat >&2 <<MSG
engines: $ROOT is not writable by uid $(id -u) gid $(id -g). A pod's fsGroup does not reach a ReadWriteMany
volume unless its CSI driver declares fsGroupPolicy: File: make the share's root writable by uid/gid $(id -u)
(an EFS access point with uid and gid $(id -u), an NFS export owned by it) or use such a driver
(deploy/README.md, "Least privilege").
MSG
  exit 1
fi
if ! writable "$RUN"; then
  echo "engines: $RUN (DFLASH_RUN_DIR) is not writable by uid $(id -u): mount an emptyDir there" >&2; exit 1
fi

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

prune() {  # the identities beyond the ENGINES_KEEP most recently used, and dead builds' temporary folders
  exec 8>"$ROOT/.lock-prune"
  flock -n 8 || return 0
  local keep="${ENGINES_KEEP:-2}" n=0 stamp id tmp
  # shellcheck disable=SC2012  # names are 16 hex digits: ls -t is safe here
  for stamp in $(cd "$ROOT" && ls -1t -- .used-* 2>/dev/null); do
    id="${stamp#.used-}"
    n=$((n + 1))
    if [ "$n" -le "$keep" ] || [ "$id" = "$ID" ]; then continue; fi
    if [ -d "$ROOT/$id" ] && mv -T "$ROOT/$id" "$ROOT/.trash-$id" 2>/dev/null; then
      echo "{\"event\": \"engines_pruned\", \"identity\": \"$id\"}"
    fi
    rm -f "$ROOT/$stamp"
  done
  for tmp in "$ROOT"/.tmp-*; do
    [ -e "$tmp" ] || continue
    id="${tmp#"$ROOT"/.tmp-}"; id="${id%%-*}"
    # a build in progress holds its identity's lock: only a dead build's folder is free to take
    if (exec 7>"$ROOT/.lock-$id" && flock -n 7); then rm -rf "$tmp"; fi
  done
  rm -rf "$ROOT"/.trash-*
  flock -u 8
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
touch "$ROOT/.used-$ID"
prune
echo "{\"event\": \"engines_ready\", \"identity\": \"$ID\", \"dir\": \"$DIR\"}"
