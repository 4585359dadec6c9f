# Install rules: headers, the exported targets and a relocatable package config.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(pdo_targets pdo)
if(TARGET pdo_mpi)
  list(APPEND pdo_targets pdo_mpi)
endif()
if(TARGET pdo_cuda)
  list(APPEND pdo_targets pdo_cuda)
endif()
set(PDO_INSTALL_CMAKEDIR ${CMAKE_INSTALL_DATADIR}/cmake/pdo CACHE STRING "Where pdoConfig.cmake is installed")

install(TARGETS ${pdo_targets} EXPORT pdoTargets FILE_SET HEADERS DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT pdoTargets NAMESPACE pdo:: DESTINATION ${PDO_INSTALL_CMAKEDIR})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/pdoConfig.cmake.in ${CMAKE_CURRENT_BINARY_DIR}/pdoConfig.cmake
                              INSTALL_DESTINATION ${PDO_INSTALL_CMAKEDIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/pdoConfigVersion.cmake COMPATIBILITY SameMajorVersion
                                 ARCH_INDEPENDENT)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/pdoConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/pdoConfigVersion.cmake
        DESTINATION ${PDO_INSTALL_CMAKEDIR})
