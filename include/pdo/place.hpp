// pdo/place.hpp: the place layer (places, their lanes, copies between their memories, meshes).
#pragma once

#include <pdo/place/copy.hpp>
#include <pdo/place/cpu_place.hpp>
#include <pdo/place/cuda_place.hpp>
#include <pdo/place/lane.hpp>
#include <pdo/place/mesh.hpp>
#include <pdo/place/place_concept.hpp>
