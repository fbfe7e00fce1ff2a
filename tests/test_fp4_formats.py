"""The FP4 formats' reference (fastinfer.reference.fp4) against hand-worked examples and against
the producers' own code: compressed-tensors' NVFP4 packer, unpacker and dequantiser, and
transformers' gpt-oss MXFP4 converter (the layout of the published checkpoints)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_gen
from fastinfer.reference import fp4  # noqa: E402  (conftest imports fastinfer first)

ALL = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _random_values(n, k, seed):
    """A float32 [n, k] of e2m1 values, every code present."""
    idx = torch.randint(0, 16, (n, k), generator=make_gen(seed))
    return ALL[idx]


def test_hand_worked_example():
    """OCP MX e2m1: code s e1 e0 m; the row [1.0, -6.0, 0.5, 3.0] is codes [2, 15, 1, 5] and, the
    even element in the low nibble, bytes [0xF2, 0x51]."""
    row = torch.tensor([[1.0, -6.0, 0.5, 3.0]])
    codes = fp4.e2m1_encode(row)
    assert codes.tolist() == [[2, 15, 1, 5]]
    packed = fp4.fp4_pack(codes)
    assert packed.tolist() == [[0xF2, 0x51]]
    assert torch.equal(fp4.fp4_unpack(packed), codes)
    assert torch.equal(fp4.e2m1_values(codes), row.double())
    # every code's value, -0 included (code 8)
    vals = fp4.e2m1_values(torch.arange(16, dtype=torch.uint8))
    assert torch.equal(vals, ALL.double()) and torch.signbit(vals[8])
    with pytest.raises(ValueError):
        fp4.e2m1_encode(torch.tensor([0.75]))


def test_packing_is_compressed_tensors_packing():
    helpers = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")
    x = _random_values(6, 48, 1)
    theirs = helpers.pack_fp4_to_uint8(x)
    assert torch.equal(theirs, fp4.fp4_pack(fp4.e2m1_encode(x)))
    back = helpers.unpack_fp4_from_uint8(theirs, 6, 48, dtype=torch.float32)
    assert torch.equal(back, fp4.e2m1_values(fp4.fp4_unpack(theirs)).float())


def test_nvfp4_dequantize_is_compressed_tensors():
    """W = e2m1 * e4m3 scale / global scale per 16 input features, as compressed-tensors'
    dequantiser computes it (float32 there: within its rounding)."""
    forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
    from compressed_tensors.quantization import QuantizationArgs

    n, k = 8, 64
    x = _random_values(n, k, 2)
    g = make_gen(3)
    scale = (torch.rand(n, k // 16, generator=g) * 8 + 0.05).to(torch.float8_e4m3fn)
    gs = torch.tensor([448.0 * 6 / 3.7])
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True)
    theirs = forward.dequantize(x, scale.float(), None, args, torch.float32, gs)  # e4m3 -> fp32: exact
    ours = fp4.nvfp4_dequantize(fp4.fp4_pack(fp4.e2m1_encode(x)), scale, gs)
    assert ours.shape == theirs.shape
    assert (ours - theirs.double()).abs().max() <= 2 ** -22 * ours.abs().max()
    assert (ours != 0).any() and not torch.equal(ours, x.double())  # the scales are applied


def test_mxfp4_dequantize_is_gpt_oss_layout():
    """gpt-oss experts: *_blocks [E, N, K / 32, 16], *_scales [E, N, K / 32] (e8m0, bias 127);
    transformers' converter dequantises to [E, K, N]; ours is [E, N, K]."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    e, n, k = 2, 6, 96
    g = make_gen(4)
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(118, 136, (e, n, k // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    theirs = mxfp4._convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    ours = fp4.mxfp4_dequantize(blocks, scales)
    assert theirs.shape == (e, k, n) and ours.shape == (e, n, k)
    assert torch.equal(ours, theirs.transpose(1, 2).double())  # powers of two times e2m1: exact
    with pytest.raises(ValueError, match="NaN"):
        fp4.mxfp4_dequantize(blocks, torch.full_like(scales, 255))
