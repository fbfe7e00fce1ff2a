"""The row-wise ops behind the deterministic mode: rms_norm, fused_add_rms_norm,
silu_and_mul and rotary_embedding compute each token row on its own, so a row's bits do not depend
on the batch. The same check as tests/test_deterministic_gemm.py (``torch.equal`` of the raw bits):
a probe row placed last behind M - 1 other rows, M = 1, 3, 17, 64, 300, equals its result in the
M = 300 batch, and every other row its own -- on CPU and on the CUDA sources in the simt emulator.
Odd widths (H = 264, F = 136, 3 query heads of D = 72 with a partial rotary of 48 dims)."""

from __future__ import annotations

import pytest
import torch

from conftest import backend_params, get_backend, make_gen, randn
from test_deterministic_gemm import ROWS, assert_batch_invariant

import fastinfer.ops as ops

H, F, HQ, HKV, D, ROT = 264, 136, 3, 1, 72, 48
CASES = backend_params({"cpu": [()], "sim": [()]})


@pytest.mark.parametrize("backend,dtype", CASES)
def test_rms_norm_rows(backend, dtype):
    be, g = get_backend(backend), make_gen(1)
    x, w = randn((ROWS, H), dtype, gen=g), randn((H,), dtype, gen=g)
    assert_batch_invariant(lambda idx: ops.rms_norm(x[idx].contiguous(), w, 1e-5, lib=be.ns))


@pytest.mark.parametrize("backend,dtype", CASES)
def test_fused_add_rms_norm_rows(backend, dtype):
    be, g = get_backend(backend), make_gen(2)
    x, r, w = randn((ROWS, H), dtype, gen=g), randn((ROWS, H), dtype, gen=g), randn((H,), dtype, gen=g)

    def run(idx):
        xi, ri = x[idx].contiguous(), r[idx].contiguous()
        ops.fused_add_rms_norm(xi, ri, w, 1e-5, lib=be.ns)  # in place on both
        return torch.cat([xi, ri], 1)

    assert_batch_invariant(run)


@pytest.mark.parametrize("backend,dtype", CASES)
def test_silu_and_mul_rows(backend, dtype):
    be, g = get_backend(backend), make_gen(3)
    x = randn((ROWS, 2 * F), dtype, gen=g)
    assert_batch_invariant(lambda idx: ops.silu_and_mul(x[idx].contiguous(), lib=be.ns))


@pytest.mark.parametrize("backend,dtype", CASES)
def test_rotary_embedding_rows(backend, dtype):
    be, g = get_backend(backend), make_gen(4)
    q, k = randn((ROWS, HQ, D), dtype, gen=g), randn((ROWS, HKV, D), dtype, gen=g)
    positions = torch.randint(0, 1000, (ROWS,), generator=g)
    cache = ops.build_rope_cache(1000, ROT)

    def run(idx):
        qi, ki = q[idx].contiguous(), k[idx].contiguous()
        ops.rotary_embedding(positions[idx].contiguous(), qi, ki, cache, lib=be.ns)  # in place
        return torch.cat([qi.reshape(len(idx), -1), ki.reshape(len(idx), -1)], 1)

    assert_batch_invariant(run)
