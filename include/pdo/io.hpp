// pdo/io.hpp: the io layer: sharded checkpoints (save, load with resharding), safetensors and
// .npy files. Needs nlohmann/json (the pdo::io target brings it; PDO_WITH_IO is then defined).
#pragma once

#include <pdo/io/checkpoint.hpp>
#include <pdo/io/file.hpp>
#include <pdo/io/npy.hpp>
#include <pdo/io/safetensors.hpp>
#include <pdo/io/state.hpp>
