// pdo/core/error.hpp: the exception hierarchy every run-time failure is reported with.
#pragma once

#include <stdexcept>
#include <string>

namespace pdo {

/// @brief Base of every exception pdo throws. Messages name the op, the shapes,
/// the layouts and the place involved, in one line.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// @brief A shape that does not fit the op (mismatched extents, wrong rank of data).
class shape_error : public error {
 public:
  using error::error;
};

/// @brief A layout or mesh that cannot be used as asked (wrong mesh, bad extents).
class layout_error : public error {
 public:
  using error::error;
};

/// @brief A collective or point-to-point transfer that failed or was aborted.
class communication_error : public error {
 public:
  using error::error;
};

/// @brief Members of a collective passed arguments that disagree (sizes, roots, counts).
/// Every member of the group throws it alike, so none is left waiting.
class mismatch_error : public communication_error {
 public:
  using communication_error::communication_error;
};

/// @brief A collective given up because another place of its group failed: the echo of
/// that failure, not a cause of its own.
class collective_aborted : public communication_error {
 public:
  using communication_error::communication_error;
};

/// @brief An allocation over a place's memory cap, or refused by the system.
class out_of_memory : public error {
 public:
  using error::error;
};

/// @brief A file that could not be read or written.
class io_error : public error {
 public:
  using error::error;
};

}  // namespace pdo
