// pdo/core.hpp: the core layer (strings, errors, shapes, element types).
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/dtype.hpp>
#include <pdo/core/error.hpp>
#include <pdo/core/fixed_string.hpp>
#include <pdo/core/shape.hpp>
#include <pdo/core/copy_elements.hpp>
#include <pdo/core/type_list.hpp>
