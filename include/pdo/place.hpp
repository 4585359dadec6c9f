// pdo/place.hpp: the place layer (places, meshes).
#pragma once

#include <pdo/place/cpu_place.hpp>
#include <pdo/place/cuda_place.hpp>
#include <pdo/place/mesh.hpp>
#include <pdo/place/place_concept.hpp>
