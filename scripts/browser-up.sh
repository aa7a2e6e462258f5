#!/usr/bin/env bash
# Install the headless browser that tests/notebook/browser/ drives (through Playwright) to check the live
# dashboard in a real JupyterLab page.
#
#   scripts/browser-up.sh            install Debian's chromium if it is missing
#   scripts/browser-up.sh --check    exit 0 if the browser is there, 1 if not; install nothing
#
# Playwright's own browser download (`playwright install`) needs the internet; Debian's
# `chromium` package comes from the apt mirror instead, and the tests launch it with
# executable_path=${POSTTRAIN_CHROMIUM:-/usr/bin/chromium}. Idempotent: when the browser is there it
# says so and exits 0. Installing needs root and apt-get (~30 s); without them it says why and
# exits 1 (the browser tests then skip).
set -euo pipefail

CHROMIUM="${POSTTRAIN_CHROMIUM:-/usr/bin/chromium}"

die() {
  echo "browser-up: $*" >&2
  exit 1
}

say() { echo "browser-up: $*"; }

present() { [[ -x "$CHROMIUM" ]]; }

case "${1:-}" in
  --check)
    present
    exit
    ;;
  "") ;;
  *) die "unknown argument '$1' (usage: scripts/browser-up.sh [--check])" ;;
esac

if present; then
  say "$CHROMIUM is there ($("$CHROMIUM" --version 2>/dev/null || echo "version unknown"))"
  exit 0
fi
[[ "$CHROMIUM" == /usr/bin/chromium ]] ||
  die "POSTTRAIN_CHROMIUM=$CHROMIUM does not exist; this script only installs /usr/bin/chromium"
[[ "$(id -u)" -eq 0 ]] || die "needs root to install Debian's chromium (or install it by hand)"
command -v apt-get >/dev/null 2>&1 || die "no chromium and no apt-get to install it"

t0=$SECONDS
say "installing Debian package chromium"
apt_log="$(mktemp)"
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y \
  --no-install-recommends chromium; } >"$apt_log" 2>&1; then
  tail -n 20 "$apt_log" >&2
  rm -f "$apt_log"
  die "apt-get install chromium failed (log above)"
fi
rm -f "$apt_log"
present || die "apt-get installed chromium but $CHROMIUM is not there"
say "installed $("$CHROMIUM" --version 2>/dev/null || echo chromium) in $((SECONDS - t0)) s"
