// pdo/comm/mpi/environment.hpp: MPI start-up, datatypes and error checking for the MPI backend.
#pragma once

#include <pdo/core/dtype.hpp>
#include <pdo/core/error.hpp>

#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1  // the C API is all pdo uses
#endif
#include <mpi.h>

#include <climits>
#include <concepts>
#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>

namespace pdo::mpi {

namespace detail {

/// @brief What runs at the program's end before MPI_Finalize, once pdo's collectives are
/// watched (watch::start sets it: the watch tells the processes still waiting for this one
/// that it has ended).
inline void (*&before_finalize())() {
  static void (*hook)() = nullptr;
  return hook;
}

inline void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (before_finalize() != nullptr) before_finalize()();
  MPI_Finalize();
}

inline void check(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw communication_error(std::string("mpi: ") + call + " failed: " + std::string(text, static_cast<std::size_t>(length)));
}

template <class T>
MPI_Datatype datatype() {
  if constexpr (std::same_as<T, float>) return MPI_FLOAT;
  else if constexpr (std::same_as<T, double>) return MPI_DOUBLE;
  else if constexpr (std::same_as<T, long double>) return MPI_LONG_DOUBLE;
  else if constexpr (std::signed_integral<T>) {
    if constexpr (sizeof(T) == 1) return MPI_INT8_T;
    else if constexpr (sizeof(T) == 2) return MPI_INT16_T;
    else if constexpr (sizeof(T) == 4) return MPI_INT32_T;
    else return MPI_INT64_T;
  } else {
    if constexpr (sizeof(T) == 1) return MPI_UINT8_T;
    else if constexpr (sizeof(T) == 2) return MPI_UINT16_T;
    else if constexpr (sizeof(T) == 4) return MPI_UINT32_T;
    else return MPI_UINT64_T;
  }
}

/// @brief MPI's user function for max (Max) or min over floating-point elements: NaN
/// wins wherever it sits (MPI_MAX's result depends on which rank holds the NaN).
template <bool Max>
void nan_extremum(void* in, void* inout, int* length, MPI_Datatype* type) {
  auto run = [&](auto* a) {
    using T = std::remove_pointer_t<decltype(a)>;
    const T* b = static_cast<const T*>(in);
    for (int i = 0; i < *length; ++i) a[i] = Max ? pdo::detail::nan_max(b[i], a[i]) : pdo::detail::nan_min(b[i], a[i]);
  };
  if (*type == MPI_FLOAT) run(static_cast<float*>(inout));
  else if (*type == MPI_DOUBLE) run(static_cast<double*>(inout));
  else run(static_cast<long double*>(inout));
}

/// @brief The MPI_Op of nan_extremum<Max>, made on first use (after MPI started); MPI_Finalize
/// releases it.
template <bool Max>
MPI_Op nan_extremum_op() {
  static const MPI_Op made = [] {
    MPI_Op o = MPI_OP_NULL;
    check(MPI_Op_create(&nan_extremum<Max>, /*commute=*/1, &o), "MPI_Op_create");
    return o;
  }();
  return made;
}

/// @brief The MPI reduction of `o` over elements of type T.
template <class T>
MPI_Op op(reduce_op o) {
  switch (o) {
    case reduce_op::sum: return MPI_SUM;
    case reduce_op::max: return std::floating_point<T> ? nan_extremum_op<true>() : MPI_MAX;
    case reduce_op::min: return std::floating_point<T> ? nan_extremum_op<false>() : MPI_MIN;
  }
  return MPI_SUM;
}

/// @brief `n` as an MPI count, or an error naming the op when it does not fit an int.
inline int count(std::size_t n, const char* op) {
  if (n > static_cast<std::size_t>(INT_MAX))
    throw communication_error(std::string("mpi: ") + op + ": " + std::to_string(n) +
                              " elements exceed MPI's int count; split the tensor");
  return static_cast<int>(n);
}

}  // namespace detail

/// @brief Starts MPI (with MPI_THREAD_MULTIPLE, as places call it from their own
/// threads) unless it is running already; MPI is finalized when the program exits.
inline void initialize() {
  // two host threads that start MPI at once would both call MPI_Init_thread
  static std::mutex starting;
  const std::lock_guard lock(starting);
  int started = 0;
  MPI_Initialized(&started);
  if (started) {
    int level = 0;
    MPI_Query_thread(&level);
    if (level < MPI_THREAD_MULTIPLE)
      throw communication_error("mpi: MPI was started without MPI_THREAD_MULTIPLE, which places need; start it with "
                                "MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) or let pdo start it");
    return;
  }
  int provided = 0;
  detail::check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
  std::atexit(detail::finalize_at_exit);
  if (provided < MPI_THREAD_MULTIPLE)
    throw communication_error("mpi: the MPI library does not provide MPI_THREAD_MULTIPLE, which places need");
}

/// @brief This process's rank in MPI_COMM_WORLD.
inline int rank() {
  initialize();
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

/// @brief The number of processes in MPI_COMM_WORLD.
inline int size() {
  initialize();
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

}  // namespace pdo::mpi
