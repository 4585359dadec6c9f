#!/usr/bin/env bash
# tests/package/conan_test.sh: creates pdo's Conan package with no remote and runs test_package against it.
# Usage: conan_test.sh SOURCE_DIR WORK_DIR VERSION [GENERATOR] [WITH_MPI]
# Exits 77 (ctest's SKIP_RETURN_CODE) when no Conan 2 client is on the PATH and none can be installed.
set -euo pipefail

source_dir=$1
work_dir=$2
version=$3
generator=${4:-}
with_mpi=${5:-OFF}

fail() { echo "package.conan: FAIL: $*" >&2; exit 1; }
skip() { echo "package.conan: SKIP: $*"; exit 77; }
step() { echo "package.conan: $*"; }

is_conan2() { "$@" --version 2>/dev/null | grep -Eq '^Conan version 2\.'; }

# 1. A Conan 2 client: the one on the PATH, else one installed under the build folder (kept between runs).
tools_dir=$work_dir/tools
venv=$tools_dir/venv
target=$tools_dir/pip-target
pip_args=(--quiet --disable-pip-version-check --timeout 30 --retries 1 "conan>=2,<3")
conan=()
if command -v conan >/dev/null && is_conan2 conan; then
  conan=(conan)
elif [ -x "$venv/bin/conan" ] && is_conan2 "$venv/bin/conan"; then
  conan=("$venv/bin/conan")
elif [ -x "$target/bin/conan" ] && PYTHONPATH=$target is_conan2 "$target/bin/conan"; then
  conan=(env "PYTHONPATH=$target" "$target/bin/conan")
else
  command -v python3 >/dev/null || skip "no conan on the PATH and no python3 to install it with"
  mkdir -p "$tools_dir"
  rm -rf "$venv" "$target"
  # A virtual environment needs Debian's python3-venv; pip --target works where it is missing
  # and is allowed where the system Python is marked externally managed.
  if python3 -m venv "$venv" >/dev/null 2>&1 && "$venv/bin/python" -m pip install "${pip_args[@]}"; then
    conan=("$venv/bin/conan")
  elif python3 -m pip install --target "$target" "${pip_args[@]}"; then
    conan=(env "PYTHONPATH=$target" "$target/bin/conan")
  else
    skip "no conan on the PATH, and installing it with pip failed (python3-venv or python3-pip missing, or no package index)"
  fi
  is_conan2 "${conan[@]}" || skip "conan was installed but does not run"
fi
step "using $("${conan[@]}" --version)"

# 2. A fresh Conan home with the detected profile and no remote: nothing can be downloaded.
export CONAN_HOME=$work_dir/home
rm -rf "$CONAN_HOME" "$work_dir/test_package" "$work_dir/cppstd17"
mkdir -p "$CONAN_HOME"
"${conan[@]}" profile detect >/dev/null 2>&1 || fail "conan profile detect failed"
"${conan[@]}" remote remove "*" >/dev/null
[ -z "$("${conan[@]}" remote list)" ] || fail "remotes left after removing them: $("${conan[@]}" remote list)"

# 3. The recipe's version is the project's.
"${conan[@]}" inspect "$source_dir" | grep -Fqx "version: $version" ||
  fail "conanfile.py's version is not the project's $version"

settings=(-s compiler.cppstd=20)
[ -n "$generator" ] && settings+=(-c "tools.cmake.cmaketoolchain:generator=$generator")

# 4. conan create, with test_package copied out so that its build folder is not left in the sources
#    (and a build folder left there by a manual `conan create .` is not reused).
mkdir -p "$work_dir/test_package"
cp "$source_dir/test_package/conanfile.py" "$source_dir/test_package/CMakeLists.txt" "$source_dir/test_package/"*.cpp \
  "$work_dir/test_package/"
log=$work_dir/create.log
step "conan create $source_dir (log: $log)"
if ! "${conan[@]}" create "$source_dir" --build=missing -tf "$work_dir/test_package" "${settings[@]}" >"$log" 2>&1; then
  tail -n 60 "$log" >&2
  fail "conan create failed"
fi
grep -q "Component target declared 'pdo::pdo'" "$log" || fail "CMakeDeps declared no pdo::pdo target"
grep -q "test_package: pdo distribute and gather over 2 places: ok" "$log" || fail "test_package did not report ok"
grep -q "test_package: matmul on BLAS: ok" "$log" || fail "test_package's matmul did not run on BLAS (with_blas is the default)"
grep -q "test_package: kernels on OpenMP: ok" "$log" ||
  fail "test_package was compiled without OpenMP (with_openmp is the default: pdo::pdo must link OpenMP::OpenMP_CXX)"

# A package whose info package_id() cleared has the id of empty information.
package_dir=$("${conan[@]}" cache path "pdo/$version:da39a3ee5e6b4b0d3255bfef95601890afd80709" 2>/dev/null) ||
  fail "the package id is not the one of a package with no settings and no options (package_id must clear them)"
[ -f "$package_dir/include/pdo/pdo.hpp" ] || fail "the package has no include/pdo/pdo.hpp"

# 5. with_mpi (and with_openmp=False, to build the same program once more for both): the same package (one
#    package id), pdo::mpi declared and usable with the system MPI, the kernels compiled without OpenMP.
if [ "$with_mpi" = ON ]; then
  log=$work_dir/test_mpi.log
  step "conan test with pdo/*:with_mpi=True and pdo/*:with_openmp=False (log: $log)"
  if ! "${conan[@]}" test "$work_dir/test_package" "pdo/$version" -o "pdo/*:with_mpi=True" -o "pdo/*:with_openmp=False" \
      "${settings[@]}" >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    fail "conan test with with_mpi=True and with_openmp=False failed"
  fi
  grep -q "Component target declared 'pdo::mpi'" "$log" || fail "with_mpi=True declared no pdo::mpi target"
  grep -q "RUN: ./test_package_mpi" "$log" || fail "the program on pdo::mpi did not run"
  grep -q "test_package: kernels without OpenMP: ok" "$log" || fail "with_openmp=False still compiled the program with OpenMP"
fi
packages=$("${conan[@]}" list "pdo/$version:*" --format=json | grep -oE '"[0-9a-f]{40}"' | sort -u | wc -l)
[ "$packages" -eq 1 ] || fail "expected one package for every option value, found $packages"

# 6. A profile below C++20 is rejected by validate() with the reason.
if out=$("${conan[@]}" install --requires="pdo/$version" -s compiler.cppstd=17 -of "$work_dir/cppstd17" 2>&1); then
  fail "installing pdo with compiler.cppstd=17 succeeded, validate() should reject it"
fi
grep -q "lower than the required C++ standard (20)" <<<"$out" || fail "C++17 rejected without the reason: $out"

step "ok"
