// pdo/core/config.hpp: configuration macros shared by every layer.
#pragma once

// Under an older standard the headers would fail in thousands of lines: one message instead,
// first whichever header a program includes. PDO_HAS_CXX20 says whether the standard is
// C++20 or later (pdo/pdo.hpp includes nothing more when it is not).
#if __cplusplus < 202002L && !(defined(_MSVC_LANG) && _MSVC_LANG >= 202002L)
#error "pdo: needs C++20: compile with -std=c++20 (or later); in CMake, link the program to pdo::pdo, which asks for it"
#define PDO_HAS_CXX20 0
#else
#define PDO_HAS_CXX20 1
#endif

/// @brief Marks a function callable on the host and, under nvcc, on the device.
#if defined(__CUDACC__)
#define PDO_HD __host__ __device__
#else
#define PDO_HD
#endif

/// @brief Placed before a loop whose iterations do not depend on each other through
/// memory (its pointers may alias as far as the compiler knows, but never overlap in
/// the ranges it touches): lets the compiler vectorise it without run-time checks.
#if defined(__CUDACC__)
#define PDO_IVDEP
#elif defined(__clang__)
#define PDO_IVDEP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define PDO_IVDEP _Pragma("GCC ivdep")
#else
#define PDO_IVDEP
#endif

/// @brief Keeps a function out of its callers: for the bookkeeping of an operation (checks,
/// messages, submission) that every instantiation of a template calls, so that it is
/// compiled once in a translation unit, not again inside each instantiation.
#if defined(__GNUC__) || defined(__clang__)
#define PDO_NOINLINE __attribute__((noinline))
#else
#define PDO_NOINLINE
#endif

#define PDO_VERSION_MAJOR 0
#define PDO_VERSION_MINOR 1
#define PDO_VERSION_PATCH 0

namespace pdo::detail {

/// @brief Tells the core the calling thread is spinning (x86's pause, Arm's yield), so a
/// short spin costs the other hyperthread and the memory system little.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace pdo::detail
