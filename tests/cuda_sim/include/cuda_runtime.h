// tests/cuda_sim/include/cuda_runtime.h: pdo's CUDA simulator (see cuda_runtime_api.h).
#pragma once
#include <cuda_runtime_api.h>
