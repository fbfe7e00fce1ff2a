"""fastinfer: CUDA kernels for LLM inference, as PyTorch custom ops (``torch.ops.fastinfer.*``),
and a thin runner for Llama-family checkpoints: ``fastinfer.LLM(path).generate(prompts, SamplingParams(...))``.

Importing the package loads the compiled extension ``fastinfer._C``, which registers every op
(CPU and CUDA kernels; the fake impls of ``fastinfer.ops``). One build loads under every torch
from the stable-ABI version it targets on (``fastinfer._build_info``). ``import fastinfer._sim`` additionally registers
``torch.ops.fastinfer_sim.*``: the same CUDA kernel sources run on CPU tensors by the simt
emulator (see cpp/simt/README.md). The C++ package (headers, static libraries, CMake config)
lives inside this package: ``cmake -DCMAKE_PREFIX_PATH=$(python -c 'import fastinfer;
print(fastinfer.cmake_prefix_path)')`` then ``find_package(fastinfer)``.
"""

from __future__ import annotations

import importlib
import os

import torch  # noqa: F401  (the extension links against libtorch: load it first)


def _load_extension():
    """Imports fastinfer._C, saying why when it cannot: never built, or a torch older than the
    stable ABI version it targets (docs/cpp.md, "The stable ABI")."""
    try:
        from . import _build_info
    except ImportError:
        _build_info = None
    if _build_info is not None:
        running = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
        target = tuple(int(x) for x in _build_info.TORCH_ABI_TARGET.split("."))
        if running < target:
            raise ImportError(
                f"fastinfer._C was built with torch {_build_info.TORCH_BUILT_WITH} for torch >= "
                f"{_build_info.TORCH_ABI_TARGET} (the LibTorch stable ABI); the running torch is "
                f"{torch.__version__}: upgrade torch, or rebuild fastinfer against this one")
    try:
        from . import _C  # noqa: F401  (registers torch.ops.fastinfer.*)
    except ImportError as e:
        if _build_info is None:  # a source checkout that was never built
            raise ImportError(
                "fastinfer._C is not built: run `make install` (pip install --no-build-isolation .)") from e
        raise ImportError(
            f"fastinfer._C (built with torch {_build_info.TORCH_BUILT_WITH} for torch >= "
            f"{_build_info.TORCH_ABI_TARGET}) cannot load under the running torch {torch.__version__}: {e}") from e


_load_extension()

__version__ = "0.1.0"

_pkg_dir = os.path.dirname(os.path.abspath(__file__))
#: Directory holding the installed C++ headers (cuda/include and the simt headers).
include_dir = os.path.join(_pkg_dir, "include")
#: Directory holding libfastinfer_kernels.a, libfastinfer_kernels_simt.a, libfastinfer_simt.a.
lib_dir = os.path.join(_pkg_dir, "lib")
#: Add to CMAKE_PREFIX_PATH to find_package(fastinfer).
cmake_prefix_path = os.path.join(_pkg_dir, "share", "cmake")


def cuda_available() -> bool:
    """True when the extension was built with CUDA kernels and a GPU is visible."""
    return torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(
        "fastinfer::rms_norm", "CUDA"
    )


#: The x86 CPU flags (``/proc/cpuinfo``) of an instruction set that computes bfloat16 products
#: itself: AVX-512 BF16 (dot products) and AMX-BF16 (tile matrix multiplies).
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when this CPU computes bfloat16 natively: the first ``flags`` line of ``cpuinfo`` (an
    x86 Linux ``/proc/cpuinfo``) names one of :data:`NATIVE_BF16_CPU_FLAGS`. Without those flags
    (older x86 CPUs convert every bfloat16 operand to float32 first), or without such a line or a
    readable ``cpuinfo`` (other CPUs and systems), False. torch has no public query for this
    (``torch.backends.cpu.get_cpu_capability()`` says "AVX512" with or without BF16). Decides the
    CPU's ``dtype="auto"`` (:func:`fastinfer.models.default_dtype`)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == "flags":
                    return any(flag in value.split() for flag in NATIVE_BF16_CPU_FLAGS)
    except OSError:
        pass
    return False


def sim_available() -> bool:
    """True when the simt build (``torch.ops.fastinfer_sim``) can be loaded."""
    try:
        importlib.import_module("fastinfer._sim")
    except ImportError:
        return False
    return True


from . import ops  # noqa: E402,F401

# The runner loads on first use (``fastinfer.LLM``): ``import fastinfer`` stays light for users of
# the ops alone. Each name comes from the engine module that defines it.
_ENGINE_NAMES = ("LLM", "SamplingParams", "StructuredOutputs", "RequestOutput", "CompletionOutput", "EngineConfig")


def __getattr__(name: str):
    if name == "LLM":
        from .engine.llm import LLM

        return LLM
    if name == "EngineConfig":
        from .engine.config import EngineConfig

        return EngineConfig
    if name in _ENGINE_NAMES:
        from .engine import params

        return getattr(params, name)
    raise AttributeError(f"module 'fastinfer' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_ENGINE_NAMES))
