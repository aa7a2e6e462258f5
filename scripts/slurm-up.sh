#!/usr/bin/env bash
# Start a real single-host Slurm cluster for posttrain's tests and tutorials.
#
#   scripts/slurm-up.sh            install what is missing, start everything, wait until it answers
#   scripts/slurm-up.sh --check    exit 0 if the cluster is up and answering, 1 if not; start nothing
#
# The cluster: munged, mariadbd, slurmdbd (accounting: submitit reads job states through sacct),
# slurmctld and two slurmd emulating nodes n1 and n2 on this host, partition "debug".
# All state lives in one folder, ${POSTTRAIN_SLURM_DIR:-/var/tmp/posttrain-slurm}:
#   etc/     slurm.conf, slurmdbd.conf (600), munge.key (600), db-password (600)
#   run/     munge socket, mariadb socket, pid files
#   spool/   slurmctld state, one slurmd spool per node
#   mysql/   mariadb datadir
#   log/     one log per daemon
#   env.sh   `export SLURM_CONF=...` for clients and submitit
#   pids     "name pid" per line, every process this script started (scripts/slurm-down.sh reads it)
# Ports: POSTTRAIN_SLURM_PORT_BASE (default 6817) + 0 slurmctld, +2 slurmdbd, +4/+5 slurmd n1/n2,
# +13 mariadb (127.0.0.1 only).
#
# Idempotent: when the cluster is already up and answering it says so and exits 0. When it is
# half up (a daemon died), it stops what is left and starts everything again.
# Needs root and apt-get (Debian packages slurm-wlm, munge, slurmdbd, mariadb-server). Package
# post-install scripts start nothing on these machines: every daemon is started here, in the
# foreground of its own session (setsid), its output in log/.
set -euo pipefail

DIR="${POSTTRAIN_SLURM_DIR:-/var/tmp/posttrain-slurm}"
PORT_BASE="${POSTTRAIN_SLURM_PORT_BASE:-6817}"
SCRIPTS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

