#!/usr/bin/env bash
# On a machine with NVIDIA GPUs, the CUDA toolkit and NCCL: builds pdo's CUDA tests and
# the NCCL benchmark, runs the tests (ctest label "cuda"), then the benchmark, which prints
# all_reduce bus bandwidth through pdo beside raw NCCL and the links' theoretical bandwidth,
# and peer vs staged copies between two GPUs. Arguments go to the benchmark
# ([samples] [min_bytes] [max_bytes]). Without a GPU the tests report themselves skipped.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${PDO_GPU_BUILD:-$here/build-gpu}
if ! command -v nvcc >/dev/null 2>&1 && [ -z "${CUDA_HOME:-}" ]; then
  echo "gpu_check: no CUDA toolkit (nvcc on the PATH or CUDA_HOME) on this machine" >&2
  exit 1
fi
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L || echo "gpu_check: nvidia-smi not found; the tests will say whether CUDA sees a device"
bash "$here/scripts/configure.sh" "$build" -DPDO_WITH_CUDA=ON -DPDO_BUILD_EXAMPLES=OFF
targets=(cuda_compile_all test_cuda bench_nccl)
# the MPI-bootstrapped test exists when MPI was found
cmake --build "$build" --target help | grep -q "test_cuda_mpi" && targets+=(test_cuda_mpi)
cmake --build "$build" --target "${targets[@]}" -j "$(nproc)"
ctest --test-dir "$build" -L cuda --output-on-failure
"$build/benchmarks/bench_nccl" "$@"
