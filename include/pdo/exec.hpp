// pdo/exec.hpp: the execution layer (parallel_do, eval, eval_async, wait_all).
#pragma once

#include <pdo/exec/eval.hpp>
#include <pdo/exec/parallel_do.hpp>
