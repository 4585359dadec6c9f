# Install rules: headers, the exported targets and a relocatable package config.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(pdo_targets pdo)
if(TARGET pdo_mpi)
  list(APPEND pdo_targets pdo_mpi)
endif()
if(TARGET pdo_io)
  list(APPEND pdo_targets pdo_io)
endif()
set(PDO_INSTALL_CMAKEDIR ${CMAKE_INSTALL_DATADIR}/cmake/pdo CACHE STRING "Where pdoConfig.cmake is installed")

install(TARGETS ${pdo_targets} EXPORT pdoTargets FILE_SET HEADERS DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT pdoTargets NAMESPACE pdo:: DESTINATION ${PDO_INSTALL_CMAKEDIR})
# pdo::cuda of the CUDA toolkit in an export set of its own: a consumer that asks for the
# simulated devices (PDO_CUDA_SIMULATOR) gets pdo::cuda from the simulator's sources instead
if(PDO_WITH_CUDA)
  install(TARGETS pdo_cuda EXPORT pdoCudaTargets FILE_SET HEADERS DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(EXPORT pdoCudaTargets NAMESPACE pdo:: DESTINATION ${PDO_INSTALL_CMAKEDIR})
endif()
# the simulated CUDA devices' sources, for consumers that test GPU code without a GPU
# (PDO_CUDA_SIMULATOR; a source package without them installs pdo without them)
if(EXISTS ${PROJECT_SOURCE_DIR}/tests/cuda_sim/src)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/tests/cuda_sim/ DESTINATION ${CMAKE_INSTALL_DATADIR}/pdo/cuda_sim
          FILES_MATCHING PATTERN "*.h" PATTERN "*.hpp" PATTERN "*.cpp" PATTERN "*.md")
  install(FILES ${PROJECT_SOURCE_DIR}/cmake/pdoCudaSimulator.cmake DESTINATION ${PDO_INSTALL_CMAKEDIR})
  # the NCCL backend's headers, which pdo::cuda installs in a CUDA build, for those consumers too
  if(NOT PDO_WITH_CUDA)
    install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/pdo/comm/nccl DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/pdo/comm
            FILES_MATCHING PATTERN "*.hpp")
  endif()
endif()
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/pdoConfig.cmake.in ${CMAKE_CURRENT_BINARY_DIR}/pdoConfig.cmake
                              INSTALL_DESTINATION ${PDO_INSTALL_CMAKEDIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/pdoConfigVersion.cmake COMPATIBILITY SameMajorVersion
                                 ARCH_INDEPENDENT)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/pdoConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/pdoConfigVersion.cmake
        DESTINATION ${PDO_INSTALL_CMAKEDIR})
# the licence (Apache-2.0) beside the headers' package
install(FILES ${PROJECT_SOURCE_DIR}/LICENSE DESTINATION ${CMAKE_INSTALL_DATADIR}/doc/pdo)
