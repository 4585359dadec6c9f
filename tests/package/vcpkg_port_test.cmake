# tests/package/vcpkg_port_test.cmake: cmake -P script: runs ports/pdo/portfile.cmake with stand-ins for vcpkg's helpers.
# Inputs: PDO_SOURCE_DIR, CONSUMER_SOURCE_DIR, WORK_DIR, GENERATOR, CXX_COMPILER, VERSION, WITH_MPI.
# The stand-ins do what vcpkg's do for this port (real CMake configure, build and install into a packages
# folder, the config moved to share/pdo with its paths fixed); then the tree is checked as vcpkg's
# post-build checks would, copied to an "installed" folder, and a consumer project builds against it.
cmake_minimum_required(VERSION 3.25)

include(${CMAKE_CURRENT_LIST_DIR}/package_test_common.cmake)
require_inputs(vcpkg_port_test PDO_SOURCE_DIR CONSUMER_SOURCE_DIR WORK_DIR GENERATOR CXX_COMPILER VERSION)

# Stops the test with `message` unless the condition in the remaining arguments holds (as if() reads it).
function(require message)
  if(NOT (${ARGN}))
    message(FATAL_ERROR "vcpkg_port_test: ${message}")
  endif()
endfunction()

set(port_dir ${PDO_SOURCE_DIR}/ports/pdo)
set(port_manifest ${port_dir}/vcpkg.json)

# 1. The manifests, the port's and the repository's: pdo at the project's version, the features, the host
#    tools, Thrust and range-v3 as dependencies and the BLAS as a default feature.
foreach(manifest ${port_manifest} ${PDO_SOURCE_DIR}/vcpkg.json)
  file(READ ${manifest} json)
  string(JSON name GET "${json}" name)
  string(JSON version GET "${json}" version)
  require("${manifest}: name is \"${name}\", not pdo" name STREQUAL "pdo")
  require("${manifest}: version ${version} is not the project's ${VERSION}" version STREQUAL VERSION)
  foreach(feature blas mpi cuda io)
    string(JSON description ERROR_VARIABLE missing GET "${json}" features ${feature} description)
    require("${manifest}: no feature \"${feature}\" with a description" NOT missing)
  endforeach()
  string(JSON dependency_count LENGTH "${json}" dependencies)
  set(host_tools "")
  set(dependencies "")
  math(EXPR last "${dependency_count} - 1")
  foreach(i RANGE ${last})
    string(JSON type TYPE "${json}" dependencies ${i})
    if(type STREQUAL "STRING")
      string(JSON dependency_name GET "${json}" dependencies ${i})
      list(APPEND dependencies ${dependency_name})
      continue()
    endif()
    string(JSON dependency_name GET "${json}" dependencies ${i} name)
    string(JSON host ERROR_VARIABLE not_host GET "${json}" dependencies ${i} host)
    if(NOT not_host AND host)
      list(APPEND host_tools ${dependency_name})
    else()
      list(APPEND dependencies ${dependency_name})
    endif()
  endforeach()
  require("${manifest}: thrust must be a dependency" "thrust" IN_LIST dependencies)
  require("${manifest}: range-v3 must be a dependency" "range-v3" IN_LIST dependencies)
  string(JSON default_features ERROR_VARIABLE missing GET "${json}" default-features)
  string(FIND "${default_features}" "\"blas\"" at)
  require("${manifest}: blas must be a default feature" NOT missing AND at GREATER -1)
  require("${manifest}: vcpkg-cmake must be a host dependency" "vcpkg-cmake" IN_LIST host_tools)
  require("${manifest}: vcpkg-cmake-config must be a host dependency" "vcpkg-cmake-config" IN_LIST host_tools)
endforeach()

# 2. What vcpkg sets before it includes a portfile.
set(PORT pdo)
set(TARGET_TRIPLET x64-linux)
set(VCPKG_TARGET_EXECUTABLE_SUFFIX "")
set(CURRENT_PACKAGES_DIR ${WORK_DIR}/packages/pdo_x64-linux)
set(CURRENT_BUILDTREES_DIR ${WORK_DIR}/buildtrees/pdo)
set(CURRENT_INSTALLED_DIR ${WORK_DIR}/installed/x64-linux)
set(FEATURES core blas)  # blas: the default feature
if(WITH_MPI)
  list(APPEND FEATURES mpi)
endif()
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${CURRENT_PACKAGES_DIR} ${CURRENT_BUILDTREES_DIR} ${CURRENT_INSTALLED_DIR})

