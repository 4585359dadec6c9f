// pdo/exec.hpp: the execution layer (parallel_do).
#pragma once

#include <pdo/exec/parallel_do.hpp>
