"""GPU tests of the CUTLASS sm_90a path of ``fp8_scaled_mm`` (cuda/src/fp8_gemm_sm90.cu).

The kernels are reached through ``torch.ops.fastinfer.fp8_scaled_mm`` on a CUDA device of compute
capability 9.0; the shapes below pick each of the three tile configurations of
``launch_fp8_gemm_sm90`` (by M: <= 64, <= 128, larger) with both output dtypes, every scale mode
([1] or [M] x [1] or [N]) and with/without bias, and compare against an fp64 reference computed here from the same fp8
values. Everything is skipped without a GPU (``@pytest.mark.cuda``), on a non-Hopper GPU, or while
the op is not registered. The build-side checks (the sm_90a cubin holds these kernels, no spills)
are in tests/test_build.py and run on the CPU, as does test_w8a8_sm90_host_checks below (the fp8
and int8 launchers' argument validation and the int8 backend choice, linked from the installed
static library, without a GPU).

Error rule (tests/conftest.py, adapted): rel-norm error <= 1e-2 and
max|out - ref| <= 2 * max|naive - ref| + 2^-9 * max|ref|, ``naive`` being the same product
accumulated in fp32 by torch and rounded once to the output dtype. The extra 2^-9 * max|ref| (one
bf16 ulp of the largest output) is the allowance for fp8 fast accumulation: the kernels add wgmma
results into an accumulator kept at the tensor core's reduced internal precision (reported at
about 14 mantissa bits by the DeepSeek-V3 paper) with no periodic promotion to a separate fp32
sum. A random-walk estimate, ~sqrt(K/32) * 2^-14 relative (7e-4 at K=4096, 1e-3 at K=8192), is
below that allowance but not below an fp16 ulp. This is an estimate, not yet measured on a GPU.
Wrong scales, a missing bias or a mis-tiled block are errors of the order of the outputs.
"""

import importlib.util
import os
import shutil
import subprocess

import pytest
import torch

import fastinfer  # noqa: F401  (registers torch.ops.fastinfer)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0

HERE = os.path.dirname(os.path.abspath(__file__))
PKG_DIR = os.path.dirname(importlib.util.find_spec("fastinfer").origin)
BUILT_WITH_CUDA = torch._C._dispatch_has_kernel_for_dispatch_key("fastinfer::rms_norm", "CUDA")


def _op():
    try:
        return torch.ops.fastinfer.fp8_scaled_mm
    except (AttributeError, RuntimeError):
        pytest.skip("torch.ops.fastinfer.fp8_scaled_mm is not registered in this build")


def _require_hopper():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU available")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90a kernels need a compute capability 9.0 GPU (H100/H200/H20)")


