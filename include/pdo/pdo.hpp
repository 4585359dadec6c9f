// pdo/pdo.hpp: the whole public API of pdo.
#pragma once

// (config.hpp gives the one message of a standard older than C++20; nothing more is included then)
#include <pdo/core/config.hpp>
#if PDO_HAS_CXX20

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
