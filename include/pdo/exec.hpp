// pdo/exec.hpp: the execution layer: the engine, mesh-wide operations (spmd, distribute,
// redistribute, gather), evaluation (eval, eval_async, wait_all), parallel_do,
// prefetch.
#pragma once

#include <pdo/exec/engine.hpp>
#include <pdo/exec/eval.hpp>
#include <pdo/exec/mesh_ops.hpp>
#include <pdo/exec/parallel_do.hpp>
#include <pdo/exec/prefetch.hpp>
#include <pdo/exec/run_on_places.hpp>
#include <pdo/exec/trace.hpp>
