# tests/package/find_package_test.cmake: cmake -P script: install pdo, move the prefix, build and run consumers.
# Inputs: PDO_SOURCE_DIR, CONSUMER_SOURCE_DIR, WORK_DIR, GENERATOR, CXX_COMPILER, WITH_MPI.
cmake_minimum_required(VERSION 3.25)

include(${CMAKE_CURRENT_LIST_DIR}/package_test_common.cmake)
require_inputs(find_package_test PDO_SOURCE_DIR CONSUMER_SOURCE_DIR WORK_DIR GENERATOR CXX_COMPILER)
if(WITH_MPI)
  set(WITH_MPI ON)
else()
  set(WITH_MPI OFF)
endif()

set(pdo_build ${WORK_DIR}/pdo-build)
set(stage ${WORK_DIR}/stage)
set(prefix ${WORK_DIR}/prefix)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

# 1. Install pdo: headers and package config only (no tests, examples, benchmarks, CUDA).
run_step("configure pdo" ${CMAKE_COMMAND} -S ${PDO_SOURCE_DIR} -B ${pdo_build} -G ${GENERATOR}
         -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=${stage}
         -DPDO_INSTALL=ON -DPDO_BUILD_TESTS=OFF -DPDO_BUILD_EXAMPLES=OFF -DPDO_BUILD_BENCHMARKS=OFF
         -DPDO_WITH_CUDA=OFF -DPDO_WITH_MPI=${WITH_MPI})
run_step("build pdo" ${CMAKE_COMMAND} --build ${pdo_build} --config Release)
run_step("install pdo" ${CMAKE_COMMAND} --install ${pdo_build} --config Release)

