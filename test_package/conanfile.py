# test_package/conanfile.py: builds and runs a small program against the pdo package that `conan create` made.
import os

from conan import ConanFile
from conan.tools.build import can_run
from conan.tools.cmake import CMake, CMakeDeps, CMakeToolchain, cmake_layout


class PdoTestPackageConan(ConanFile):
    settings = "os", "arch", "compiler", "build_type"

    def requirements(self):
        self.requires(self.tested_reference_str)

    def layout(self):
        cmake_layout(self)

    def generate(self):
        CMakeDeps(self).generate()
        toolchain = CMakeToolchain(self)
        # With pdo/*:with_mpi=True the same program is also built on pdo::mpi.
        toolchain.cache_variables["PDO_TEST_MPI"] = bool(self.dependencies["pdo"].options.with_mpi)
        toolchain.generate()

    def build(self):
        cmake = CMake(self)
        cmake.configure()
        cmake.build()

    def test(self):
        if not can_run(self):
            return
        self.run(os.path.join(self.cpp.build.bindir, "test_package"), env="conanrun")
        if self.dependencies["pdo"].options.with_mpi:
            self.run(os.path.join(self.cpp.build.bindir, "test_package_mpi"), env="conanrun")
