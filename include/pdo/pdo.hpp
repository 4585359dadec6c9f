// pdo/pdo.hpp: the whole public API of pdo.
#pragma once

// Under an older standard the headers would fail in thousands of lines: one message instead.
#if __cplusplus < 202002L && !(defined(_MSVC_LANG) && _MSVC_LANG >= 202002L)
#error "pdo: needs C++20: compile with -std=c++20 (or later); in CMake, link the program to pdo::pdo, which asks for it"
#else

#include <pdo/autograd.hpp>
#include <pdo/comm.hpp>
#include <pdo/core.hpp>
#include <pdo/exec.hpp>
#include <pdo/expr.hpp>
#include <pdo/kernels.hpp>
#include <pdo/layout.hpp>
#include <pdo/memory.hpp>
#include <pdo/nn.hpp>
#include <pdo/place.hpp>
#include <pdo/plan.hpp>
#include <pdo/tensor.hpp>

// checkpoints, safetensors and .npy: with the pdo::io target (it needs nlohmann/json)
#if defined(PDO_WITH_IO)
#include <pdo/io.hpp>
#endif

#endif