# 2. The installed package must be relocatable: consumers use it from another directory.
file(RENAME ${stage} ${prefix})
file(GLOB_RECURSE config_file ${prefix}/*/pdoConfig.cmake)
if(NOT config_file)
  message(FATAL_ERROR "install put no pdoConfig.cmake under the prefix")
endif()
file(GLOB_RECURSE installed_header ${prefix}/include/pdo/pdo.hpp)
if(NOT installed_header)
  message(FATAL_ERROR "install put no pdo/pdo.hpp under <prefix>/include")
endif()

# Configures, builds and tests the consumer asking for `components` (a ;-list, may be empty);
# further arguments go to its configuration.
function(consumer name components)
  set(build ${WORK_DIR}/consumer-${name})
  run_step("configure consumer ${name}" ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${build} -G ${GENERATOR}
           -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix}
           -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF "-DCONSUMER_COMPONENTS=${components}" ${ARGN})
  file(STRINGS ${build}/CMakeCache.txt pdo_dir REGEX "^pdo_DIR:")
  string(FIND "${pdo_dir}" "${prefix}/" at)
  if(NOT at GREATER -1)
    message(FATAL_ERROR "consumer ${name} found pdo outside the installed prefix: ${pdo_dir}")
  endif()
  run_step("build consumer ${name}" ${CMAKE_COMMAND} --build ${build} --config Release)
  run_step("run consumer ${name}" ${CMAKE_CTEST_COMMAND} --test-dir ${build} -C Release --output-on-failure)
endfunction()

# 3. pdo::pdo alone: find_package(pdo 0.1 CONFIG REQUIRED), distribute and gather.
consumer(plain "")

# 4. Components: the installed ones build; missing and unknown ones fail find_package with a reason.
if(WITH_MPI)
  consumer(mpi "MPI")
  # installed with MPI, used where MPI is missing: linking pdo::mpi unasked says why, not "MPI::MPI_CXX not found"
  expect_failure("consumer linking pdo::mpi where MPI is missing"
                 "pdo: target app_mpi links pdo::mpi, which cannot be used here: pdo's MPI[ \n]+component needs MPI"
                 ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${WORK_DIR}/consumer-mpi-missing -G ${GENERATOR}
                 -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_PREFIX_PATH=${prefix} -DCONSUMER_LINK_MPI=ON
                 -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON)
else()
  expect_failure("consumer asking for MPI" "pdo was installed without its MPI component"
                 ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${WORK_DIR}/consumer-no-mpi -G ${GENERATOR}
                 -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_PREFIX_PATH=${prefix} -DCONSUMER_COMPONENTS=MPI)
endif()
expect_failure("consumer asking for CUDA" "pdo was installed without its CUDA component"
               ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${WORK_DIR}/consumer-no-cuda -G ${GENERATOR}
               -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_PREFIX_PATH=${prefix} -DCONSUMER_COMPONENTS=CUDA)
# 5. CUDA on simulated devices: the consumer configured with PDO_CUDA_SIMULATOR=ON gets pdo::cuda
#    from the simulator's installed sources and runs on pdo::cuda_places() here.
consumer(cuda_simulator "CUDA" -DPDO_CUDA_SIMULATOR=ON)
expect_failure("consumer asking for an unknown component" "pdo has no component \"Bogus\""
               ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${WORK_DIR}/consumer-bogus -G ${GENERATOR}
               -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_PREFIX_PATH=${prefix} -DCONSUMER_COMPONENTS=Bogus)

# 6. Thrust outside the compiler's default folders (as the CUDA toolkit's CCCL is): the installed
#    package carries the folder pdo was built with, so a consumer builds without naming it.
find_path(thrust_dir thrust/version.h PATHS /usr/include $ENV{CUDA_HOME}/include/cccl /usr/local/cuda/include/cccl NO_CACHE)
if(NOT thrust_dir)
  message(FATAL_ERROR "no thrust/version.h found to copy")
endif()
set(thrust_elsewhere ${WORK_DIR}/thrust-elsewhere)
file(COPY ${thrust_dir}/thrust DESTINATION ${thrust_elsewhere})
set(prefix ${WORK_DIR}/prefix-thrust)
run_step("configure pdo with Thrust in ${thrust_elsewhere}" ${CMAKE_COMMAND} -S ${PDO_SOURCE_DIR} -B ${pdo_build}-thrust
         -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=${prefix}
         -DPDO_INSTALL=ON -DPDO_BUILD_TESTS=OFF -DPDO_BUILD_EXAMPLES=OFF -DPDO_BUILD_BENCHMARKS=OFF
         -DPDO_WITH_CUDA=OFF -DPDO_WITH_MPI=OFF -DPDO_THRUST_INCLUDE_DIR=${thrust_elsewhere})
run_step("install pdo with Thrust in ${thrust_elsewhere}" ${CMAKE_COMMAND} --install ${pdo_build}-thrust --config Release)
consumer(thrust_elsewhere "" -DCMAKE_EXPORT_COMPILE_COMMANDS=ON)
file(READ ${WORK_DIR}/consumer-thrust_elsewhere/compile_commands.json commands)
string(FIND "${commands}" "${thrust_elsewhere}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "the consumer's compile commands do not name the Thrust folder pdo was built with "
                      "(${thrust_elsewhere}):\n${commands}")
endif()

# 7. Installed with its CUDA component (where nvcc is): pdo::cuda names no library by this
#    machine's path; a consumer's find_package finds NCCL beside its own CUDA toolkit.
find_program(nvcc nvcc PATHS $ENV{CUDA_HOME}/bin /usr/local/cuda/bin NO_CACHE)
if(nvcc)
  set(cuda_prefix ${WORK_DIR}/prefix-cuda)
  run_step("configure pdo with CUDA" ${CMAKE_COMMAND} -S ${PDO_SOURCE_DIR} -B ${pdo_build}-cuda -G ${GENERATOR}
           -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_CUDA_COMPILER=${nvcc} -DCMAKE_BUILD_TYPE=Release
           -DCMAKE_INSTALL_PREFIX=${cuda_prefix} -DPDO_INSTALL=ON -DPDO_BUILD_TESTS=OFF -DPDO_BUILD_EXAMPLES=OFF
           -DPDO_BUILD_BENCHMARKS=OFF -DPDO_WITH_CUDA=ON -DPDO_WITH_MPI=OFF)
  run_step("install pdo with CUDA" ${CMAKE_COMMAND} --install ${pdo_build}-cuda --config Release)
  file(GLOB_RECURSE cuda_targets ${cuda_prefix}/*/pdoCudaTargets.cmake)
  if(NOT cuda_targets)
    message(FATAL_ERROR "install with PDO_WITH_CUDA=ON put no pdoCudaTargets.cmake under the prefix")
  endif()
  file(READ ${cuda_targets} exported)
  if(exported MATCHES "/[^ ;\"]*libnccl[^ ;\"]*")
    message(FATAL_ERROR "the installed pdo::cuda names NCCL by a path of the machine that built it: ${CMAKE_MATCH_0}")
  endif()
  set(build ${WORK_DIR}/consumer-cuda)
  run_step("configure a consumer of pdo::cuda" ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${build} -G ${GENERATOR}
           -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${cuda_prefix}
           -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCONSUMER_COMPONENTS=CUDA)
  file(STRINGS ${build}/CMakeCache.txt nccl REGEX "^PDO_NCCL_LIBRARY:")
  if(NOT nccl MATCHES "nccl")
    message(FATAL_ERROR "the consumer's find_package(pdo COMPONENTS CUDA) found no NCCL: ${nccl}")
  endif()
endif()

# 8. With clang++, pdo::pdo turns clang's OpenMP optimisation pass off (it serves offloading and
#    doubles the compile time), unless the consumer's target sets PDO_CLANG_OPENMP_OPT.
find_program(clangxx clang++ NO_CACHE)
if(clangxx)
  foreach(keep OFF ON)
    set(build ${WORK_DIR}/consumer-clang-${keep})
    run_step("configure a clang++ consumer (PDO_CLANG_OPENMP_OPT ${keep})" ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${build}
             -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${clangxx} -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix}
             -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_EXPORT_COMPILE_COMMANDS=ON -DCONSUMER_KEEP_OPENMP_OPT=${keep})
    file(READ ${build}/compile_commands.json commands)
    string(FIND "${commands}" "-Xclang -mllvm -Xclang -openmp-opt-disable" at)
    if(keep AND NOT at EQUAL -1)
      message(FATAL_ERROR "a target that sets PDO_CLANG_OPENMP_OPT is still compiled without clang's OpenMP pass:\n${commands}")
    elseif(NOT keep AND at EQUAL -1)
      message(FATAL_ERROR "the clang++ consumer's compile commands lack -Xclang -mllvm -Xclang -openmp-opt-disable:\n${commands}")
    endif()
  endforeach()
endif()

message(STATUS "find_package_test: all consumers passed")
