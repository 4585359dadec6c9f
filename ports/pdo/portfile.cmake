# ports/pdo/portfile.cmake: vcpkg port of pdo (header-only), used as an overlay port from this repository.
# Its source is the repository it lives in: `vcpkg install pdo --overlay-ports=<repository>/ports`. A port
# in a registry would fetch a release here instead (vcpkg_from_git(OUT_SOURCE_PATH SOURCE_PATH ...)).
get_filename_component(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)

# Header-only: a debug build would install the same files.
set(VCPKG_BUILD_TYPE release)

vcpkg_check_features(OUT_FEATURE_OPTIONS feature_options
    FEATURES
        mpi  PDO_WITH_MPI
        cuda PDO_WITH_CUDA
        io   PDO_WITH_IO
        blas PDO_WITH_BLAS
)

vcpkg_cmake_configure(
    SOURCE_PATH "${SOURCE_PATH}"
    OPTIONS
        -DPDO_INSTALL=ON
        -DPDO_BUILD_TESTS=OFF
        -DPDO_BUILD_EXAMPLES=OFF
        -DPDO_BUILD_BENCHMARKS=OFF
        -DPDO_USE_SINGLE_INCLUDE=OFF
        ${feature_options}
)
vcpkg_cmake_install()
# pdo installs its config in share/cmake/pdo (PDO_INSTALL_CMAKEDIR); vcpkg wants it in share/pdo.
vcpkg_cmake_config_fixup(PACKAGE_NAME pdo CONFIG_PATH share/cmake/pdo)

file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug")

file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
