"""GPU tests of the CUTLASS sm_90a path of ``int8_scaled_mm`` (cuda/src/int8_gemm_sm90.cu).

On a compute capability 9.0 device ``launch_int8_scaled_mm`` runs the TMA + wgmma kernel for every
problem with 16-byte aligned operands (select_int8_gemm_backend; its decision is checked on the
CPU by tests/host/w8a8_sm90_host_checks.cpp, run from tests/test_fp8_sm90.py). The shapes below
pick each of the three tile configurations (by M: <= 64, <= 128, larger), with both output dtypes,
every scale mode ([1] or [M] x [1] or [N]), with / without bias and with per-token / per-tensor /
no zero points.

Oracles: the s32 accumulation is exact and the epilogue is the reference's operation for operation
(c = acc - azp * azp_adj in int32, fma(float(c), sa * sb, bias) in fp32, one rounding), so the
output must equal the CPU implementation bit for bit (which equals the emulated mma.sync kernel
bit for bit, tests/test_gemm_int8.py); it is also held to the error rule of ``conftest.assert_fa_close`` against the fp64 oracle. A profiler check makes sure the
CUTLASS kernel is what ran. Skipped without a GPU (``@pytest.mark.cuda``) or on a non-Hopper GPU.
The build-side checks (sm_90a only, no spills) are in tests/test_build.py.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_bits_equal, assert_fa_close, get_backend, make_gen

from fastinfer.reference import gemm_int8 as ref  # noqa: E402  (conftest imports fastinfer first)

I8, I32 = torch.int8, torch.int32
BF, HF = torch.bfloat16, torch.float16


def _require_hopper():
    be = get_backend("cuda")  # skips without a GPU
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90a kernels need a compute capability 9.0 GPU (H100/H200/H20)")
    return be


def _inputs(m, n, k, scales, bias, azp, out_dtype, seed):
    gen = make_gen(seed)
    a = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int16).to(I8)
    b = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int16).to(I8)
    a[0, :] = -128  # the extreme products in row 0
    pos = lambda s: (torch.rand(s, generator=gen) + 0.25) * 1e-3  # noqa: E731
    sa = pos(m if scales in ("tc", "tokT") else 1)
    sb = pos(n if scales in ("tc", "tensC") else 1)
    bv = (torch.randn(n, generator=gen) * 4).to(out_dtype) if bias else None
    z = adj = None
    if azp is not None:
        z = torch.randint(-128, 128, (m if azp == "row" else 1,), generator=gen, dtype=I32)
        adj = b.sum(1, dtype=I32)
    return a, b, sa, sb, bv, adj, z


def _naive(a, b, sa, sb, bias, adj, z, out_dtype):
    """The same epilogue on exact integers in fp32, rounded once (independent of the impls)."""
    acc = ref.int8_mm_exact(a, b)
    if z is not None:
        acc = acc - z.long().reshape(-1, 1) * adj.long().reshape(1, -1)
    out = acc.float() * (sa.reshape(-1, 1) * sb.reshape(1, -1))
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _run(args, dtype, device):
    a, b, sa, sb, bv, adj, z = (t.to(device) if t is not None else None for t in args)
    out = torch.ops.fastinfer.int8_scaled_mm(a, b, sa, sb, dtype, bv, adj, z)
    if device != "cpu":
        torch.cuda.synchronize()
    return out.cpu()


# (M, N, K, configuration, scales, bias, azp). N, K multiples of 16; odd M on purpose; K not a
# multiple of the 128-wide k-block in several. scales: "tt" per tensor, "tc" per token x per
# channel, "tokT" / "tensC" the mixed ones; azp: None, "row" (per token), "tensor".
SHAPES = [
    (1, 256, 128, "64x64x128", "tt", False, None),
    (17, 48, 272, "64x64x128", "tc", True, "row"),  # N < one 1x4 cluster of 64-wide tiles
    (64, 1024, 4096, "64x64x128", "tokT", False, "tensor"),
    (65, 512, 1040, "64x128x128", "tensC", True, None),
    (128, 4096, 512, "64x128x128", "tc", False, "row"),
    (129, 272, 256, "128x256x128", "tc", True, None),
    (1000, 1536, 2048, "128x256x128", "tc", True, "row"),
    (256, 512, 8192, "128x256x128", "tt", False, None),  # long K: |acc| beyond 2^24
]


@pytest.mark.cuda
@pytest.mark.parametrize("out_dtype", [BF, HF], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "m,n,k,config,scales,bias,azp", SHAPES,
    ids=[f"{m}x{n}x{k}-{c}-{s}-{'bias' if bi else 'nobias'}-{z}" for m, n, k, c, s, bi, z in SHAPES],
)
def test_int8_scaled_mm_sm90(m, n, k, config, scales, bias, azp, out_dtype):
    _require_hopper()
    args = _inputs(m, n, k, scales, bias, azp, out_dtype, seed=m * 131 + n * 7 + k)
    out = _run(args, out_dtype, "cuda")
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert torch.isfinite(out).all(), f"non-finite output ({config})"
    a, b, sa, sb, bv, adj, z = args
    expect = ref.int8_scaled_mm(a, b, sa, sb, out_dtype, bv, adj, z)
    assert_fa_close(out, expect, _naive(a, b, sa, sb, bv, adj, z, out_dtype),
                    floor=1e-6 * expect.abs().max().item(), name=f"int8_scaled_mm sm90 {config}")
    assert_bits_equal(out, _run(args, out_dtype, "cpu"), f"sm90 {config} vs CPU")


@pytest.mark.cuda
def test_int8_scaled_mm_sm90_is_the_kernel_that_runs():
    """The parity test above would pass on the mma.sync kernel too: check by kernel name that the
    CUTLASS kernel ran (16-byte aligned operands, default tiles, FASTINFER_TEST_INT8_GEMM unset)."""
    _require_hopper()
    import os

    if os.environ.get("FASTINFER_TEST_INT8_GEMM") == "mma":
        pytest.skip("FASTINFER_TEST_INT8_GEMM=mma forces the mma.sync kernel")
    args = _inputs(100, 512, 256, "tc", True, "row", BF, seed=5)
    _run(args, BF, "cuda")  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _run(args, BF, "cuda")
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("GemmUniversal" in s or "cutlass" in s for s in names), names
    assert not any("int8_scaled_mm_kernel" in s for s in names), names
