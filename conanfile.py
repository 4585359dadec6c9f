# conanfile.py: Conan 2 recipe for pdo, a header-only package with optional MPI, CUDA and IO components.
# What pdo needs from outside comes from the system, found by CMake when a consumer is configured (the
# build modules below): Thrust (Debian's libthrust-dev or the CUDA toolkit's CCCL) and range-v3
# (Debian's librange-v3-dev) always, OpenMP (the compiler's runtime) with with_openmp, a BLAS
# (OpenBLAS preferred) with with_blas, MPI with with_mpi, the CUDA toolkit and NCCL with with_cuda;
# nlohmann_json, for the IO component, is a Conan requirement.
import os
import textwrap

from conan import ConanFile
from conan.tools.build import check_min_cppstd
from conan.tools.files import copy, save
from conan.tools.layout import basic_layout

required_conan_version = ">=2.0"


class PdoConan(ConanFile):
    name = "pdo"
    version = "0.1.0"
    description = "Parallel tensor programs over meshes of places (header-only C++20)"
    license = "Apache-2.0"
    topics = ("tensor", "parallel", "mpi", "cuda", "header-only")
    package_type = "header-library"
    # The settings only let validate() check the C++ standard; package_id() drops them.
    settings = "os", "arch", "compiler", "build_type"
    # The options change what package_info() declares, never the files in the package.
    options = {"with_openmp": [True, False], "with_blas": [True, False], "with_mpi": [True, False],
               "with_cuda": [True, False], "with_io": [True, False]}
    default_options = {"with_openmp": True, "with_blas": True, "with_mpi": False, "with_cuda": False,
                       "with_io": False}
    exports_sources = "include/*", "cmake/*", "CMakeLists.txt", "LICENSE*"
    no_copy_source = True

    # Included by CMakeDeps after it declares the targets: they give pdo::pdo Thrust's include folder,
    # range-v3, OpenMP (or, without it, the simd loops alone) and the system BLAS, and pdo::mpi the system MPI.
    _thrust_build_module = os.path.join("lib", "cmake", "pdo", "pdo-conan-thrust.cmake")
    _ranges_build_module = os.path.join("lib", "cmake", "pdo", "pdo-conan-range-v3.cmake")
    _openmp_build_module = os.path.join("lib", "cmake", "pdo", "pdo-conan-openmp.cmake")
    _no_openmp_build_module = os.path.join("lib", "cmake", "pdo", "pdo-conan-no-openmp.cmake")
    _blas_build_module = os.path.join("lib", "cmake", "pdo", "pdo-conan-blas.cmake")
    _mpi_build_module = os.path.join("lib", "cmake", "pdo", "pdo-conan-mpi.cmake")

    def layout(self):
        basic_layout(self, src_folder=".")

    def requirements(self):
        if self.options.with_io:
            self.requires("nlohmann_json/3.11.3")

    def package_id(self):
        self.info.clear()

    def validate(self):
        check_min_cppstd(self, 20)

    def package(self):
        copy(self, "*.hpp", src=os.path.join(self.source_folder, "include"),
             dst=os.path.join(self.package_folder, "include"))
        copy(self, "LICENSE*", src=self.source_folder, dst=os.path.join(self.package_folder, "licenses"))
        # Written whatever the options, so that one package serves every consumer.
        save(self, os.path.join(self.package_folder, self._thrust_build_module), textwrap.dedent("""\
            # pdo-conan-thrust.cmake: gives pdo::pdo the include folder of the system's Thrust.
            find_path(PDO_THRUST_INCLUDE_DIR thrust/version.h
                      PATHS /usr/include "$ENV{CUDA_HOME}/include/cccl" /usr/local/cuda/include/cccl)
            if(NOT PDO_THRUST_INCLUDE_DIR)
              message(FATAL_ERROR "pdo needs Thrust: install libthrust-dev (Debian) or the CUDA toolkit, "
                                  "or set PDO_THRUST_INCLUDE_DIR to the folder that holds thrust/version.h")
            endif()
            if(NOT PDO_THRUST_INCLUDE_DIR STREQUAL "/usr/include")
              set_property(TARGET pdo::pdo APPEND PROPERTY INTERFACE_INCLUDE_DIRECTORIES "${PDO_THRUST_INCLUDE_DIR}")
            endif()
            """))
        save(self, os.path.join(self.package_folder, self._ranges_build_module), textwrap.dedent("""\
            # pdo-conan-range-v3.cmake: links pdo::pdo to the system's range-v3 (the views pdo's loops use).
            find_package(range-v3 QUIET)
            if(NOT range-v3_FOUND)
              message(FATAL_ERROR "pdo needs range-v3 0.11 or later: install librange-v3-dev (Debian), "
                                  "or set range-v3_DIR to the folder that holds range-v3-config.cmake")
            endif()
            set_property(TARGET pdo::pdo APPEND PROPERTY INTERFACE_LINK_LIBRARIES range-v3::range-v3)
            """))
        # OpenMP: the same rules as pdo's own CMake build (cmake/pdoOpenMP.cmake), one module per option value.
        copy(self, "pdoOpenMP.cmake", src=os.path.join(self.source_folder, "cmake"),
             dst=os.path.join(self.package_folder, "lib", "cmake", "pdo"))
        for module, with_openmp in ((self._openmp_build_module, "ON"), (self._no_openmp_build_module, "OFF")):
            save(self, os.path.join(self.package_folder, module), textwrap.dedent(f"""\
                # {os.path.basename(module)}: kernels of a place with several cores on {"all of them (OpenMP)" if with_openmp == "ON" else "one of them (simd loops only)"}.
                include("${{CMAKE_CURRENT_LIST_DIR}}/pdoOpenMP.cmake")
                pdo_use_openmp(pdo::pdo {with_openmp})
                """))
        save(self, os.path.join(self.package_folder, self._blas_build_module), textwrap.dedent("""\
            # pdo-conan-blas.cmake: links pdo::pdo to the system BLAS (OpenBLAS preferred), matmul's sgemm/dgemm.
            set(BLA_VENDOR OpenBLAS)
            find_package(BLAS QUIET)
            if(NOT BLAS_FOUND)
              unset(BLA_VENDOR)
              find_package(BLAS REQUIRED)
            endif()
            set_property(TARGET pdo::pdo APPEND PROPERTY INTERFACE_LINK_LIBRARIES BLAS::BLAS)
            """))
        save(self, os.path.join(self.package_folder, self._mpi_build_module), textwrap.dedent("""\
            # pdo-conan-mpi.cmake: links pdo::mpi to the system MPI (Conan declares only its define).
            find_package(MPI REQUIRED COMPONENTS CXX)
            set_property(TARGET pdo::mpi APPEND PROPERTY INTERFACE_LINK_LIBRARIES MPI::MPI_CXX)
            """))

    def package_info(self):
        self.cpp_info.set_property("cmake_file_name", "pdo")
        # The aggregate of every component the options turned on; pdo::pdo is the core alone.
        self.cpp_info.set_property("cmake_target_name", "pdo::all")

        core = self.cpp_info.components["pdo"]
        core.set_property("cmake_target_name", "pdo::pdo")
        core.bindirs = []
        core.libdirs = []
        if self.settings.os in ("Linux", "FreeBSD"):
            core.system_libs = ["pthread"]
        build_modules = [self._thrust_build_module, self._ranges_build_module,
                         self._openmp_build_module if self.options.with_openmp else self._no_openmp_build_module]
        if self.options.with_blas:
            # cblas.h and the library come from the system (Debian: libopenblas-dev)
            core.defines = ["PDO_WITH_BLAS"]
            build_modules.append(self._blas_build_module)

        if self.options.with_mpi:
            # MPI comes from the system (Open MPI from apt, or any MPI-3 library), not from Conan:
            # CMake consumers get it through the build module (find_package(MPI)); others must
            # add their MPI's include and link flags (mpicxx --showme) themselves.
            mpi = self.cpp_info.components["mpi"]
            mpi.set_property("cmake_target_name", "pdo::mpi")
            mpi.requires = ["pdo"]
            mpi.defines = ["PDO_WITH_MPI"]
            mpi.bindirs = []
            mpi.libdirs = []
            build_modules.append(self._mpi_build_module)

        if self.options.with_io:
            io = self.cpp_info.components["io"]
            io.set_property("cmake_target_name", "pdo::io")
            io.requires = ["pdo", "nlohmann_json::nlohmann_json"]
            io.defines = ["PDO_WITH_IO"]
            io.bindirs = []
            io.libdirs = []

        if self.options.with_cuda:
            # The CUDA toolkit and NCCL come from the system: their library folder must be on the
            # linker's search path (e.g. LIBRARY_PATH or -L$CUDA_HOME/lib64).
            cuda = self.cpp_info.components["cuda"]
            cuda.set_property("cmake_target_name", "pdo::cuda")
            cuda.requires = ["pdo"]
            cuda.defines = ["PDO_WITH_CUDA"]
            cuda.system_libs = ["cudart", "cublas", "nccl"]
            cuda.bindirs = []
            cuda.libdirs = []

        self.cpp_info.set_property("cmake_build_modules", build_modules)
