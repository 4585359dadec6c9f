# pdoOpenMP.cmake: pdo_use_openmp(<target> <ON|OFF>) says how the kernels of a CPU place with several
# cores use them, for pdo::pdo as this project builds it and as the Conan package declares it.
# ON: <target> links OpenMP::OpenMP_CXX (also under nvcc, whose CPU places' kernels are host code);
# OFF: the kernels run on one core of a place, and their simd loops still vectorise (-fopenmp-simd).
function(pdo_use_openmp target with_openmp)
  if(with_openmp)
    find_package(OpenMP COMPONENTS CXX QUIET)
    if(NOT OpenMP_CXX_FOUND)
      message(FATAL_ERROR
        "pdo was asked to run kernels with OpenMP (PDO_WITH_OPENMP=ON, Conan pdo/*:with_openmp=True), but "
        "find_package(OpenMP) found no OpenMP for the ${CMAKE_CXX_COMPILER_ID} compiler: install its runtime "
        "(Debian: libgomp1 for g++, libomp-dev for clang++), or turn the option off (the kernels then use one "
        "core of each place)")
    endif()
    target_link_libraries(${target} INTERFACE OpenMP::OpenMP_CXX)
    target_compile_options(${target} INTERFACE $<$<COMPILE_LANG_AND_ID:CUDA,NVIDIA>:-Xcompiler=-fopenmp>)
    # clang's OpenMP optimisation pass (openmp-opt) serves OpenMP offloading, which pdo does not
    # use, and spends half of clang's time on a program of pdo (examples/tensor_parallel.cpp:
    # 63 s with it, 32 s without; test_io: 340 s, 125 s): a program that links pdo is compiled
    # without it, unless the program's target sets PDO_CLANG_OPENMP_OPT (its own OpenMP
    # offloading, say). Spelt through -Xclang: given as `-mllvm -openmp-opt-disable`, ccache
    # preprocesses with the -mllvm and without its value, fails, and caches nothing.
    target_compile_options(${target} INTERFACE
      "$<$<AND:$<COMPILE_LANG_AND_ID:CXX,Clang>,$<VERSION_GREATER_EQUAL:$<CXX_COMPILER_VERSION>,12>,$<NOT:$<BOOL:$<TARGET_PROPERTY:PDO_CLANG_OPENMP_OPT>>>>:SHELL:-Xclang -mllvm -Xclang -openmp-opt-disable>")
  else()
    target_compile_options(${target} INTERFACE $<$<COMPILE_LANG_AND_ID:CXX,GNU,Clang>:-fopenmp-simd>
                                               $<$<COMPILE_LANG_AND_ID:CUDA,NVIDIA>:-Xcompiler=-fopenmp-simd>)
  endif()
endfunction()