CLUSTER=posttrain
PARTITION=debug
NODES=(n1 n2)
NODES_RE="$(IFS='|' && echo "${NODES[*]}")" # n1|n2, for grep -E
PACKAGES=(slurm-wlm slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
# One binary per package: if all are on PATH, nothing is installed.
BINARIES=(slurmctld slurmd sbatch sacct sacctmgr munged slurmdbd mariadbd mariadb-install-db)

CTLD_PORT=$((PORT_BASE))
DBD_PORT=$((PORT_BASE + 2))
SLURMD_PORT=$((PORT_BASE + 4)) # n1; n2 uses the next one
DB_PORT=$((PORT_BASE + 13))

die() {
  echo "slurm-up: $*" >&2
  exit 1
}

say() { echo "slurm-up: $*"; }

# Absolute path: daemons chdir, and the conf files must name absolute paths.
case "$DIR" in
  /*) ;;
  *) DIR="$PWD/$DIR" ;;
esac

ETC="$DIR/etc"
RUN="$DIR/run"
LOG="$DIR/log"
SPOOL="$DIR/spool"
DATADIR="$DIR/mysql"
PIDS="$DIR/pids"
MUNGE_SOCKET="$RUN/munge.socket"
DB_SOCKET="$RUN/mysqld.sock"
export SLURM_CONF="$ETC/slurm.conf" # slurmdbd finds slurmdbd.conf next to it

# True if PID is a live process (a zombie child of this script counts as dead).
alive() {
  local state
  state="$(ps -o stat= -p "$1" 2>/dev/null)" || return 1
  [[ "$state" != Z* ]]
}

# True if every process in the pids file is alive, both nodes are up and sacct answers.
cluster_answers() {
  [[ -s "$PIDS" ]] || return 1
  local name pid states
  while read -r name pid; do
    alive "$pid" || return 1
  done <"$PIDS"
  states="$(timeout 10 sinfo -h -N -p "$PARTITION" -o '%N %t' 2>/dev/null)" || return 1
  [[ "$(grep -cE "^(${NODES_RE}) (idle|mix|alloc)" <<<"$states")" -eq ${#NODES[@]} ]] || return 1
  timeout 10 sacct -n -X -S now-1minutes >/dev/null 2>&1
}

if [[ "${1:-}" == "--check" ]]; then
  cluster_answers
  exit
elif [[ $# -gt 0 ]]; then
  die "usage: $0 [--check]"
fi

[[ "$(id -u)" -eq 0 ]] || die "needs root (it installs Debian packages and runs the Slurm daemons as root)"

mkdir -p "$DIR"
chmod 755 "$DIR"
# One slurm-up at a time (two `make test` started together must not race).
exec 9>"$DIR/.lock"
flock -w 300 9 || die "another slurm-up.sh holds $DIR/.lock"

if cluster_answers; then
  say "cluster already up and answering ($DIR)"
  echo "export SLURM_CONF=$SLURM_CONF"
  exit 0
fi
if [[ -s "$PIDS" ]]; then
  say "cluster half up: stopping what is left before starting again"
  POSTTRAIN_SLURM_DIR="$DIR" "$SCRIPTS/slurm-down.sh"
fi

# A port someone else holds would only show up later as a daemon dying.
for port in "$CTLD_PORT" "$DBD_PORT" "$SLURMD_PORT" "$((SLURMD_PORT + 1))" "$DB_PORT"; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    die "port $port is in use (ports ${CTLD_PORT}..$DB_PORT): set POSTTRAIN_SLURM_PORT_BASE to another base"
  fi
done

# ---------------------------------------------------------------------------------------------
# Install
# ---------------------------------------------------------------------------------------------
t0=$SECONDS
missing=()
for b in "${BINARIES[@]}"; do
  command -v "$b" >/dev/null 2>&1 || missing+=("$b")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and no apt-get to install them"
  say "installing ${PACKAGES[*]} (missing: ${missing[*]})"
  apt_log="$(mktemp)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y \
    --no-install-recommends "${PACKAGES[@]}"; } >"$apt_log" 2>&1; then
    tail -n 20 "$apt_log" >&2
    die "apt-get install failed (log above)"
  fi
  rm -f "$apt_log"
fi
install_s=$((SECONDS - t0))
t1=$SECONDS

# From here on, a failure stops whatever this run started (nothing is left half up).
trap 'echo "slurm-up: command failed (line $LINENO)" >&2' ERR
on_exit() {
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "slurm-up: start failed: stopping what had started" >&2
    POSTTRAIN_SLURM_DIR="$DIR" "$SCRIPTS/slurm-down.sh" >&2 || true
  fi
}
trap on_exit EXIT

# ---------------------------------------------------------------------------------------------
# Configuration (regenerated at every start, so it always matches this script)
# ---------------------------------------------------------------------------------------------
mkdir -p "$ETC" "$RUN" "$LOG" "$SPOOL/ctld" "$DATADIR"
for n in "${NODES[@]}"; do mkdir -p "$SPOOL/$n"; done
chmod 700 "$DATADIR" "$SPOOL/ctld"
: >"$PIDS"
host="$(hostname -s)"

if [[ ! -s "$ETC/munge.key" ]]; then
  mungekey --create --keyfile="$ETC/munge.key"
fi
chmod 600 "$ETC/munge.key"

if [[ ! -s "$ETC/db-password" ]]; then
  (umask 077 && od -An -N16 -tx1 /dev/urandom | tr -d ' \n' >"$ETC/db-password")
fi
db_password="$(cat "$ETC/db-password")"

cat >"$SLURM_CONF" <<EOF
# Generated by scripts/slurm-up.sh (Slurm $(slurmctld -V | awk '{print $2}')): edits are overwritten.
ClusterName=$CLUSTER
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=10: a requeued job may start again after ~15 s instead of ~120 s.
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10

StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log

# No cgroups on these machines.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none

# Accounting through slurmdbd: sacct is how submitit sees that a job finished or was cancelled.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
# With auth/munge this names the munge socket used to talk to slurmdbd.
AccountingStoragePass=$MUNGE_SOCKET
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true

SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU

# Short timeouts: tests should not wait on defaults made for big clusters.
MinJobAge=5
KillWait=5
MessageTimeout=10
InactiveLimit=0
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=30
BatchStartTimeout=10
ReturnToService=2
JobRequeue=1

# Two emulated nodes on this host, one slurmd each (slurmd -N nX). config_overrides lets a node
# claim more CPUs than the host has.
SlurmdParameters=config_overrides
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$SLURMD_PORT CPUs=4 RealMemory=4096 State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + 1)) CPUs=4 RealMemory=4096 State=UNKNOWN
PartitionName=$PARTITION Nodes=n[1-2] Default=YES MaxTime=INFINITE OverSubscribe=YES State=UP
EOF
chmod 644 "$SLURM_CONF"

(umask 077 && cat >"$ETC/slurmdbd.conf" <<EOF
# Generated by scripts/slurm-up.sh: edits are overwritten.
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=$host
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$db_password
StorageLoc=slurm_acct_db
EOF
)
chmod 600 "$ETC/slurmdbd.conf" # slurmdbd refuses a readable one: it holds the db password

cat >"$DIR/env.sh" <<EOF
# Source this file to use the local Slurm cluster (sinfo, sbatch, sacct, submitit).
export SLURM_CONF=$SLURM_CONF
EOF
chmod 644 "$DIR/env.sh"

# ---------------------------------------------------------------------------------------------
# Start
# ---------------------------------------------------------------------------------------------
declare -A PID # name -> pid of what this run started

# start NAME CMD...: run CMD in the foreground of a new session, its console output (which
# repeats its log, plus errors from before the log opens) in log/NAME.out, and record "NAME PID".
# setsid execs in place (this script's background children do not lead a process group), so $!
# is the daemon's own PID. 9>&-: the daemon must not inherit (and hold forever) the lock.
start() {
  local name="$1"
  shift
  setsid "$@" </dev/null >"$LOG/$name.out" 2>&1 9>&- &
  echo "$name $!" >>"$PIDS"
  PID[$name]=$!
}

# show_logs NAME LOGFILE: the last lines of a daemon's log and of its console output.
show_logs() {
  local f
  for f in "$2" "$LOG/$1.out"; do
    [[ -s "$f" ]] || continue
    echo "--- last lines of $f:" >&2
    tail -n 15 "$f" >&2
  done
}

# wait_for NAME SECONDS PID LOGFILE CMD...: poll CMD until it succeeds; fail with the logs' tails
# if the daemon dies or time runs out.
wait_for() {
  local what="$1" limit="$2" pid="$3" logfile="$4" deadline
  shift 4
  deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    if ! alive "$pid"; then
      show_logs "$what" "$logfile"
      die "$what died while starting (logs above)"
    fi
    if [[ $SECONDS -ge $deadline ]]; then
      show_logs "$what" "$logfile"
      die "$what not ready after ${limit}s (logs above)"
    fi
    sleep 0.5
  done
}

# munge: authentication for every Slurm message.
rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
start munged munged --foreground --key-file="$ETC/munge.key" \
  --socket="$MUNGE_SOCKET" --pid-file="$RUN/munged.pid" --log-file="$LOG/munged.log" \
  --seed-file="$RUN/munged.seed"
wait_for munged 15 "${PID[munged]}" "$LOG/munged.log" \
  bash -c "munge --socket='$MUNGE_SOCKET' -n | unmunge --socket='$MUNGE_SOCKET'"

# mariadb: the accounting database (TCP on 127.0.0.1 only: slurmdbd has no socket option).
if [[ ! -d "$DATADIR/mysql" ]]; then
  say "initialising the mariadb datadir"
  mariadb-install-db --no-defaults --datadir="$DATADIR" --user=root --skip-test-db \
    --auth-root-authentication-method=socket >"$LOG/mariadb-install.log" 2>&1 ||
    { tail -n 20 "$LOG/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
fi
start mariadbd mariadbd --no-defaults --user=root --datadir="$DATADIR" \
  --socket="$DB_SOCKET" --pid-file="$RUN/mariadbd.pid" --port="$DB_PORT" \
  --bind-address=127.0.0.1 --skip-name-resolve --log-error="$LOG/mariadbd.log" \
  --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900
wait_for mariadbd 60 "${PID[mariadbd]}" "$LOG/mariadbd.log" \
  mariadb-admin --no-defaults --socket="$DB_SOCKET" ping
mariadb --no-defaults --socket="$DB_SOCKET" -u root <<EOF
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$db_password';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$db_password';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
EOF

# slurmdbd, then the cluster, account and user it records jobs under.
start slurmdbd slurmdbd -D
wait_for slurmdbd 90 "${PID[slurmdbd]}" "$LOG/slurmdbd.log" sacctmgr -n list cluster
if [[ -z "$(sacctmgr -n -P list cluster "$CLUSTER" format=cluster)" ]]; then
  sacctmgr -i add cluster "$CLUSTER" >/dev/null
fi
if [[ -z "$(sacctmgr -n -P list account "$CLUSTER" format=account)" ]]; then
  sacctmgr -i add account "$CLUSTER" Cluster="$CLUSTER" Description=posttrain Organization=posttrain >/dev/null
fi
if [[ -z "$(sacctmgr -n -P list assoc cluster="$CLUSTER" user=root account="$CLUSTER" format=user)" ]]; then
  sacctmgr -i add user root Account="$CLUSTER" Cluster="$CLUSTER" >/dev/null
fi

# slurmctld, then one slurmd per node.
start slurmctld slurmctld -D
wait_for slurmctld 60 "${PID[slurmctld]}" "$LOG/slurmctld.log" scontrol ping
for n in "${NODES[@]}"; do
  start "slurmd-$n" slurmd -D -N "$n"
done

# Both nodes idle. A node left DOWN/DRAIN by an earlier run is resumed once.
nodes_idle() {
  [[ "$(sinfo -h -N -p "$PARTITION" -o '%N %t' | grep -cE "^(${NODES_RE}) idle")" -eq ${#NODES[@]} ]]
}
resumed=0
deadline=$((SECONDS + 60))
until nodes_idle 2>/dev/null; do
  for n in "${NODES[@]}"; do
    if ! alive "${PID[slurmd-$n]}"; then
      show_logs "slurmd-$n" "$LOG/slurmd-$n.log"
      die "slurmd -N $n died while starting (logs above)"
    fi
  done
  if [[ $resumed -eq 0 && $SECONDS -ge $((deadline - 50)) ]] &&
    sinfo -h -N -o '%t' | grep -qE 'down|drain|drng'; then
    scontrol update NodeName=n[1-2] State=RESUME 2>/dev/null || true
    resumed=1
  fi
  if [[ $SECONDS -ge $deadline ]]; then
    sinfo -N -l >&2 || true
    tail -n 10 "$LOG/slurmctld.log" >&2 || true
    die "nodes not idle after 60s"
  fi
  sleep 0.5
done
wait_for slurmdbd 30 "${PID[slurmdbd]}" "$LOG/slurmdbd.log" sacct -n -X -S now-1minutes

start_s=$((SECONDS - t1))
say "cluster up in $DIR: install ${install_s}s, start ${start_s}s; nodes ${NODES[*]}, partition $PARTITION"
say "stop it with scripts/slurm-down.sh; use it with:"
echo "export SLURM_CONF=$SLURM_CONF"
