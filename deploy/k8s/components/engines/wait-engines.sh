#!/usr/bin/env bash
# Init step of a group's worker pods: wait until the leader's init step has built this very config into the shared
# engines volume (the config's sha256 in .built-config), for at most ENGINES_WAIT_S seconds.
set -euo pipefail
CONFIG="${ENGINES_CONFIG:-/config/engines.toml}"
ENGINES="${DFLASH_ENGINES:-/engines}"
want=$(sha256sum "$CONFIG" | cut -d' ' -f1)
end=$(( $(date +%s) + ${ENGINES_WAIT_S:-3600} ))
until [ -f "$ENGINES/manifest.json" ] && [ "$(cat "$ENGINES/.built-config" 2>/dev/null)" = "$want" ]; do
  if [ "$(date +%s)" -gt "$end" ]; then echo "engines for config $want never appeared in $ENGINES" >&2; exit 1; fi
  sleep 10
done