# 3. Stand-ins for the vcpkg helpers the portfile calls, for what this port uses of them.

# -D<option>=ON for each named feature in FEATURES, OFF otherwise; every feature must be in the manifest.
function(vcpkg_check_features)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "OUT_FEATURE_OPTIONS" "FEATURES")
  file(READ ${port_manifest} json)
  set(options "")
  set(pairs ${arg_FEATURES})
  while(pairs)
    list(POP_FRONT pairs feature option)
    string(JSON ignored ERROR_VARIABLE missing GET "${json}" features ${feature})
    require("vcpkg_check_features: feature \"${feature}\" is not in ports/pdo/vcpkg.json" NOT missing)
    if(feature IN_LIST FEATURES)
      list(APPEND options -D${option}=ON)
    else()
      list(APPEND options -D${option}=OFF)
    endif()
  endwhile()
  set(${arg_OUT_FEATURE_OPTIONS} ${options} PARENT_SCOPE)
endfunction()

# Configures the release build tree as vcpkg does. The port is header-only and sets VCPKG_BUILD_TYPE
# release, so there is no debug tree (vcpkg would build one into debug/ otherwise).
function(vcpkg_cmake_configure)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "SOURCE_PATH" "OPTIONS;OPTIONS_RELEASE")
  require("the header-only port must set VCPKG_BUILD_TYPE release" VCPKG_BUILD_TYPE STREQUAL "release")
  run_step("vcpkg_cmake_configure" ${CMAKE_COMMAND} -S ${arg_SOURCE_PATH} -B ${CURRENT_BUILDTREES_DIR}/${TARGET_TRIPLET}-rel
           -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Release
           -DCMAKE_INSTALL_PREFIX=${CURRENT_PACKAGES_DIR} -DCMAKE_INSTALL_LIBDIR=lib -DCMAKE_INSTALL_BINDIR=bin
           -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON -DFETCHCONTENT_FULLY_DISCONNECTED=ON
           ${arg_OPTIONS} ${arg_OPTIONS_RELEASE})
endfunction()

# Builds the install target of the configured tree.
function(vcpkg_cmake_install)
  run_step("vcpkg_cmake_install" ${CMAKE_COMMAND} --build ${CURRENT_BUILDTREES_DIR}/${TARGET_TRIPLET}-rel --target install)
endfunction()

