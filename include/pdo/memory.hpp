// pdo/memory.hpp: the memory layer (per-place caching allocators and their statistics).
#pragma once

#include <pdo/memory/caching_allocator.hpp>
#include <pdo/memory/memory_stats.hpp>
