# examples/digits_resume.cmake: cmake -P script (-DDIGITS=<digits> -DDIR=<scratch directory>).
# Trains 3 epochs straight; then 2 epochs with --checkpoint and 1 more with --resume, on the
# same places: the third epoch's loss and accuracy must be printed alike. A resume on another
# number of places must run too.
file(REMOVE_RECURSE ${DIR})
function(run out)
  execute_process(COMMAND ${DIGITS} --target 0 ${ARGN} OUTPUT_VARIABLE text ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "digits ${ARGN} failed (${rc}):\n${text}\n${err}")
  endif()
  # the last epoch's line, without its samples/s
  string(REGEX MATCHALL "epoch +[0-9]+  loss [0-9.]+  accuracy [0-9.]+" epochs "${text}")
  list(GET epochs -1 last)
  set(${out} "${last}" PARENT_SCOPE)
  message(STATUS "digits ${ARGN}: ${last}")
endfunction()
run(straight --places 2 --epochs 3)
run(first --places 2 --epochs 2 --checkpoint ${DIR}/ck)
run(resumed --places 2 --epochs 1 --resume ${DIR}/ck)
if(NOT straight STREQUAL resumed)
  message(FATAL_ERROR "resumed: \"${resumed}\", 3 epochs straight: \"${straight}\"")
endif()
run(elsewhere --places 3 --epochs 1 --resume ${DIR}/ck)
if(NOT elsewhere MATCHES "^epoch +3 ")
  message(FATAL_ERROR "the resume on 3 places did not train the third epoch: \"${elsewhere}\"")
endif()
file(REMOVE_RECURSE ${DIR})
message(STATUS "digits: the resumed third epoch equals the straight one")
