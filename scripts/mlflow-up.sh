#!/usr/bin/env bash
# Serve a run's local MLflow store (what `logging.trackers=[mlflow]` writes) with `mlflow server`.
#
#   scripts/mlflow-up.sh RUN_DIR [PORT]    start it in the background (default port 5000) and
#                                          wait until it answers; prints its URL
#   scripts/mlflow-up.sh --build           build the server's venv if it is missing; serve nothing
#   scripts/mlflow-up.sh --check           exit 0 if the venv is complete, 1 if not; change nothing
#
# RUN_DIR is a run folder (its store is RUN_DIR/mlflow/mlflow.db, the artifacts
# RUN_DIR/mlflow/artifacts). The server listens on 127.0.0.1 only; its pid and log are
# RUN_DIR/mlflow/server.pid and server.log. `scripts/mlflow-down.sh RUN_DIR` stops it.
#
# The server and its UI need the full `mlflow` package, whose pins (pyarrow, python-dateutil,
# importlib-metadata) would downgrade packages of posttrain's venv, which has only the client
# (mlflow-skinny). So the server runs from a venv of its own, built on first use with the same
# MLflow version: ${POSTTRAIN_MLFLOW_VENV:-/var/tmp/posttrain-mlflow/venv} (~860 MB, a few
# minutes on a 2-core machine; `make test` builds it when missing, for the browser test of the
# UI). It only reads and writes the run's SQLite store. The venv is complete when it imports
# `mlflow.server` at that version and holds the stamp file `posttrain-mlflow.stamp` (written last).
set -euo pipefail

MLFLOW_VERSION=3.17.2
VENV="${POSTTRAIN_MLFLOW_VENV:-/var/tmp/posttrain-mlflow/venv}"

die() {
  echo "mlflow-up: $*" >&2
  exit 1
}

STAMP="$VENV/posttrain-mlflow.stamp"

# Cheap (no `import mlflow`, which takes seconds): the stamp, the command and the installed
# version. `build` checks that mlflow.server imports before it writes the stamp.
complete() {
  [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "mlflow==$MLFLOW_VERSION" ] && [ -x "$VENV/bin/mlflow" ] &&
    "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('mlflow') != '$MLFLOW_VERSION')" 2>/dev/null
}

build() {
  complete && return 0
  local t0=$SECONDS
  echo "mlflow-up: building $VENV (mlflow==$MLFLOW_VERSION)"
  rm -f "$STAMP"
  python3 -m venv "$VENV" || die "python3 -m venv $VENV failed"
  "$VENV/bin/pip" install -q --disable-pip-version-check "mlflow==$MLFLOW_VERSION" ||
    die "pip install mlflow==$MLFLOW_VERSION failed"
  "$VENV/bin/python" -c "import mlflow.server" ||
    die "$VENV does not import mlflow.server after installing mlflow==$MLFLOW_VERSION"
  echo "mlflow==$MLFLOW_VERSION" >"$STAMP"
  complete || die "$VENV does not hold mlflow==$MLFLOW_VERSION after the install"
  echo "mlflow-up: built $VENV in $((SECONDS - t0)) s"
}

case "${1:-}" in
  --check)
    complete
    exit
    ;;
  --build)
    build
    exit
    ;;
  -*) die "unknown option '$1' (usage: scripts/mlflow-up.sh RUN_DIR [PORT] | --build | --check)" ;;
esac

[ $# -ge 1 ] || die "usage: scripts/mlflow-up.sh RUN_DIR [PORT] | --build | --check"
RUN_DIR="$(cd "$1" && pwd)" || die "no run folder $1"
PORT="${2:-5000}"
STORE="$RUN_DIR/mlflow"
MLFLOW="$VENV/bin/mlflow"
[ -f "$STORE/mlflow.db" ] || die "$STORE/mlflow.db not found: run with logging.trackers=[mlflow]"
if [ -f "$STORE/server.pid" ] && kill -0 "$(cat "$STORE/server.pid")" 2>/dev/null; then
  die "already serving (pid $(cat "$STORE/server.pid")); scripts/mlflow-down.sh $RUN_DIR first"
fi

build

# No job executor (MLflow's background workers for GenAI evaluation jobs): the UI does not need
# it, and its worker processes would add seconds of imports to the start.
MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid "$MLFLOW" server --backend-store-uri "sqlite:///$STORE/mlflow.db" \
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
