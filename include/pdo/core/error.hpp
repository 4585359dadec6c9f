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

/// @brief A collective that waited longer than its mesh's timeout for members that did not
/// arrive (see mesh_options::collective_timeout). Every member that arrived throws it, so
/// the program can go on (to save its state, say); the group it ran on is unusable after it.
class collective_timeout : public communication_error {
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

/// @brief Which pdo::error subclass a failure is: how a failure travels to another thread
/// or process, where it is thrown again as the same subclass.
enum class error_kind : unsigned char {
  other,             ///< not a pdo::error (a std::exception of another kind)
  generic,           ///< pdo::error itself
  shape,             ///< pdo::shape_error
  layout,            ///< pdo::layout_error
  out_of_memory,     ///< pdo::out_of_memory
  io,                ///< pdo::io_error
  communication,     ///< pdo::communication_error
  mismatch,          ///< pdo::mismatch_error
  aborted,           ///< pdo::collective_aborted
  timeout,           ///< pdo::collective_timeout
};

namespace detail {

/// @brief The error_kind of `failure`.
inline error_kind kind_of(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const collective_aborted&) {
    return error_kind::aborted;
  } catch (const collective_timeout&) {
    return error_kind::timeout;
  } catch (const mismatch_error&) {
    return error_kind::mismatch;
  } catch (const communication_error&) {
    return error_kind::communication;
  } catch (const shape_error&) {
    return error_kind::shape;
  } catch (const layout_error&) {
    return error_kind::layout;
  } catch (const out_of_memory&) {
    return error_kind::out_of_memory;
  } catch (const io_error&) {
    return error_kind::io;
  } catch (const error&) {
    return error_kind::generic;
  } catch (...) {
    return error_kind::other;
  }
}

/// @brief Throws the pdo::error subclass of `kind` with `message` (pdo::error for `other`).
[[noreturn]] inline void throw_error_of_kind(error_kind kind, const std::string& message) {
  switch (kind) {
    case error_kind::shape: throw shape_error(message);
    case error_kind::layout: throw layout_error(message);
    case error_kind::out_of_memory: throw out_of_memory(message);
    case error_kind::io: throw io_error(message);
    case error_kind::communication: throw communication_error(message);
    case error_kind::mismatch: throw mismatch_error(message);
    case error_kind::aborted: throw collective_aborted(message);
    case error_kind::timeout: throw collective_timeout(message);
    case error_kind::other:
    case error_kind::generic: break;
  }
  throw error(message);
}

/// @brief Whether every member of a group that spans processes learns of a failure of this
/// kind alike (argument mismatches, timeouts), so each process can go on after it.
constexpr bool shared_by_all_members(error_kind kind) { return kind == error_kind::mismatch || kind == error_kind::timeout; }

inline std::string message_of(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

/// @brief Stands for the result of a call whose compile error was given (a layout that does
/// not fit, an expression that is not well formed): only its type is used, so that the
/// program's uses of the result report nothing more. Such a program does not compile, so
/// this never runs.
template <class R>
[[noreturn]] R unformed_result() {
  throw error("pdo: the result of a call that does not compile was used");
}

/// @brief Of two failures found in this order, whether the later one (of kind `later`) is
/// the one to report rather than the earlier one (of kind `earlier`): the first failure is,
/// unless it only echoes another place's abort of the collectives and a later one does not.
[[nodiscard]] constexpr bool tells_more_than(error_kind later, error_kind earlier) {
  return earlier == error_kind::aborted && later != error_kind::aborted;
}

/// @brief A caught exception as its error_kind and message, so it can be thrown
/// again on another thread or process. The exception object itself stays on the thread
/// that caught it: an exception_ptr released on a different thread than the one that read
/// it races in the eyes of ThreadSanitizer (libstdc++ counts its references uninstrumented).
struct captured_error {
  error_kind kind = error_kind::other;
  std::string message;

  /// @brief The exception being handled (call inside a catch block).
  [[nodiscard]] static captured_error current() {
    const std::exception_ptr failure = std::current_exception();
    return {kind_of(failure), message_of(failure)};
  }
  /// @brief Throws it again with `context` in front of its message, keeping its pdo::error subclass.
  [[noreturn]] void rethrow_with_context(const std::string& context) const { throw_error_of_kind(kind, context + message); }
};

}  // namespace detail
}  // namespace pdo
