#!/usr/bin/env python3
"""Generates single_include/pdo/pdo.hpp from include/pdo/pdo.hpp.

Every `#include <pdo/...>` is replaced by the header's text, wrapped in an include guard.
A header met outside any `#if` is written once; one met inside a backend's `#if defined
(PDO_WITH_...)` block is written there (once per distinct chain of conditions) and again
where it is next needed outside such a block (the guard keeps the second copy out when the
first was compiled). `--check` exits 1
when the committed file differs from what would be generated.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
INCLUDE = ROOT / "include"
OUTPUT = ROOT / "single_include" / "pdo" / "pdo.hpp"
BANNER = """// pdo: parallel tensor programs over meshes of places. Single-header edition.
// Generated from include/ by tools/amalgamate.py: do not edit by hand.
#pragma once
"""
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*<(pdo/[^>]+)>\s*$')


def guard_name(relative):
    return "PDO_SINGLE_" + re.sub(r"[^A-Za-z0-9]", "_", relative).upper()


def expand(relative, conditions, seen, out):
    """Writes `relative` unless it was written under the same or no `#if` conditions."""
    if () in seen.get(relative, set()) or conditions in seen.get(relative, set()):
        return
    seen.setdefault(relative, set()).add(conditions)
    guard = guard_name(relative)
    out.append(f"// ---- {relative}\n#ifndef {guard}\n#define {guard}\n")
    stack = []
    for line in (INCLUDE / relative).read_text().splitlines(keepends=True):
        stripped = line.strip()
        if stripped == "#pragma once":
            continue
        if re.match(r"#\s*if", stripped):
            stack.append(stripped)
        elif re.match(r"#\s*endif", stripped):
            stack.pop()
        match = INCLUDE_RE.match(line)
        if match:
            expand(match.group(1), conditions + tuple(stack), seen, out)
        else:
            out.append(line)
    out.append(f"#endif  // {guard}\n")


def generate():
    out = [BANNER]
    expand("pdo/pdo.hpp", (), {}, out)
    return "".join(out)


def main():
    text = generate()
    if "--check" in sys.argv[1:]:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(ROOT)} is out of date: run python3 tools/amalgamate.py")
            return 1
        print(f"{OUTPUT.relative_to(ROOT)} is up to date")
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
