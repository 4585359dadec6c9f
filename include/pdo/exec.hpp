// pdo/exec.hpp: the execution layer (running work on the places of a mesh, parallel_do).
#pragma once

#include <pdo/exec/parallel_do.hpp>
#include <pdo/exec/run_on_places.hpp>
