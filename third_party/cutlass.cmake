# Locates CUTLASS/CuTe headers; nothing is vendored. Order: -DCUTLASS_DIR / $CUTLASS_DIR (a CUTLASS
# checkout or install prefix with include/cutlass/cutlass.h), then the `nvidia-cutlass` wheel
# (pip install --no-deps nvidia-cutlass==4.2.0: headers in cutlass_library/source/include).
# Sets FASTINFER_CUTLASS_INCLUDE_DIR (empty when not found) and target fastinfer_cutlass (INTERFACE).
set(_cutlass_hints "")
if(CUTLASS_DIR)
  list(APPEND _cutlass_hints "${CUTLASS_DIR}/include" "${CUTLASS_DIR}")
endif()
if(DEFINED ENV{CUTLASS_DIR} AND NOT "$ENV{CUTLASS_DIR}" STREQUAL "")
  list(APPEND _cutlass_hints "$ENV{CUTLASS_DIR}/include" "$ENV{CUTLASS_DIR}")
endif()
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
    "import importlib.util as u, os; s = u.find_spec('cutlass_library'); print(os.path.join(os.path.dirname(s.origin), 'source', 'include') if s else '')"
  OUTPUT_VARIABLE _cutlass_wheel_include OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(_cutlass_wheel_include)
  list(APPEND _cutlass_hints "${_cutlass_wheel_include}")
endif()

set(FASTINFER_CUTLASS_INCLUDE_DIR "")
foreach(_dir IN LISTS _cutlass_hints)
  if(EXISTS "${_dir}/cutlass/cutlass.h" AND EXISTS "${_dir}/cute/tensor.hpp")
    set(FASTINFER_CUTLASS_INCLUDE_DIR "${_dir}")
    break()
  endif()
endforeach()

add_library(fastinfer_cutlass INTERFACE)
if(FASTINFER_CUTLASS_INCLUDE_DIR)
  message(STATUS "fastinfer: CUTLASS headers: ${FASTINFER_CUTLASS_INCLUDE_DIR}")
  target_include_directories(fastinfer_cutlass SYSTEM INTERFACE "$<BUILD_INTERFACE:${FASTINFER_CUTLASS_INCLUDE_DIR}>")
else()
  message(STATUS "fastinfer: CUTLASS not found (set CUTLASS_DIR or pip install nvidia-cutlass); "
                 "no kernel needs it yet")
endif()
