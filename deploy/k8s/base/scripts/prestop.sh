#!/usr/bin/env bash
# preStop: SIGTERM to rank 0 only (its pid file), then wait for it to finish draining: in-flight requests end, new
# ones get 503, /ready fails so the Service stops routing here. Its exit shuts the TensorRT-LLM executor down,
# which releases the other ranks, and mpirun exits 0. Bounded by terminationGracePeriodSeconds.
PID_FILE="${DFLASH_PID_FILE:-/run/dflash/serve.pid}"
[ -f "$PID_FILE" ] || exit 0
pid=$(cat "$PID_FILE")
kill -TERM "$pid" 2>/dev/null || exit 0
while kill -0 "$pid" 2>/dev/null; do sleep 1; done
