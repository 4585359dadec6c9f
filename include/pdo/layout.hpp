// pdo/layout.hpp: the layout layer (layout types, checks, redistribution plans).
#pragma once

#include <pdo/layout/layout.hpp>
#include <pdo/layout/layout_check.hpp>
#include <pdo/layout/layout_type.hpp>
#include <pdo/layout/layout_value.hpp>
#include <pdo/layout/propagation.hpp>
#include <pdo/layout/redistribute_plan.hpp>
