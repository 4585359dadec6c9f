#!/usr/bin/env bash
# Installs what pdo's build, tests and demo need on a Debian machine. Safe to run twice:
# packages already present are not installed again.
#   bash scripts/setup.sh          # the build, the demo
#   bash scripts/setup.sh --tests  # and what only the tests use (PyTorch, their numerical reference)
set -euo pipefail

packages=(cmake ninja-build g++ clang ccache catch2 libthrust-dev libcub-dev librange-v3-dev libomp-dev libeigen3-dev libopenblas-dev libopenmpi-dev openmpi-bin python3 python3-venv python3-numpy python3-sklearn zlib1g-dev nlohmann-json3-dev doxygen)
[ "${1:-}" = --tests ] && packages+=(python3-torch)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The CUDA toolkit (nvcc, CCCL, cuBLAS, NCCL) is optional: used when CUDA_HOME or nvcc is found.
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null 2>&1; then
  CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
fi
if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then
  echo "setup: CUDA toolkit at $CUDA_HOME"
else
  echo "setup: no CUDA toolkit found (CUDA paths will not be compiled)"
fi
