// pdo/core/config.hpp: configuration macros shared by every layer.
#pragma once

/// @brief Marks a function callable on the host and, under nvcc, on the device.
#if defined(__CUDACC__)
#define PDO_HD __host__ __device__
#else
#define PDO_HD
#endif

#define PDO_VERSION_MAJOR 0
#define PDO_VERSION_MINOR 1
#define PDO_VERSION_PATCH 0
