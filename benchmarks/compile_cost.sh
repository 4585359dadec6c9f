#!/usr/bin/env bash
# What pdo costs at compile time: the time to compile each example (one translation unit,
# object file only) with g++ -O2 and clang++ -O2, and the compiler's output for five typical
# mistakes (tests/compile_fail): its line count and its first error.
#   bash benchmarks/compile_cost.sh [runs=1]
#   bash benchmarks/compile_cost.sh --against <git revision> [runs=1]
# Targets: each example at most 15 s with g++ -O2; each mistake at most 30 lines of g++ output,
# its first error starting with "pdo:". The anchor, compiled in the same run with the same
# flags, is a translation unit that includes only the standard headers pdo's public header
# includes (what any C++20 program of this kind pays before pdo adds anything).
# With --against, g++'s time for each example only, with the headers of that revision and with
# the working tree's, the two compiled at the same time (one on each of two cores) so that both
# see the same machine: a VM's speed can drift by 10-20% over minutes, more than most changes to
# the headers save, and compilations one after the other would compare those minutes.
# ccache is not used; the machine should be otherwise idle.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
against=""
if [ "${1:-}" = --against ]; then
  against=${2:?"compile_cost: --against needs a git revision (a commit, a tag, a branch)"}
  shift 2
fi
runs=${1:-1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

gxx=${CXX_GNU:-g++}
clangxx=${CXX_CLANG:-clang++}
command -v "$clangxx" >/dev/null || clangxx=""

# pdo's include folder, Thrust's (Debian's libthrust-dev, else the CUDA toolkit's CCCL) and the
# definitions the examples' build gives them (BLAS when cblas.h is there, IO for digits).
thrust=""
for d in /usr/include "${CUDA_HOME:-/usr/local/cuda}/include/cccl"; do
  [ -f "$d/thrust/version.h" ] && { thrust=$d; break; }
done
[ -n "$thrust" ] || { echo "compile_cost: Thrust not found (apt-get install libthrust-dev)" >&2; exit 1; }
common=(-std=c++20 -fopenmp)
[ "$thrust" = /usr/include ] || common+=(-isystem "$thrust")
[ -f /usr/include/cblas.h ] || [ -f /usr/include/x86_64-linux-gnu/cblas.h ] && common+=(-DPDO_WITH_BLAS)
flags=(-I"$here/include" "${common[@]}")
[ -f /usr/include/nlohmann/json.hpp ] && io=(-DPDO_WITH_IO) || io=()
# clang++ as pdo::pdo compiles a program with it: without clang's OpenMP optimisation pass
# (offloading's, which pdo does not use; see cmake/pdoOpenMP.cmake)
clang_flags=("${flags[@]}" -Xclang -mllvm -Xclang -openmp-opt-disable)
mpi_flags=()
command -v mpicxx >/dev/null && read -r -a mpi_flags <<<"-DPDO_WITH_MPI $(mpicxx --showme:compile)"

# The median of `runs` compilations of $1 (a source file) by $2 with the rest as flags, in seconds.
compile_time() {
  local src=$1 cxx=$2; shift 2
  local times=()
  for _ in $(seq "$runs"); do
    local start end
    start=$(date +%s.%N)
    "$cxx" "$@" -O2 -c "$src" -o "$work/out.o" 2>"$work/stderr.txt" ||
      { cat "$work/stderr.txt" >&2; echo "compile_cost: $cxx failed on $src" >&2; exit 1; }
    end=$(date +%s.%N)
    times+=("$(python3 -c "print(f'{$end - $start:.2f}')")")
  done
  printf '%s\n' "${times[@]}" | median
}

# The median of the `runs` numbers on standard input, one per line.
median() { sort -n | sed -n "$(( (runs + 1) / 2 ))p"; }

# Whether example $1 (its name) can be compiled here: an MPI example needs mpicxx. When it
# cannot, prints its row saying so.
measurable() {
  local name=$1
  if [[ $name == mpi_* ]] && [ ${#mpi_flags[@]} -eq 0 ]; then
    printf '%-24s %s\n' "$name" "(no mpicxx: not measured)"
    return 1
  fi
}

# The flags the examples' build gives example $2 (its name; $1, its source file) beyond those of
# every example.
example_flags() {
  local src=$1 name=$2
  local extra=()
  # IO as the examples' build gives it: to those that link pdo::io (their checkpoints)
  grep -q "pdo::io::" "$src" && extra+=("${io[@]}")
  case $name in mpi_*) extra+=("${mpi_flags[@]}") ;; esac
  [ ${#extra[@]} -eq 0 ] || printf '%s\n' "${extra[@]}"
}

# timed <file> <command...>: runs the command and writes its wall time in seconds to <file>.
timed() {
  local out=$1 start end
  shift
  start=$(date +%s.%N)
  "$@" 2>"$out.stderr" || { cat "$out.stderr" >&2; echo "compile_cost: failed: $*" >&2; return 1; }
  end=$(date +%s.%N)
  python3 -c "print(f'{$end - $start:.2f}')" >"$out"
}

if [ -n "$against" ]; then
  mkdir -p "$work/before"
  git -C "$here" archive "$against" include | tar -x -C "$work/before" ||
    { echo "compile_cost: no headers at $against" >&2; exit 1; }
  echo "g++ -O2 wall seconds of each example, with the headers of $against (before) and the working tree's"
  echo "(after), the two compiled at the same time; median of $runs pair(s). $("$gxx" --version | head -1)"
  printf '%-24s %9s %9s %13s\n' example before after after/before
  for src in "$here"/examples/*.cpp; do
    name=$(basename "$src" .cpp)
    measurable "$name" || continue
    mapfile -t extra < <(example_flags "$src" "$name")
    befores=() afters=()
    for _ in $(seq "$runs"); do
      timed "$work/before.s" "$gxx" -I"$work/before/include" "${common[@]}" "${extra[@]}" -O2 -c "$src" -o "$work/before.o" &
      job=$!
      timed "$work/after.s" "$gxx" "${flags[@]}" "${extra[@]}" -O2 -c "$src" -o "$work/after.o" || { wait "$job" || true; exit 1; }
      wait "$job" || exit 1
      befores+=("$(cat "$work/before.s")")
      afters+=("$(cat "$work/after.s")")
    done
    before=$(printf '%s\n' "${befores[@]}" | median)
    after=$(printf '%s\n' "${afters[@]}" | median)
    printf '%-24s %9s %9s %13s\n' "$name" "$before" "$after" "$(python3 -c "print(f'{$after / $before:.3f}')")"
  done
  exit 0
fi

# The anchor: the standard headers that include/pdo/pdo.hpp reaches, and nothing of pdo.
grep -rhoE '^#include <[a-z_]+>' "$here/include/pdo" | sort -u > "$work/anchor.cpp"
echo 'int main() { return 0; }' >> "$work/anchor.cpp"

echo "compile time of each example: one translation unit to an object file, -O2, median of $runs run(s)"
echo "g++: $("$gxx" --version | head -1)"
[ -n "$clangxx" ] && echo "clang++: $("$clangxx" --version | head -1)"
printf '%-24s %9s %9s %12s %11s\n' example "g++ s" "clang++ s" "g++/anchor" "g++ target"
anchor_gnu=$(compile_time "$work/anchor.cpp" "$gxx" "${flags[@]}")
anchor_clang=-
[ -n "$clangxx" ] && anchor_clang=$(compile_time "$work/anchor.cpp" "$clangxx" "${clang_flags[@]}")
printf '%-24s %9s %9s %12s %11s\n' "(anchor: std headers)" "$anchor_gnu" "$anchor_clang" 1.00 ""
worst=0
for src in "$here"/examples/*.cpp; do
  name=$(basename "$src" .cpp)
  measurable "$name" || continue
  mapfile -t extra < <(example_flags "$src" "$name")
  gnu=$(compile_time "$src" "$gxx" "${flags[@]}" "${extra[@]}")
  clang=-
  [ -n "$clangxx" ] && clang=$(compile_time "$src" "$clangxx" "${clang_flags[@]}" "${extra[@]}")
  verdict=$(python3 -c "print('ok' if $gnu <= 15 else 'OVER 15 s')")
  printf '%-24s %9s %9s %12s %11s\n' "$name" "$gnu" "$clang" "$(python3 -c "print(f'{$gnu / $anchor_gnu:.1f}')")" "$verdict"
  worst=$(python3 -c "print(max($worst, $gnu))")
done
echo "summary: slowest example ${worst} s with g++ -O2 (target <= 15 s); anchor ${anchor_gnu} s"

echo
echo "compiler output for five typical mistakes (tests/compile_fail, -fsyntax-only)"
printf '%-40s %9s %11s  %s\n' mistake "g++ lines" "clang lines" "g++'s first error"
for name in layout_axis_not_in_mesh strict_implicit_all_reduce layout_rank_mismatch conv2d_kernel_split \
            parallel_do_block_returns_non_tensor; do
  src=$here/tests/compile_fail/$name.cpp
  "$gxx" "${flags[@]}" -fsyntax-only "$src" > "$work/gnu.txt" 2>&1 && { echo "compile_cost: $name compiled (WRONG)"; exit 1; }
  clang_lines=-
  if [ -n "$clangxx" ]; then
    "$clangxx" "${clang_flags[@]}" -fsyntax-only "$src" > "$work/clang.txt" 2>&1 && { echo "compile_cost: $name compiled with clang++ (WRONG)"; exit 1; }
    clang_lines=$(wc -l < "$work/clang.txt")
  fi
  first=$(grep -m1 'error:' "$work/gnu.txt" | sed -e 's/.*error: //' -e 's/^static assertion failed: //')
  mark=""
  [[ $first == pdo:* ]] || mark=" (NOT pdo's)"
  printf '%-40s %9s %11s  %s%s\n' "$name" "$(wc -l < "$work/gnu.txt")" "$clang_lines" "${first:0:100}" "$mark"
done
