#!/usr/bin/env bash
# Builds pdo's API reference from the comments in include/pdo with Doxygen (docs/api/Doxyfile)
# into OUT_DIR/html (default build-docs/api). Any Doxygen warning (an undocumented public name,
# a broken reference) fails the build and is printed.
#   bash scripts/api_docs.sh [OUT_DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$here/build-docs/api}
if ! command -v doxygen >/dev/null; then
  echo "api_docs: doxygen is not installed (Debian: apt-get install doxygen; scripts/setup.sh installs it)" >&2
  exit 1
fi
mkdir -p "$out"
rm -f "$out/warnings.log"
cd "$here"
if ! { cat docs/api/Doxyfile; echo "OUTPUT_DIRECTORY = $out"; echo "WARN_LOGFILE = $out/warnings.log"; } | doxygen - >"$out/doxygen.log" 2>&1 ||
   [ -s "$out/warnings.log" ]; then
  cat "$out/doxygen.log" "$out/warnings.log" 2>/dev/null >&2
  echo "api_docs: FAIL: $(grep -c . "$out/warnings.log" 2>/dev/null || echo 0) warning(s); document every public name (outside pdo::detail)" >&2
  exit 1
fi
echo "api_docs: $out/html/index.html ($(doxygen --version), no warnings)"
