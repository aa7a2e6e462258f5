#!/usr/bin/env bash
# Stop the MLflow server that `scripts/mlflow-up.sh RUN_DIR` started (its process group).
#
#   scripts/mlflow-down.sh RUN_DIR
set -euo pipefail

[ $# -ge 1 ] || { echo "usage: scripts/mlflow-down.sh RUN_DIR" >&2; exit 1; }
PID_FILE="$1/mlflow/server.pid"
if [ ! -f "$PID_FILE" ]; then
  echo "mlflow-down: no server started for $1"
  exit 0
fi
PID="$(cat "$PID_FILE")"
if kill -0 "$PID" 2>/dev/null; then
  kill -- "-$PID" 2>/dev/null || kill "$PID"
  for _ in $(seq 1 30); do
    kill -0 "$PID" 2>/dev/null || break
    sleep 1
  done
  kill -0 "$PID" 2>/dev/null && kill -9 -- "-$PID" 2>/dev/null || true
fi
rm -f "$PID_FILE"
echo "mlflow-down: stopped $1"
