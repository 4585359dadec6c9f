# ctest script: compiles SOURCE, a program that must not compile, with COMPILER and pdo's
# include directories, definitions and options (INCLUDES, DEFINES, OPTIONS, ;-lists), and
# checks what a user reads: the compiler fails; its output matches EXPECT; its first error
# line is a message of pdo's ("pdo: ..."); it is the only error; and the output is at most
# MOST_LINES lines long, since a layout mistake should cost one message, not pages of
# instantiation context.
set(args -std=c++20 -fsyntax-only)
foreach(dir IN LISTS INCLUDES)
  list(APPEND args "-I${dir}")
endforeach()
foreach(def IN LISTS DEFINES)
  list(APPEND args "-D${def}")
endforeach()
list(APPEND args ${OPTIONS} ${SOURCE})
include(${CMAKE_CURRENT_LIST_DIR}/package/package_test_common.cmake)
expect_failure("compiling ${SOURCE}" "${EXPECT}" ${COMPILER} ${args})
set(out "${expect_failure_output}")
string(REGEX MATCH "[^\n]*error[^\n]*" first_error "${out}")
if(NOT first_error MATCHES "error: (static assertion failed: |static_assert failed due to requirement [^\n]*\")?pdo: ")
  message(FATAL_ERROR "the first error is not one of pdo's messages: ${first_error}")
endif()
# one error: nothing is instantiated after it that reports more (the result's uses included)
string(REGEX MATCHALL "[0-9]+:[0-9]+: error: " errors "${out}")
list(LENGTH errors error_count)
if(error_count GREATER 1)
  message(FATAL_ERROR "${error_count} errors, not one:\n${out}")
endif()
string(REGEX MATCHALL "\n" newlines "${out}")
list(LENGTH newlines lines)
if(lines GREATER MOST_LINES)
  message(FATAL_ERROR "${lines} lines of compiler output, more than ${MOST_LINES}:\n${out}")
endif()
message(STATUS "first error: ${first_error}\n${lines} lines of compiler output")