# Moves <CONFIG_PATH> to share/<PACKAGE_NAME>, drops a parent folder named cmake, and makes the moved
# files find the prefix two folders up (share/<name>), with no absolute path left in them.
function(vcpkg_cmake_config_fixup)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "PACKAGE_NAME;CONFIG_PATH" "")
  if(NOT arg_PACKAGE_NAME)
    set(arg_PACKAGE_NAME ${PORT})
  endif()
  if(NOT arg_CONFIG_PATH)
    set(arg_CONFIG_PATH share/${arg_PACKAGE_NAME})
  endif()
  set(from ${CURRENT_PACKAGES_DIR}/${arg_CONFIG_PATH})
  set(share ${CURRENT_PACKAGES_DIR}/share/${arg_PACKAGE_NAME})
  require("vcpkg_cmake_config_fixup: ${arg_CONFIG_PATH} does not exist in the package" IS_DIRECTORY ${from})
  if(NOT from STREQUAL share)
    file(GLOB files ${from}/*)
    file(MAKE_DIRECTORY ${share})
    file(COPY ${files} DESTINATION ${share})
    file(REMOVE_RECURSE ${from})
    get_filename_component(parent ${from} DIRECTORY)
    get_filename_component(parent_name ${parent} NAME)
    if(parent_name STREQUAL "cmake")
      file(REMOVE_RECURSE ${parent})
    endif()
  endif()
  file(GLOB_RECURSE cmake_files ${share}/*.cmake)
  foreach(cmake_file ${cmake_files})
    file(READ ${cmake_file} text)
    string(REGEX REPLACE
           "get_filename_component\\(_IMPORT_PREFIX \"\\\${CMAKE_CURRENT_LIST_FILE}\" PATH\\)(\nget_filename_component\\(_IMPORT_PREFIX \"\\\${_IMPORT_PREFIX}\" PATH\\))*"
           "get_filename_component(_IMPORT_PREFIX \"\${CMAKE_CURRENT_LIST_FILE}\" PATH)\nget_filename_component(_IMPORT_PREFIX \"\${_IMPORT_PREFIX}\" PATH)\nget_filename_component(_IMPORT_PREFIX \"\${_IMPORT_PREFIX}\" PATH)"
           text "${text}")
    string(REGEX REPLACE
           "get_filename_component\\(PACKAGE_PREFIX_DIR \"\\\${CMAKE_CURRENT_LIST_DIR}/\\.\\./(\\.\\./)*\" ABSOLUTE\\)"
           "get_filename_component(PACKAGE_PREFIX_DIR \"\${CMAKE_CURRENT_LIST_DIR}/../../\" ABSOLUTE)"
           text "${text}")
    string(REPLACE "${CURRENT_INSTALLED_DIR}" "\${_IMPORT_PREFIX}" text "${text}")
    string(REPLACE "${CURRENT_PACKAGES_DIR}" "\${_IMPORT_PREFIX}" text "${text}")
    file(WRITE ${cmake_file} "${text}")
  endforeach()
endfunction()

# Concatenates the license files into share/<port>/copyright.
function(vcpkg_install_copyright)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "" "FILE_LIST")
  set(text "")
  foreach(license ${arg_FILE_LIST})
    file(READ ${license} license_text)
    string(APPEND text "${license_text}")
  endforeach()
  file(WRITE ${CURRENT_PACKAGES_DIR}/share/${PORT}/copyright "${text}")
endfunction()

# 4. The portfile, as vcpkg runs it (the port itself, not a copy: SOURCE_PATH comes from its location).
message(STATUS "vcpkg_port_test: features ${FEATURES}")
include(${port_dir}/portfile.cmake)

# 5. The tree vcpkg would accept: its post-build checks, for what a header-only port can get wrong.
set(pkg ${CURRENT_PACKAGES_DIR})
foreach(file include/pdo/pdo.hpp share/pdo/pdoConfig.cmake share/pdo/pdoConfigVersion.cmake share/pdo/pdoTargets.cmake
             share/pdo/usage share/pdo/copyright)
  require("the port installed no ${file}" EXISTS ${pkg}/${file})
endforeach()
if(WITH_MPI)
  require("the mpi feature installed no MPI headers" EXISTS ${pkg}/include/pdo/comm/mpi/communicator.hpp)
endif()
foreach(gone debug share/cmake lib bin)
  require("the port left ${gone}/ in the package" NOT EXISTS ${pkg}/${gone})
endforeach()
file(GLOB_RECURSE all_entries LIST_DIRECTORIES TRUE ${pkg}/*)
foreach(entry ${all_entries})
  if(IS_DIRECTORY ${entry})
    file(GLOB children ${entry}/*)
    if(NOT children)
      message(FATAL_ERROR "vcpkg_port_test: empty folder ${entry} in the package")
    endif()
  else()
    file(READ ${entry} text)
    foreach(absolute ${WORK_DIR} ${PDO_SOURCE_DIR})
      string(FIND "${text}" "${absolute}" at)
      require("${entry} holds the absolute path ${absolute}" at EQUAL -1)
    endforeach()
  endif()
endforeach()
file(READ ${pkg}/share/pdo/usage usage)
foreach(line "find_package(pdo CONFIG REQUIRED)" "target_link_libraries(main PRIVATE pdo::pdo)")
  string(FIND "${usage}" "${line}" at)
  require("share/pdo/usage does not say ${line}" at GREATER -1)
endforeach()
file(SIZE ${pkg}/share/pdo/copyright copyright_size)
require("share/pdo/copyright is empty" copyright_size GREATER 0)

# 6. `vcpkg install` copies the package into installed/<triplet>; consumers find it there.
file(COPY ${pkg}/ DESTINATION ${CURRENT_INSTALLED_DIR})
set(consumer_build ${WORK_DIR}/consumer)
set(components "")
if(WITH_MPI)
  set(components MPI)
endif()
run_step("configure consumer" ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${consumer_build} -G ${GENERATOR}
         -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${CURRENT_INSTALLED_DIR}
         -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF "-DCONSUMER_COMPONENTS=${components}")
file(STRINGS ${consumer_build}/CMakeCache.txt pdo_dir REGEX "^pdo_DIR:")
require("the consumer found pdo outside installed/${TARGET_TRIPLET}/share/pdo: ${pdo_dir}"
        pdo_dir STREQUAL "pdo_DIR:PATH=${CURRENT_INSTALLED_DIR}/share/pdo")
run_step("build consumer" ${CMAKE_COMMAND} --build ${consumer_build})
run_step("run consumer" ${CMAKE_CTEST_COMMAND} --test-dir ${consumer_build} --output-on-failure)

message(STATUS "vcpkg_port_test: the port installs a package that consumers find and build against")
