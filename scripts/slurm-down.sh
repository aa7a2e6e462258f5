#!/usr/bin/env bash
# Stop the local Slurm cluster started by scripts/slurm-up.sh.
#
#   scripts/slurm-down.sh           cancel jobs, stop every recorded daemon, keep the folder
#   scripts/slurm-down.sh --purge   the same, then remove the folder (configs, accounting db, logs)
#
# Processes are stopped only by the PIDs in ${POSTTRAIN_SLURM_DIR:-/var/tmp/posttrain-slurm}/pids
# (TERM, wait, then KILL), newest first, never by name: other people's processes run here. A PID
# whose process no longer runs the recorded program (PID reused after a reboot) is left alone.
# Idempotent: with nothing running it says so and exits 0.
set -euo pipefail

DIR="${POSTTRAIN_SLURM_DIR:-/var/tmp/posttrain-slurm}"
PIDS="$DIR/pids"
TERM_WAIT_S=20 # mariadbd flushes InnoDB on TERM; slurmctld saves state

say() { echo "slurm-down: $*"; }

purge=0
case "${1:-}" in
  "") ;;
  --purge) purge=1 ;;
  *)
    echo "usage: $0 [--purge]" >&2
    exit 2
    ;;
esac

# True if PID is alive and runs PROGRAM (its /proc comm; comm is cut at 15 characters).
runs() {
  local pid="$1" program="$2" comm
  comm="$(cat "/proc/$pid/comm" 2>/dev/null)" || return 1
  [[ "$comm" == "${program:0:15}" ]] || return 1
  [[ "$(ps -o stat= -p "$pid" 2>/dev/null)" != Z* ]]
}

if [[ -s "$PIDS" ]]; then
  # Cancel every job first: slurmstepd outlives slurmd, and a job left behind would keep running
  # with nothing to manage it.
  if [[ -f "$DIR/etc/slurm.conf" ]]; then
    export SLURM_CONF="$DIR/etc/slurm.conf"
    if timeout 5 scontrol ping >/dev/null 2>&1 && [[ -n "$(squeue -h -o %i 2>/dev/null)" ]]; then
      say "cancelling running jobs"
      scancel --partition=debug 2>/dev/null || true
      for _ in $(seq 30); do
        [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break
        sleep 0.5
      done
    fi
  fi

  # Newest first: slurmd, slurmctld, slurmdbd, mariadbd, munged.
  mapfile -t lines < <(tac "$PIDS")
  stopped=()
  for line in "${lines[@]}"; do
    read -r name pid <<<"$line"
    program="${name%%-*}" # slurmd-n1 -> slurmd
    runs "$pid" "$program" || continue
    kill -TERM "$pid" 2>/dev/null || continue
    for _ in $(seq $((TERM_WAIT_S * 4))); do
      runs "$pid" "$program" || break
      sleep 0.25
    done
    if runs "$pid" "$program"; then
      say "$name ($pid) ignored TERM for ${TERM_WAIT_S}s: KILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    stopped+=("$name")
  done
  rm -f "$PIDS"
  if [[ ${#stopped[@]} -gt 0 ]]; then
    say "stopped ${stopped[*]}"
  else
    say "nothing was running"
  fi
else
  say "nothing to stop (no $PIDS)"
fi

if [[ $purge -eq 1 && -d "$DIR" ]]; then
  rm -rf "$DIR"
  say "removed $DIR"
fi
