// pdo/core/error.hpp: the exception hierarchy every run-time failure is reported with, and
// how a failure travels to another thread or process (detail::captured_error).
#pragma once

#include <exception>
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

namespace detail {

/// @brief Which pdo::error subclass an exception is, as a small code that can travel
/// between processes; 0 for anything that is not a pdo::error.
inline int error_kind(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const collective_aborted&) {
    return 8;
  } catch (const mismatch_error&) {
    return 7;
  } catch (const communication_error&) {
    return 6;
  } catch (const shape_error&) {
    return 2;
  } catch (const layout_error&) {
    return 3;
  } catch (const out_of_memory&) {
    return 4;
  } catch (const io_error&) {
    return 5;
  } catch (const error&) {
    return 1;
  } catch (...) {
    return 0;
  }
}

/// @brief Throws the pdo::error subclass of code `kind` (see error_kind) with `message`.
[[noreturn]] inline void throw_error_of_kind(int kind, const std::string& message) {
  switch (kind) {
    case 2: throw shape_error(message);
    case 3: throw layout_error(message);
    case 4: throw out_of_memory(message);
    case 5: throw io_error(message);
    case 6: throw communication_error(message);
    case 7: throw mismatch_error(message);
    case 8: throw collective_aborted(message);
    default: throw error(message);
  }
}

inline std::string message_of(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

/// @brief A caught exception as kind (see error_kind) and message, so it can be thrown
/// again on another thread or process. The exception object itself stays on the thread
/// that caught it: an exception_ptr released on a different thread than the one that read
/// it races in the eyes of ThreadSanitizer (libstdc++ counts its references uninstrumented).
struct captured_error {
  int kind = 0;
  std::string message;

  /// @brief The exception being handled (call inside a catch block).
  [[nodiscard]] static captured_error current() {
    const std::exception_ptr failure = std::current_exception();
    return {error_kind(failure), message_of(failure)};
  }
  /// @brief Whether this failure only echoes another place's abort of the collectives.
  [[nodiscard]] bool is_abort_echo() const { return kind == 8; }
  /// @brief Throws it again with `context` in front of its message, keeping its pdo::error subclass.
  [[noreturn]] void rethrow_with_context(const std::string& context) const { throw_error_of_kind(kind, context + message); }
};

}  // namespace detail
}  // namespace pdo
