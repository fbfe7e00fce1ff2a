# Imports the installed torch's headers and libraries as target fastinfer_torch, read from the
# Python package itself rather than TorchConfig.cmake: that config insists on a CUDA toolkit
# whenever torch is a CUDA build, which would break FASTINFER_CUDA=OFF and CPU-only machines, and
# it injects its own architecture flags. Needs only what the bindings use: c10, torch_cpu and,
# with CUDA kernels, c10_cuda (streams and device guards).
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import os, torch; d = os.path.dirname(torch.__file__); print(os.path.join(d, 'include')); print(os.path.join(d, 'lib')); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.__version__)"
  OUTPUT_VARIABLE _torch_paths OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "fastinfer: cannot import torch with ${Python_EXECUTABLE}")
endif()
string(REPLACE "\n" ";" _torch_paths "${_torch_paths}")
list(GET _torch_paths 0 FASTINFER_TORCH_INCLUDE_DIR)
list(GET _torch_paths 1 FASTINFER_TORCH_LIB_DIR)
list(GET _torch_paths 2 _torch_cxx11_abi)
list(GET _torch_paths 3 FASTINFER_TORCH_VERSION)
message(STATUS "fastinfer: torch ${FASTINFER_TORCH_VERSION} at ${FASTINFER_TORCH_LIB_DIR}")

set(_torch_libs c10 torch_cpu)
if(FASTINFER_WITH_CUDA)
  list(APPEND _torch_libs c10_cuda)
endif()
add_library(fastinfer_torch INTERFACE)
foreach(_lib IN LISTS _torch_libs)
  find_library(FASTINFER_TORCH_${_lib} NAMES ${_lib} PATHS "${FASTINFER_TORCH_LIB_DIR}" NO_DEFAULT_PATH REQUIRED)
  target_link_libraries(fastinfer_torch INTERFACE "${FASTINFER_TORCH_${_lib}}")
endforeach()
target_include_directories(fastinfer_torch SYSTEM INTERFACE
  "${FASTINFER_TORCH_INCLUDE_DIR}" "${FASTINFER_TORCH_INCLUDE_DIR}/torch/csrc/api/include")
target_compile_definitions(fastinfer_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=${_torch_cxx11_abi})
