#!/usr/bin/env bash
# Serve a run's local MLflow store (what `logging.trackers=[mlflow]` writes) with `mlflow server`.
#
#   scripts/mlflow-up.sh RUN_DIR [PORT]    start it in the background (default port 5000) and
#                                          wait until it answers; prints its URL
#
# RUN_DIR is a run folder (its store is RUN_DIR/mlflow/mlflow.db, the artifacts
# RUN_DIR/mlflow/artifacts). The server listens on 127.0.0.1 only; its pid and log are
# RUN_DIR/mlflow/server.pid and server.log. `scripts/mlflow-down.sh RUN_DIR` stops it.
#
# The server and its UI need the full `mlflow` package, whose pins (pyarrow, python-dateutil,
# importlib-metadata) would downgrade packages of posttrain's venv, which has only the client
# (mlflow-skinny). So the server runs from a venv of its own, built on first use with the same
# MLflow version: ${POSTTRAIN_MLFLOW_VENV:-/var/tmp/posttrain-mlflow/venv} (~860 MB, a few
# minutes on a 2-core machine). It only reads and writes the run's SQLite store.
set -euo pipefail

MLFLOW_VERSION=3.17.2
VENV="${POSTTRAIN_MLFLOW_VENV:-/var/tmp/posttrain-mlflow/venv}"

die() {
  echo "mlflow-up: $*" >&2
  exit 1
}

[ $# -ge 1 ] || die "usage: scripts/mlflow-up.sh RUN_DIR [PORT]"
RUN_DIR="$(cd "$1" && pwd)" || die "no run folder $1"
PORT="${2:-5000}"
STORE="$RUN_DIR/mlflow"
MLFLOW="$VENV/bin/mlflow"
[ -f "$STORE/mlflow.db" ] || die "$STORE/mlflow.db not found: run with logging.trackers=[mlflow]"
if [ -f "$STORE/server.pid" ] && kill -0 "$(cat "$STORE/server.pid")" 2>/dev/null; then
  die "already serving (pid $(cat "$STORE/server.pid")); scripts/mlflow-down.sh $RUN_DIR first"
fi

if ! "$VENV/bin/python" -c "import mlflow.server, sys; sys.exit(mlflow.__version__ != '$MLFLOW_VERSION')" 2>/dev/null; then
  echo "mlflow-up: building $VENV (mlflow==$MLFLOW_VERSION)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "mlflow==$MLFLOW_VERSION" || die "pip install mlflow==$MLFLOW_VERSION failed"
fi

setsid "$MLFLOW" server --backend-store-uri "sqlite:///$STORE/mlflow.db" \
  --default-artifact-root "$STORE/artifacts" --host 127.0.0.1 --port "$PORT" --workers 1 \
  >"$STORE/server.log" 2>&1 &
echo $! >"$STORE/server.pid"

URL="http://127.0.0.1:$PORT"
for _ in $(seq 1 180); do  # a loaded 2-core machine: up to 3 minutes
  if curl -sf "$URL/health" >/dev/null 2>&1; then
    echo "mlflow-up: serving $STORE at $URL (pid $(cat "$STORE/server.pid"))"
    exit 0
  fi
  kill -0 "$(cat "$STORE/server.pid")" 2>/dev/null || die "the server exited; see $STORE/server.log"
  sleep 1
done
die "no answer from $URL/health after 180 s; see $STORE/server.log"
