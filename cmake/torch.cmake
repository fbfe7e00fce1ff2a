# Imports the installed torch's headers and libraries as target fastinfer_torch, read from the
# Python package itself rather than TorchConfig.cmake: that config insists on a CUDA toolkit
# whenever torch is a CUDA build, which would break FASTINFER_CUDA=OFF and CPU-only machines, and
# it injects its own architecture flags.
#
# The bindings use only the LibTorch stable ABI (torch/csrc/stable, torch/headeronly: C symbols of
# torch_cpu and, with CUDA kernels, torch_cuda for the current stream), targeting
# FASTINFER_TORCH_ABI_TARGET: the headers then offer nothing newer, and the one build loads under
# every torch from that version on (tests/test_build.py checks the undefined symbols).
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

set(FASTINFER_TORCH_ABI_TARGET "2.11" CACHE STRING "Oldest torch (major.minor) the extension loads under")
string(REPLACE "." ";" _abi "${FASTINFER_TORCH_ABI_TARGET}")
list(GET _abi 0 _abi_major)
list(GET _abi 1 _abi_minor)
math(EXPR _abi_value "(${_abi_major} << 8) | ${_abi_minor}" OUTPUT_FORMAT HEXADECIMAL)
string(REPLACE "0x" "" _abi_value "${_abi_value}")
string(LENGTH "${_abi_value}" _abi_len)
if(_abi_len LESS 4)
  string(PREPEND _abi_value "0")
endif()
set(FASTINFER_TORCH_TARGET_VERSION "0x${_abi_value}000000000000")

set(_torch_libs torch_cpu)
if(FASTINFER_WITH_CUDA)
  list(APPEND _torch_libs torch_cuda)
endif()
add_library(fastinfer_torch INTERFACE)
foreach(_lib IN LISTS _torch_libs)
  find_library(FASTINFER_TORCH_${_lib} NAMES ${_lib} PATHS "${FASTINFER_TORCH_LIB_DIR}" NO_DEFAULT_PATH REQUIRED)
  target_link_libraries(fastinfer_torch INTERFACE "${FASTINFER_TORCH_${_lib}}")
endforeach()
target_include_directories(fastinfer_torch SYSTEM INTERFACE "${FASTINFER_TORCH_INCLUDE_DIR}")
target_compile_definitions(fastinfer_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=${_torch_cxx11_abi}
  TORCH_TARGET_VERSION=${FASTINFER_TORCH_TARGET_VERSION})
if(FASTINFER_WITH_CUDA)
  target_compile_definitions(fastinfer_torch INTERFACE USE_CUDA=1)
endif()