def quantize(x, per_row):
    """fp32 [R, C] -> (fp8 [R, C], float32 scale [R] or [1]) with x ~= fp8 * scale."""
    amax = x.abs().amax(dim=1) if per_row else x.abs().amax().reshape(1)
    scale = (amax.clamp(min=1e-12) / FP8_MAX).float()
    q = (x / (scale[:, None] if per_row else scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def reference(a, b, scale_a, scale_b, bias):
    """fp64 oracle: (a * scale_a) @ (b * scale_b)^T + bias, from the fp8 values themselves."""
    sa = scale_a.double()[:, None] if scale_a.numel() > 1 else scale_a.double()
    sb = scale_b.double()[:, None] if scale_b.numel() > 1 else scale_b.double()
    out = (a.double() * sa) @ (b.double() * sb).T
    return out + bias.double() if bias is not None else out


def naive(a, b, scale_a, scale_b, bias, out_dtype):
    """The same computation in fp32 (torch's matmul), rounded once to out_dtype."""
    sa = scale_a[:, None] if scale_a.numel() > 1 else scale_a
    sb = scale_b[None, :] if scale_b.numel() > 1 else scale_b
    out = (a.float() @ b.float().T) * sa * sb
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# (M, N, K, configuration picked by launch_fp8_gemm_sm90). N, K multiples of 16; odd M on purpose.
SHAPES = [
    (1, 256, 128, "64x64x128_pingpong_c1x4"),
    (17, 48, 272, "64x64x128_pingpong_c1x4"),  # N < one 1x4 cluster of 64-wide tiles
    (64, 1024, 4096, "64x64x128_pingpong_c1x4"),
    (65, 512, 1040, "64x128x128_pingpong_c2x1"),
    (128, 4096, 512, "64x128x128_pingpong_c2x1"),
    (129, 272, 256, "128x256x128_cooperative_c2x1"),
    (1000, 1536, 2048, "128x256x128_cooperative_c2x1"),
    (256, 512, 8192, "128x256x128_cooperative_c2x1"),  # long K: fast-accumulation error
]


# Scale modes: (per-token scale_a, per-channel scale_b). Both broadcasts are chosen at run time,
# each on its own, so the mixed modes run the same kernels (checked on one shape per configuration).
SCALE_MODES = {"tensor": (False, False), "token_channel": (True, True)}
MIXED_MODES = {"token_tensor": (True, False), "tensor_channel": (False, True)}
MIXED_SHAPES = [SHAPES[1], SHAPES[3], SHAPES[5]]


def _shape_ids(shapes):
    return [f"{m}x{n}x{k}-{c.split('_')[0]}" for m, n, k, c in shapes]


@pytest.mark.cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scales", list(SCALE_MODES))
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m,n,k,config", SHAPES, ids=_shape_ids(SHAPES))
def test_fp8_scaled_mm_sm90(m, n, k, config, with_bias, scales, out_dtype):
    check_fp8_scaled_mm_sm90(m, n, k, config, with_bias, SCALE_MODES[scales], out_dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16], ids=["bf16"])
@pytest.mark.parametrize("scales", list(MIXED_MODES))
@pytest.mark.parametrize("m,n,k,config", MIXED_SHAPES, ids=_shape_ids(MIXED_SHAPES))
def test_fp8_scaled_mm_sm90_mixed_scales(m, n, k, config, scales, out_dtype):
    check_fp8_scaled_mm_sm90(m, n, k, config, True, MIXED_MODES[scales], out_dtype)


def check_fp8_scaled_mm_sm90(m, n, k, config, with_bias, per_row_col, out_dtype):
    _require_hopper()
    op = _op()
    g = torch.Generator().manual_seed(m * 131 + n * 7 + k)
    # Rows with different magnitudes so that per-token / per-channel scales matter.
    x = torch.randn(m, k, generator=g) * torch.linspace(0.25, 4.0, m)[:, None]
    w = torch.randn(n, k, generator=g) * torch.linspace(0.5, 2.0, n)[:, None] / k**0.5
    a, scale_a = quantize(x, per_row_col[0])
    b, scale_b = quantize(w, per_row_col[1])
    bias = (torch.randn(n, generator=g)).to(out_dtype) if with_bias else None

    ref = reference(a, b, scale_a, scale_b, bias)
    nv = naive(a, b, scale_a, scale_b, bias, out_dtype)
    out = op(
        a.cuda(), b.cuda(), scale_a.cuda(), scale_b.cuda(), out_dtype, bias.cuda() if bias is not None else None
    )
    torch.cuda.synchronize()
    assert out.shape == (m, n) and out.dtype == out_dtype and out.device.type == "cuda"
    out = out.cpu().double()
    assert torch.isfinite(out).all(), f"non-finite output ({config})"
    rel = ((out - ref).norm() / ref.norm()).item()
    err = (out - ref).abs().max().item()
    naive_err = (nv.double() - ref).abs().max().item()
    assert rel <= 1e-2, f"{config}: relative error {rel:.3g}"
    allowance = 2.0**-9 * ref.abs().max().item()
    assert err <= 2 * naive_err + allowance, (
        f"{config}: max error {err:.3g} vs naive {naive_err:.3g} + fast-accumulation allowance {allowance:.3g}"
    )


def find_nvcc():
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


@pytest.mark.skipif(not BUILT_WITH_CUDA, reason="extension built without CUDA kernels")
def test_w8a8_sm90_host_checks(tmp_path):
    """tests/host/w8a8_sm90_host_checks.cpp linked against the installed fastinfer::kernels: the fp8
    and int8 sm_90a kernels are in the library, m picks the documented tile configuration, every
    bad argument gives its documented error, valid arguments (every scale mode, int8 zero points)
    pass CUTLASS's can_implement (on a machine without a GPU the call then fails at the device
    query; with one, no launch is attempted), and select_int8_gemm_backend / w8a8_gemm_sm90_applies
    pick the sm_90a kernels exactly where documented (by compute capability, build, forced tiles,
    FASTINFER_TEST_INT8_GEMM, alignment)."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    exe = tmp_path / "w8a8_sm90_host_checks"
    cmd = [nvcc, "-std=c++17", "-O1", "-I", os.path.join(PKG_DIR, "include"),
           os.path.join(HERE, "host", "w8a8_sm90_host_checks.cpp"),
           os.path.join(PKG_DIR, "lib", "libfastinfer_kernels.a"), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr
