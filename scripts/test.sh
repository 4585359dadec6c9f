#!/usr/bin/env bash
# Sets up, builds and runs pdo's whole test suite: unit, compile-fail, MPI (under mpirun),
# examples, the package tests and, when the CUDA toolkit is present, the CUDA tests (the GPU
# tests, the main demo and the broadest test programs are then built by nvcc, for sm_80 and
# sm_90); then the GPU tests
# on simulated CUDA devices (tests/cuda_sim), a clang++ build, an ASan + UBSan build of the
# unit tests (g++), and a ThreadSanitizer build of the concurrency tests.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
jobs=$(nproc)
elapsed() { echo "== $((SECONDS / 60)) min $((SECONDS % 60)) s $*"; }
bash "$here/scripts/setup.sh" --tests

echo "== build and test (g++; the GPU tests and the broadest programs by nvcc when the CUDA toolkit is present)"
# No debug info; no GPU runs this build's device code (compiled for sm_80 and sm_90 and linked),
# so ptxas optimises it lightly. scripts/gpu_check.sh builds it fully optimised. The examples
# are built at -O2, as a user builds them; the test programs at -O1 with the aliasing rules of
# -O2 (a quarter less compile time; the clang++ build below compiles its tests at -O2). The
# benchmarks are built only to check that they compile (no test runs them): without optimisation.
bash "$here/scripts/configure.sh" "$here/build-test" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -DNDEBUG" \
  -DCMAKE_CUDA_FLAGS_RELWITHDEBINFO="-O2 -DNDEBUG" -DCMAKE_CUDA_FLAGS="-Xptxas=-O1" -DPDO_BENCHMARK_OPTIONS=-O0 \
  -DPDO_TEST_OPTIONS="-O1;-fstrict-aliasing"
cmake --build "$here/build-test" -j "$jobs"
cmake --build "$here/build-test" --target all_verify_interface_header_sets -j "$jobs"
ctest --test-dir "$here/build-test" --output-on-failure -j "$jobs"

elapsed so far
echo "== simulated CUDA devices (tests/cuda_sim): the GPU tests and the examples on GPU places, on 2 and 4 devices, with and"
echo "   without peer access, in one process and under mpirun"
bash "$here/scripts/configure.sh" "$here/build-sim" -DPDO_CUDA_SIMULATOR=ON -DPDO_WITH_CUDA=OFF -DPDO_BUILD_BENCHMARKS=OFF \
  -DPDO_INSTALL=OFF -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -DNDEBUG"
cmake --build "$here/build-sim" --target test_cuda test_cuda_mpi expressions redistribute_tour -j "$jobs"
ctest --test-dir "$here/build-sim" --output-on-failure -j "$jobs" -L sim

elapsed so far
echo "== clang++ build of the unit tests and the demo"
# (no debug info: about a quarter of clang++'s time over these programs)
bash "$here/scripts/configure.sh" "$here/build-clang" -DCMAKE_CXX_COMPILER=clang++ -DPDO_WITH_CUDA=OFF -DPDO_WITH_MPI=OFF \
  -DPDO_BUILD_BENCHMARKS=OFF -DPDO_INSTALL=OFF -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -DNDEBUG"
cmake --build "$here/build-clang" --target test_core test_collectives test_redistribute test_parallel_do test_expr test_io quickstart digits -j "$jobs"
ctest --test-dir "$here/build-clang" --output-on-failure -j "$jobs" -R "^(test_(core|collectives|redistribute|parallel_do|expr|io)|example\.(quickstart|digits))$"

elapsed so far
echo "== AddressSanitizer + UndefinedBehaviorSanitizer build of the unit tests"
# (no debug info, a tenth of the build's time: UBSan's messages carry their source lines without
# it, and ASan's stacks name the functions; each memory access checked by a call into ASan's
# runtime rather than by inline code: the same checks, a tenth less compile time)
bash "$here/scripts/configure.sh" "$here/build-asan" -DPDO_WITH_CUDA=OFF -DPDO_WITH_MPI=OFF -DPDO_BUILD_EXAMPLES=OFF \
  -DPDO_BUILD_BENCHMARKS=OFF -DPDO_INSTALL=OFF -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG= \
  -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -O0 \
  --param=asan-instrumentation-with-call-threshold=0"
cmake --build "$here/build-asan" --target test_core test_redistribute test_parallel_do test_collectives test_expr test_expr_mesh test_matmul_mesh \
  test_autograd test_nn test_model_parallel test_io -j "$jobs"
ASAN_OPTIONS="detect_leaks=1" ctest --test-dir "$here/build-asan" --output-on-failure -j "$jobs" \
  -R "^test_(core|redistribute|parallel_do|collectives|expr|expr_mesh|matmul_mesh|autograd|nn|model_parallel|io)$"

elapsed so far
echo "== ThreadSanitizer build of the engine, the threads backend, parallel_do, expressions, the trainers"
# (-g1: the line tables ThreadSanitizer's reports need, without the rest of the debug info: a fifth of the time)
bash "$here/scripts/configure.sh" "$here/build-tsan" -DPDO_WITH_CUDA=OFF -DPDO_WITH_MPI=OFF -DPDO_BUILD_EXAMPLES=OFF \
  -DPDO_BUILD_BENCHMARKS=OFF -DPDO_WITH_OPENMP=OFF -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-g1 \
  -DCMAKE_CXX_FLAGS="-fsanitize=thread -O1"
cmake --build "$here/build-tsan" --target test_engine test_collectives test_parallel_do test_expr test_nn test_pipeline -j "$jobs"
TSAN_OPTIONS="halt_on_error=1" ctest --test-dir "$here/build-tsan" --output-on-failure -R "^test_(engine|collectives|parallel_do|expr|nn|pipeline)$"
elapsed in all
