# tests/package/package_test_common.cmake: helpers shared by the package test scripts and the
# compile-fail check (cmake -P).

# Stops the script unless every variable named after the first argument is set and not empty.
function(require_inputs script)
  foreach(input ${ARGN})
    if(NOT DEFINED ${input} OR "${${input}}" STREQUAL "")
      message(FATAL_ERROR "${script}: pass -D${input}=...")
    endif()
  endforeach()
endfunction()

# Runs a command, prints it, and stops the test when it fails.
function(run_step what)
  message(STATUS "${what}: ${ARGN}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}")
  endif()
endfunction()

# Runs a command that must fail with output matching `regex`; leaves its output in
# `expect_failure_output`.
function(expect_failure what regex)
  message(STATUS "${what} (must fail): ${ARGN}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(rc EQUAL 0)
    message(FATAL_ERROR "${what} succeeded but should have failed:\n${out}")
  endif()
  if(NOT out MATCHES "${regex}")
    message(FATAL_ERROR "${what} failed without the expected message \"${regex}\":\n${out}")
  endif()
  set(expect_failure_output "${out}" PARENT_SCOPE)
endfunction()
