#!/usr/bin/env bash
# Sets up, builds and runs pdo's main demo (examples/quickstart.cpp).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bash "$here/scripts/setup.sh"
bash "$here/scripts/configure.sh" "$here/build" -DPDO_BUILD_TESTS=OFF -DPDO_BUILD_BENCHMARKS=OFF -DPDO_WITH_CUDA=OFF >/dev/null
cmake --build "$here/build" --target quickstart
"$here/build/examples/quickstart" "$@"
