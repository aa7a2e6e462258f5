#!/usr/bin/env bash
# Make the code sandbox (posttrain.verifiers.sandbox) work on this machine.
#
#   scripts/sandbox-up.sh            install bubblewrap if missing, check the uid range, try it
#   scripts/sandbox-up.sh --check    exit 0 if a sandboxed program runs here, 1 if not; change nothing
#
# The sandbox runs each program through bubblewrap (Debian package bubblewrap) as root, in new
# mount/PID/network/IPC/UTS namespaces, as an unprivileged uid of its own:
# ${POSTTRAIN_SANDBOX_UID_BASE:-2100000000} + slot, 256 slots. Those uids need no account: they
# must only be used by none (no /etc/passwd entry, no running process), which this script checks
# and reports; choose another range with POSTTRAIN_SANDBOX_UID_BASE if it is taken.
# Programs run with the system /usr/bin/python3 (the unprivileged uid cannot read a virtualenv
# under /root or the checkout, which are not even mounted in the sandbox).
#
# Idempotent. Installing needs root and apt-get (~3 s); without them it says why and exits 1
# (the sandbox tests then skip, and Sandbox() raises SandboxUnavailable with the reason).
set -euo pipefail

UID_BASE="${POSTTRAIN_SANDBOX_UID_BASE:-2100000000}"
UID_SLOTS=256
PYTHON=/usr/bin/python3

die() {
  echo "sandbox-up: $*" >&2
  exit 1
}

say() { echo "sandbox-up: $*"; }

# A program in the same namespaces and as an unprivileged uid of the range prints "ok".
probe() {
  command -v bwrap >/dev/null 2>&1 && [[ -x "$PYTHON" ]] && [[ "$(id -u)" -eq 0 ]] || return 1
  local out
  out="$(bwrap --unshare-net --unshare-pid --unshare-ipc --unshare-uts --die-with-parent \
    --new-session --ro-bind /usr /usr --symlink usr/bin /bin --symlink usr/lib /lib \
    --symlink usr/lib64 /lib64 --proc /proc --dev /dev --tmpfs /tmp --chdir /tmp \
    --cap-drop ALL --cap-add CAP_SETUID --cap-add CAP_SETGID \
    "$PYTHON" -I -S -c "import os; os.setgroups([]); os.setgid($UID_BASE); os.setuid($UID_BASE); print('ok')" \
    2>&1)" || {
    echo "$out" >&2
    return 1
  }
  [[ "$out" == ok ]]
}

# The uid range is used by no account and no process.
range_free() {
  local top=$((UID_BASE + UID_SLOTS)) taken
  taken="$(awk -F: -v lo="$UID_BASE" -v hi="$top" '$3 >= lo && $3 < hi {print $1}' /etc/passwd)"
  [[ -z "$taken" ]] || {
    echo "sandbox-up: uids $UID_BASE..$((top - 1)) are used by: $taken" >&2
    return 1
  }
  taken="$(ps -eo uid= | awk -v lo="$UID_BASE" -v hi="$top" '$1 >= lo && $1 < hi' | wc -l)"
  [[ "$taken" -eq 0 ]] || {
    echo "sandbox-up: $taken processes run as uids $UID_BASE..$((top - 1))" >&2
    return 1
  }
}

case "${1:-}" in
  --check)
    probe && range_free
    exit
    ;;
  "") ;;
  *) die "unknown argument '$1' (usage: scripts/sandbox-up.sh [--check])" ;;
esac

[[ "$(id -u)" -eq 0 ]] || die "the sandbox needs root (each program gets its own unprivileged uid)"
[[ -x "$PYTHON" ]] || die "$PYTHON is missing (Debian package python3)"
if ! command -v bwrap >/dev/null 2>&1; then
  command -v apt-get >/dev/null 2>&1 || die "no bwrap and no apt-get to install bubblewrap"
  t0=$SECONDS
  say "installing Debian package bubblewrap"
  apt_log="$(mktemp)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y \
    --no-install-recommends bubblewrap; } >"$apt_log" 2>&1; then
    tail -n 20 "$apt_log" >&2
    rm -f "$apt_log"
    die "apt-get install bubblewrap failed (log above)"
  fi
  rm -f "$apt_log"
  say "installed $(bwrap --version) in $((SECONDS - t0)) s"
fi
range_free || die "choose a free range with POSTTRAIN_SANDBOX_UID_BASE"
probe || die "bwrap is installed but cannot make a sandbox here (its error above)"
say "ready: $(bwrap --version), programs run as uids $UID_BASE..$((UID_BASE + UID_SLOTS - 1))"
