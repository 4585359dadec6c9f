#!/usr/bin/env bash
# Configures a build of pdo in the folder given as $1 (default: build), with the CUDA
# toolkit when one is found; extra arguments go to cmake.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-build}
shift || true
args=(-S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo)
command -v ccache >/dev/null 2>&1 && args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
cuda_home=${CUDA_HOME:-}
if [ -z "$cuda_home" ] && command -v nvcc >/dev/null 2>&1; then cuda_home=$(dirname "$(dirname "$(command -v nvcc)")"); fi
cuda_off=0
for a in "$@"; do [ "$a" = "-DPDO_WITH_CUDA=OFF" ] && cuda_off=1; done
if [ "$cuda_off" = 1 ]; then
  :  # a build without CUDA: name no toolkit (cmake would warn that the variables go unused)
elif [ -n "$cuda_home" ] && [ -x "$cuda_home/bin/nvcc" ]; then
  args+=(-DCMAKE_CUDA_COMPILER="$cuda_home/bin/nvcc" -DCUDAToolkit_ROOT="$cuda_home")
else
  args+=(-DPDO_WITH_CUDA=OFF)
fi
cmake "${args[@]}" "$@"
