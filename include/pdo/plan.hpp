// pdo/plan.hpp: the planner's public face (plan_of, explain, strict).
#pragma once

#include <pdo/plan/explain.hpp>
#include <pdo/plan/plan.hpp>
