# pdo_cuda_simulator(<dir> <pdo target>): pdo::cuda on the simulated CUDA devices whose
# sources are in <dir> (tests/cuda_sim in the source tree; share/pdo/cuda_sim once installed):
# the library pdo_cuda_sim, built by the host compiler, whose headers stand in for the CUDA
# toolkit's (cuda_runtime_api.h, cublas_v2.h, nccl.h). For tests of code that runs on GPU
# places, on machines without a GPU: see <dir>/README.md for what the simulation checks.
function(pdo_cuda_simulator dir pdo_target)
  if(TARGET pdo_cuda_sim)
    return()
  endif()
  find_package(Threads REQUIRED)
  add_library(pdo_cuda_sim STATIC ${dir}/src/runtime.cpp ${dir}/src/cublas.cpp ${dir}/src/nccl.cpp)
  # before any other include directory: these headers stand in for the toolkit's
  target_include_directories(pdo_cuda_sim BEFORE PUBLIC ${dir}/include)
  target_compile_features(pdo_cuda_sim PUBLIC cxx_std_20)
  set_target_properties(pdo_cuda_sim PROPERTIES POSITION_INDEPENDENT_CODE ON)
  target_link_libraries(pdo_cuda_sim PUBLIC Threads::Threads)
  if(TARGET BLAS::BLAS)
    include(CheckIncludeFileCXX)
    check_include_file_cxx(cblas.h pdo_cuda_sim_cblas)
    if(pdo_cuda_sim_cblas)
      target_compile_definitions(pdo_cuda_sim PRIVATE CUDA_SIM_WITH_CBLAS)
      target_link_libraries(pdo_cuda_sim PRIVATE BLAS::BLAS)
    endif()
  endif()
  find_package(MPI QUIET COMPONENTS CXX)
  if(MPI_CXX_FOUND)  # communicators across processes talk over MPI (its C API)
    target_compile_definitions(pdo_cuda_sim PRIVATE CUDA_SIM_WITH_MPI OMPI_SKIP_MPICXX=1)
    target_link_libraries(pdo_cuda_sim PRIVATE MPI::MPI_CXX)
  endif()
  add_library(pdo_cuda INTERFACE)
  target_link_libraries(pdo_cuda INTERFACE ${pdo_target} pdo_cuda_sim)
  target_compile_definitions(pdo_cuda INTERFACE PDO_WITH_CUDA PDO_CUDA_SIMULATOR)
  add_library(pdo::cuda ALIAS pdo_cuda)
endfunction()
