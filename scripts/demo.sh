#!/usr/bin/env bash
# Sets up, builds and runs pdo's main demo (examples/digits.cpp): a CNN trained on
# scikit-learn's handwritten digits, data-parallel on all cores. Options go to the demo
# (--places N --epochs E --batch B --seed S --lr LR --bucket-bytes N --data PATH --trace FILE).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bash "$here/scripts/setup.sh"
bash "$here/scripts/configure.sh" "$here/build" -DPDO_BUILD_TESTS=OFF -DPDO_BUILD_BENCHMARKS=OFF -DPDO_WITH_CUDA=OFF >/dev/null
cmake --build "$here/build" --target digits
"$here/build/examples/digits" "$@"
