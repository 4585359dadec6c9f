# tests/package/package_test_common.cmake: helpers shared by the package test scripts (cmake -P).

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
