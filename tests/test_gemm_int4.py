"""INT4 (W4A16) ops: int4_pack, int4_repack (AutoAWQ / AutoGPTQ v1, act-order), int4_gemm.

Backends cpu / sim / cuda (see conftest). The GEMM is compared with the fp64 oracle
(fastinfer.reference.int4_gemm) under the FlashAttention error rule, where the naive
implementation accumulates in the input precision (64-wide K chunks added in the input dtype).
Exactness: the dequantised weight is checked bit for bit by multiplying with rows of the identity
(out[m, n] = W[n, m] with a single nonzero product), and repacked checkpoints are compared with
the original 4-bit values, zero points and dequantised weights exactly.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_bits_equal, assert_fa_close, backend_params, get_backend, make_gen, randn

import fastinfer.reference as ref

TOL_REL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def make_weights(n, k, group, symmetric, dtype, gen):
    w_q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    # scales of both signs, magnitudes 0.005..0.05 (never zero)
    mag = torch.rand((k // group, n), generator=gen) * 0.045 + 0.005
    sign = torch.where(torch.rand((k // group, n), generator=gen) < 0.2, -1.0, 1.0)
    scales = (mag * sign).to(dtype)
    zeros = None if symmetric else torch.randint(0, 16, (k // group, n), generator=gen, dtype=torch.uint8)
    return w_q, scales, zeros


def naive_gemm(a, w_q, scales, zeros, group):
    """Input-precision implementation: W rounded to a's dtype, 64-wide partial products and the
    running sum rounded to a's dtype."""
    return naive_from_w(a, ref.int4_dequantize(w_q, scales, zeros, group, dtype=a.dtype).to(a.dtype))


def naive_from_w(a, w):
    acc = torch.zeros(a.shape[0], w.shape[0], dtype=a.dtype)
    for k0 in range(0, a.shape[1], 64):
        part = (a[:, k0:k0 + 64].float() @ w[:, k0:k0 + 64].float().t()).to(a.dtype)
        acc = (acc.float() + part.float()).to(a.dtype)
    return acc


def _to(dev, *ts):
    return [None if t is None else t.to(dev) for t in ts]


# (M, N, K, group, symmetric). N multiple of 16, K of 64 (the minimum tile); odd M on purpose.
SIM_CASES = [
    (1, 48, 256, 128, True),
    (1, 144, 128, 32, False),   # partial 128-column CTA tile, two groups per 64-wide unit
    (3, 32, 192, 64, False),
    (17, 64, 128, 32, True),
    (64, 16, 256, 128, False),
    (100, 32, 128, 64, True),   # BM 64, two row blocks, partial
    (520, 16, 64, 64, False),   # M >= 512: dequantise + dense path
    (5, 48, 128, 16, False),    # four groups per unit (GGUF Q6_K's 16-weight sub-blocks)
    (40, 32, 192, 48, True),    # groups of three k16 steps: units span two groups at k 16 and 48
    (2, 32, 192, 96, False),    # the second unit spans two groups at its k 32
]
CPU_CASES = SIM_CASES + [(1, 256, 1024, 128, False), (33, 80, 512, 64, True), (4, 4096 // 8, 512, 128, True)]


@pytest.mark.parametrize(
    "backend,dtype,m,n,k,group,symmetric",
    backend_params({"cpu": CPU_CASES, "sim": SIM_CASES, "cuda": CPU_CASES}),
)
def test_int4_gemm_vs_reference(backend, dtype, m, n, k, group, symmetric):
    be = get_backend(backend)
    gen = make_gen(1000 + m + n + k + group)
    w_q, scales, zeros = make_weights(n, k, group, symmetric, dtype, gen)
    a = randn((m, k), dtype, gen=gen)
    out = be.run(lambda: be.ns.int4_gemm(*_to(be.device, a, be.ns.int4_pack(w_q.to(be.device)), scales, zeros),
                                         group, None))
    assert out.dtype == dtype and out.shape == (m, n)
    expect = ref.int4_gemm(a, w_q, scales, zeros, group)
    assert_fa_close(out, expect, naive_gemm(a, w_q, scales, zeros, group), rel_tol=TOL_REL[dtype], floor=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group,symmetric", [(48, 192, 32, False), (32, 256, 64, True), (16, 384, 128, False),
                                                (48, 128, 16, False), (32, 192, 48, True), (16, 192, 96, False)])
def test_int4_gemm_cpu_decode_paths_agree(monkeypatch, dtype, n, k, group, symmetric):
    """The CPU decode path's AVX-512 form (the unit decoded in registers by a table lookup per
    nibble; in bf16 a constant table of q - 8 and vdpbf16ps) and its portable form (std::fma per
    lane, cpu::tree_sum) are one arithmetic: the same bits at every M, and a row's bits do not
    depend on the other rows; the larger-M path's AVX-512 dequantiser writes the portable one's
    weights (FASTINFER_TEST_CPU_INT4_PORTABLE=1 forces the portable forms)."""
    gen = make_gen(31 + n + k + group)
    w_q, scales, zeros = make_weights(n, k, group, symmetric, dtype, gen)
    a = randn((23, k), dtype, gen=gen)
    packed = torch.ops.fastinfer.int4_pack(w_q)
    fast = torch.ops.fastinfer.int4_gemm(a, packed, scales, zeros, group, None, True)
    chunked = torch.ops.fastinfer.int4_gemm(a, packed, scales, zeros, group, None, False)
    monkeypatch.setenv("FASTINFER_TEST_CPU_INT4_PORTABLE", "1")
    portable = torch.ops.fastinfer.int4_gemm(a, packed, scales, zeros, group, None, True)
    assert_bits_equal(fast, portable)
    assert_bits_equal(chunked, torch.ops.fastinfer.int4_gemm(a, packed, scales, zeros, group, None, False))
    monkeypatch.delenv("FASTINFER_TEST_CPU_INT4_PORTABLE")
    for m in (1, 2, 8 if dtype == torch.bfloat16 else 16):  # one row, a few, the decode path's largest M
        assert_bits_equal(torch.ops.fastinfer.int4_gemm(a[:m], packed, scales, zeros, group, None, False), fast[:m])


@pytest.mark.parametrize(
    "backend,dtype,m,k,group,symmetric",
    backend_params({"cpu": [(16, 128, 32, False), (128, 128, 64, True), (16, 128, 16, True), (64, 192, 96, False)],
                    "sim": [(16, 128, 32, False), (128, 128, 64, True), (512, 512, 128, False), (16, 128, 16, False)],
                    "cuda": [(16, 128, 32, False), (128, 128, 64, True), (512, 512, 128, False)]}),
)
def test_int4_gemm_dequantised_weight_is_exact(backend, dtype, m, k, group, symmetric):
    """a = the first m rows of the identity: out[r, n] = W[n, r] with one nonzero product, so the
    kernels' in-register dequantisation must equal the oracle's rounded weight bit for bit
    (m = 512 exercises the dequantise + dense path)."""
    be = get_backend(backend)
    n = 48
    gen = make_gen(7 + m + group)
    w_q, scales, zeros = make_weights(n, k, group, symmetric, dtype, gen)
    a = torch.eye(k, dtype=dtype)[:m].contiguous()
    out = be.run(lambda: be.ns.int4_gemm(*_to(be.device, a, be.ns.int4_pack(w_q.to(be.device)), scales, zeros),
                                         group, None))
    w = ref.int4_dequantize(w_q, scales, zeros, group, dtype=dtype).to(dtype)
    expect = w[:, :m].t().contiguous()
    # equal values (a weight of -0.0, from q == z with a negative scale, sums to +0.0)
    bad = (out.cpu() != expect) | out.cpu().isnan()
    assert not bad.any(), f"{int(bad.sum())} weights differ; first at {tuple(bad.nonzero()[0].tolist())}"


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
def test_int4_pack_layout(backend):
    be = get_backend(backend)
    gen = make_gen(5)
    w_q = torch.randint(0, 16, (48, 192), generator=gen, dtype=torch.uint8)
    packed = be.ns.int4_pack(w_q.to(be.device)).cpu()
    assert packed.dtype == torch.int32 and packed.shape == (192 // 64, 8 * 48)
    assert torch.equal(packed, ref.int4_pack(w_q)), "int4_pack differs from the layout's definition"
    assert torch.equal(ref.int4_unpack(packed), w_q)
    # One nibble by hand: nibble 6 (e=1, h=1, kh=0) of word 4*lane+j, lane = 4g+t, of unit (kt=1, nt=2)
    # is q[16*2 + 8 + g, 64 + 16 j + 2 t + 1].
    g, t, j = 3, 2, 1
    single = torch.zeros(48, 192, dtype=torch.uint8)
    single[16 * 2 + 8 + g, 64 + 16 * j + 2 * t + 1] = 11
    p = be.ns.int4_pack(single.to(be.device)).cpu().view(-1)
    word_index = (1 * 3 + 2) * 128 + 4 * (4 * g + t) + j
    assert p[word_index].item() == 11 << 24 and int((p != 0).sum()) == 1


# ---- repack -------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_int4_repack_exact(backend, fmt):
    be = get_backend(backend)
    gen = make_gen(11)
    n, k, group = 64, 256, 64
    w_q, scales, zeros = make_weights(n, k, group, False, torch.float16, gen)
    pack = ref.awq_pack if fmt == "awq" else ref.gptq_pack
    unpack = ref.awq_unpack if fmt == "awq" else ref.gptq_unpack
    qweight, qzeros = pack(w_q, zeros)
    assert qweight.dtype == torch.int32 and qzeros.shape == (k // group, n // 8)
    uq, uz = unpack(qweight, qzeros)
    assert torch.equal(uq, w_q) and torch.equal(uz, zeros), "python packer/unpacker round trip"
    packed, z_out, perm = be.ns.int4_repack(qweight.to(be.device), qzeros.to(be.device), fmt, None)
    assert perm.numel() == 0
    assert torch.equal(ref.int4_unpack(packed.cpu()), w_q)
    assert torch.equal(z_out.cpu(), zeros) and z_out.dtype == torch.uint8
    w_ckpt = ref.int4_dequantize(w_q, scales, zeros, group)
    w_ours = ref.int4_dequantize(ref.int4_unpack(packed.cpu()), scales, z_out.cpu(), group)
    assert torch.equal(w_ckpt, w_ours)


# ---- checkpoint conventions, written by hand from the upstream packers ---------------------------
#
# AutoAWQ (github casper-hansen/AutoAWQ), awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear:
#     order_map = [0, 2, 4, 6, 1, 3, 5, 7]
#     for i in range(pack_num):                     # pack_num = 8 nibbles per int32
#         qweight_col = intweight[:, col * pack_num + order_map[i]]
#         qweight[:, col] |= qweight_col << (i * awq_linear.w_bit)
# (intweight is W^T, [K, N]; qzeros [K / G, N / 8] is packed by the same loop from the zero points
# as they are.) Its unpacker, awq/utils/packing_utils.py, reorders with the inverse
# AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7] (reverse_awq_order, used by dequantize_gemm).
#
# One qweight word by hand: row k, columns 8 j + 0 .. 8 j + 7 hold 1, 2, 3, 4, 5, 6, 7, 8.
#   nibble 0, bits  0..3 : column order_map[0] = 0 -> 1 -> 0x00000001
#   nibble 1, bits  4..7 : column order_map[1] = 2 -> 3 -> 0x00000030
#   nibble 2, bits  8..11: column order_map[2] = 4 -> 5 -> 0x00000500
#   nibble 3, bits 12..15: column order_map[3] = 6 -> 7 -> 0x00007000
#   nibble 4, bits 16..19: column order_map[4] = 1 -> 2 -> 0x00020000
#   nibble 5, bits 20..23: column order_map[5] = 3 -> 4 -> 0x00400000
#   nibble 6, bits 24..27: column order_map[6] = 5 -> 6 -> 0x06000000
#   nibble 7, bits 28..31: column order_map[7] = 7 -> 8 -> 0x80000000
#   word = 0x86427531 = 2252502321 unsigned = 2252502321 - 2**32 = -2042464975 as int32.
AWQ_W_COLUMNS = (1, 2, 3, 4, 5, 6, 7, 8)
AWQ_W_WORD = -2042464975
# One qzeros word by hand: zero points of columns 8 j + 0 .. 7 are 9, 10, 11, 12, 13, 14, 15, 0.
#   nibble 0: column 0 -> 9  -> 0x00000009      nibble 4: column 1 -> 10 -> 0x000A0000
#   nibble 1: column 2 -> 11 -> 0x000000B0      nibble 5: column 3 -> 12 -> 0x00C00000
#   nibble 2: column 4 -> 13 -> 0x00000D00      nibble 6: column 5 -> 14 -> 0x0E000000
#   nibble 3: column 6 -> 15 -> 0x0000F000      nibble 7: column 7 -> 0  -> 0x00000000
#   word = 0x0ECAFDB9 = 248184249.
AWQ_Z_COLUMNS = (9, 10, 11, 12, 13, 14, 15, 0)
AWQ_Z_WORD = 248184249
#
# AutoGPTQ v1 (github AutoGPTQ/AutoGPTQ), auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py,
# QuantLinear.pack (bits 4): qweight [K / 8, N] along K in plain order,
#     for j in range(i, i + 8): qweight[row] |= intweight[j] << (4 * (j - i))
# and, after `zeros -= 1`, qzeros [K / G, N / 8] along N in plain order,
#     for j in range(i, i + 8): qzeros[:, col] |= zeros[:, j] << (4 * (j - i))
#
# One qweight word by hand: column n, rows 8 j + 0 .. 7 hold 15, 0, 7, 8, 1, 14, 3, 12.
#   nibble 0: 15 -> 0x0000000F    nibble 4: 1  -> 0x00010000
#   nibble 1: 0  -> 0x00000000    nibble 5: 14 -> 0x00E00000
#   nibble 2: 7  -> 0x00000700    nibble 6: 3  -> 0x03000000
#   nibble 3: 8  -> 0x00008000    nibble 7: 12 -> 0xC0000000
#   word = 0xC3E1870F = 3286337295 unsigned = 3286337295 - 2**32 = -1008630001 as int32.
GPTQ_W_ROWS = (15, 0, 7, 8, 1, 14, 3, 12)
GPTQ_W_WORD = -1008630001
# One qzeros word by hand: zero points of columns 8 j + 0 .. 7 are 1, 2, ..., 8, stored minus one
# as 0, 1, ..., 7 in nibbles 0..7: word = 0x76543210 = 1985229328.
GPTQ_Z_COLUMNS = (1, 2, 3, 4, 5, 6, 7, 8)
GPTQ_Z_WORD = 1985229328


def _hex32(x):
    return f"0x{x & 0xFFFFFFFF:08X}"


def test_hand_words_match_the_python_packers():
    """The reference packers (used to build test checkpoints) write the hand-computed words."""
    n, k, group = 16, 64, 64
    w_q = torch.zeros(n, k, dtype=torch.uint8)
    w_q[8:16, 5] = torch.tensor(AWQ_W_COLUMNS, dtype=torch.uint8)  # row k = 5, word j = 1 (columns 8..15)
    zeros = torch.zeros(k // group, n, dtype=torch.uint8)
    zeros[0, 8:16] = torch.tensor(AWQ_Z_COLUMNS, dtype=torch.uint8)
    qweight, qzeros = ref.awq_pack(w_q, zeros)
    assert qweight[5, 1].item() == AWQ_W_WORD, _hex32(qweight[5, 1].item())
    assert int(qweight.count_nonzero()) == 1
    assert qzeros[0, 1].item() == AWQ_Z_WORD, _hex32(qzeros[0, 1].item())
    assert qzeros[0, 0].item() == 0
    w_q = torch.zeros(n, k, dtype=torch.uint8)
    w_q[3, 16:24] = torch.tensor(GPTQ_W_ROWS, dtype=torch.uint8)  # column n = 3, word row j = 2
    zeros = torch.full((k // group, n), 1, dtype=torch.uint8)  # stored 0
    zeros[0, 8:16] = torch.tensor(GPTQ_Z_COLUMNS, dtype=torch.uint8)
    qweight, qzeros = ref.gptq_pack(w_q, zeros)
    assert qweight[2, 3].item() == GPTQ_W_WORD, _hex32(qweight[2, 3].item())
    assert int(qweight.count_nonzero()) == 1
    assert qzeros[0, 1].item() == GPTQ_Z_WORD and qzeros[0, 0].item() == 0, _hex32(qzeros[0, 1].item())


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
def test_awq_hand_words_decoded_by_the_op(backend):
    """int4_repack(fmt="awq") decodes the hand-packed words (independent of every python packer)."""
    be = get_backend(backend)
    n, k = 16, 64
    qweight = torch.zeros(k, n // 8, dtype=torch.int32)
    qweight[5, 1] = AWQ_W_WORD  # row k = 5, columns 8..15
    qzeros = torch.zeros(1, n // 8, dtype=torch.int32)
    qzeros[0, 1] = AWQ_Z_WORD  # columns 8..15
    packed, zeros, _ = be.ns.int4_repack(qweight.to(be.device), qzeros.to(be.device), "awq", None)
    q = ref.int4_unpack(packed.cpu())  # [N, K]
    expect_q = torch.zeros(n, k, dtype=torch.uint8)
    expect_q[8:16, 5] = torch.tensor(AWQ_W_COLUMNS, dtype=torch.uint8)
    assert torch.equal(q, expect_q), f"column values of row 5: {q[8:16, 5].tolist()}, expected {list(AWQ_W_COLUMNS)}"
    expect_z = torch.zeros(1, n, dtype=torch.uint8)
    expect_z[0, 8:16] = torch.tensor(AWQ_Z_COLUMNS, dtype=torch.uint8)
    assert torch.equal(zeros.cpu(), expect_z), f"zero points {zeros[0, 8:16].tolist()}, expected {list(AWQ_Z_COLUMNS)}"


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
def test_gptq_hand_words_decoded_by_the_op(backend):
    """int4_repack(fmt="gptq") decodes the hand-packed words: sequential nibbles along K, zero points
    stored minus one in plain order along N; a stored 15 (the v1 packer's encoding of a zero point
    of 0) decodes to 0."""
    be = get_backend(backend)
    n, k = 16, 64
    qweight = torch.zeros(k // 8, n, dtype=torch.int32)
    qweight[2, 3] = GPTQ_W_WORD  # column n = 3, rows 16..23
    qzeros = torch.zeros(1, n // 8, dtype=torch.int32)  # columns 0..7: stored 0, zero point 1
    qzeros[0, 1] = GPTQ_Z_WORD  # columns 8..15
    packed, zeros, _ = be.ns.int4_repack(qweight.to(be.device), qzeros.to(be.device), "gptq", None)
    q = ref.int4_unpack(packed.cpu())
    expect_q = torch.zeros(n, k, dtype=torch.uint8)
    expect_q[3, 16:24] = torch.tensor(GPTQ_W_ROWS, dtype=torch.uint8)
    assert torch.equal(q, expect_q), f"rows of column 3: {q[3, 16:24].tolist()}, expected {list(GPTQ_W_ROWS)}"
    expect_z = torch.ones(1, n, dtype=torch.uint8)
    expect_z[0, 8:16] = torch.tensor(GPTQ_Z_COLUMNS, dtype=torch.uint8)
    assert torch.equal(zeros.cpu(), expect_z), f"zero points {zeros[0].tolist()}"
    minus_one = torch.full((1, n // 8), -1, dtype=torch.int32)  # every nibble stored 15
    _, zeros, _ = be.ns.int4_repack(qweight.to(be.device), minus_one.to(be.device), "gptq", None)
    assert int(zeros.count_nonzero()) == 0


# Independent few-line re-implementations of the upstream packers (from the source cited above),
# on W^T = intweight [K, N] int32 and zero points [K / G, N] int32.
def autoawq_pack(intweight, zeros):
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    qweight = torch.zeros(intweight.shape[0], intweight.shape[1] // 8, dtype=torch.int32)
    qzeros = torch.zeros(zeros.shape[0], zeros.shape[1] // 8, dtype=torch.int32)
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)
            qzeros[:, col] |= zeros[:, col * 8 + order_map[i]] << (i * 4)
    return qweight, qzeros


def autogptq_v1_pack(intweight, zeros):
    qweight = torch.zeros(intweight.shape[0] // 8, intweight.shape[1], dtype=torch.int32)
    for row in range(qweight.shape[0]):
        for j in range(8):
            qweight[row] |= intweight[8 * row + j] << (4 * j)
    stored = zeros - 1  # zero points >= 1 here: upstream's uint32 -1 for a zero point of 0 would also
    #                     set the word's higher nibbles (a known v1 defect), see the hand-word test
    qzeros = torch.zeros(zeros.shape[0], zeros.shape[1] // 8, dtype=torch.int32)
    for col in range(qzeros.shape[1]):
        for j in range(8):
            qzeros[:, col] |= stored[:, 8 * col + j] << (4 * j)
    return qweight, qzeros


def test_independent_packers_write_the_hand_words():
    k, n = 64, 16
    iw = torch.zeros(k, n, dtype=torch.int32)
    iw[5, 8:16] = torch.tensor(AWQ_W_COLUMNS)
    z = torch.zeros(1, n, dtype=torch.int32)
    z[0, 8:16] = torch.tensor(AWQ_Z_COLUMNS)
    qweight, qzeros = autoawq_pack(iw, z)
    assert qweight[5, 1].item() == AWQ_W_WORD and qzeros[0, 1].item() == AWQ_Z_WORD
    iw = torch.zeros(k, n, dtype=torch.int32)
    iw[16:24, 3] = torch.tensor(GPTQ_W_ROWS)
    z = torch.ones(1, n, dtype=torch.int32)
    z[0, 8:16] = torch.tensor(GPTQ_Z_COLUMNS)
    qweight, qzeros = autogptq_v1_pack(iw, z)
    assert qweight[2, 3].item() == GPTQ_W_WORD and qzeros[0, 1].item() == GPTQ_Z_WORD


@pytest.mark.parametrize(
    "backend,dtype,fmt,m",
    backend_params({"cpu": [("awq", 1), ("awq", 5), ("gptq", 3)], "sim": [("awq", 1), ("awq", 5), ("gptq", 3)],
                    "cuda": [("awq", 1), ("awq", 5), ("gptq", 3)]}),
)
def test_checkpoint_end_to_end_from_independent_packer(backend, dtype, fmt, m):
    """A weight packed by the re-implemented upstream packer, int4_repack, int4_gemm == the float
    matmul with the checkpoint's dequantised weight (the upstream dequantisation: W^T[k, n] =
    (q - z) * s, AutoAWQ's dequantize_gemm), rounded to the activation dtype."""
    be = get_backend(backend)
    gen = make_gen(77 + m + (fmt == "gptq"))
    k, n, group = 192, 48, 64
    intweight = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    zeros = torch.randint(0 if fmt == "awq" else 1, 16, (k // group, n), generator=gen, dtype=torch.int32)
    scales = make_weights(n, k, group, True, dtype, gen)[1]  # [K / G, N], both signs, never zero
    qweight, qzeros = (autoawq_pack if fmt == "awq" else autogptq_v1_pack)(intweight, zeros)
    w_kn = ((intweight.double() - zeros.double().repeat_interleave(group, 0))
            * scales.double().repeat_interleave(group, 0)).to(dtype)  # [K, N]
    a = randn((m, k), dtype, gen=gen)
    expect = a.double() @ w_kn.double()
    naive = naive_from_w(a, w_kn.t().contiguous())
    dev = be.device
    packed, z_out, _ = be.ns.int4_repack(qweight.to(dev), qzeros.to(dev), fmt, None)
    assert torch.equal(z_out.cpu(), zeros.to(torch.uint8))
    out = be.run(lambda: be.ns.int4_gemm(a.to(dev), packed, scales.to(dev), z_out, group, None))
    assert_fa_close(out, expect, naive, rel_tol=TOL_REL[dtype], floor=1e-5)


def make_act_order(k, group, gen):
    order = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    return g_idx


@pytest.mark.parametrize(
    "backend,dtype,m", backend_params({"cpu": [1, 5], "sim": [1, 5], "cuda": [1, 5]}, dtypes={"cpu": (torch.float16,)}),
)
def test_gptq_act_order_end_to_end(backend, dtype, m):
    be = get_backend(backend)
    gen = make_gen(21 + m)
    n, k, group = 32, 256, 64
    g_idx = make_act_order(k, group, gen)
    w_q, scales, zeros = make_weights(n, k, group, False, dtype, gen)
    qweight, qzeros = ref.gptq_pack(w_q, zeros)
    # The checkpoint's weight: input feature k uses group g_idx[k].
    s_full = scales.to(torch.float64)[g_idx.long()].t()  # [N, K]
    z_full = zeros.to(torch.float64)[g_idx.long()].t()
    w = ((w_q.to(torch.float64) - z_full) * s_full).to(dtype).to(torch.float64)
    a = randn((m, k), dtype, gen=gen)
    expect = a.to(torch.float64) @ w.t()
    packed, z_out, perm = be.ns.int4_repack(qweight.to(be.device), qzeros.to(be.device), "gptq", g_idx.to(be.device))
    assert perm.shape == (k,) and perm.dtype == torch.int64
    assert torch.equal(g_idx[perm.cpu()], (torch.arange(k) // group).to(torch.int32))
    dev = be.device
    out = be.run(lambda: be.ns.int4_gemm(a.to(dev), packed, scales.to(dev), z_out, group, perm))
    naive = naive_from_w(a[:, perm.cpu()], w.to(dtype)[:, perm.cpu()])
    assert_fa_close(out, expect, naive, rel_tol=TOL_REL[dtype], floor=1e-5)
    # Gathering the activations by hand is the same computation.
    out2 = be.run(lambda: be.ns.int4_gemm(*_to(be.device, a[:, perm.cpu()].contiguous(), packed, scales, z_out),
                                          group, None))
    assert_bits_equal(out.cpu(), out2.cpu(), "perm argument vs a[:, perm]")


def test_gptq_act_order_rejects_unequal_groups():
    k, n, group = 128, 16, 64
    qweight = torch.zeros(k // 8, n, dtype=torch.int32)
    qzeros = torch.zeros(k // group, n // 8, dtype=torch.int32)
    g_idx = torch.zeros(k, dtype=torch.int32)
    g_idx[:10] = 1  # 118 features in group 0, 10 in group 1
    with pytest.raises(RuntimeError, match="g_idx must assign exactly group_size"):
        torch.ops.fastinfer.int4_repack(qweight, qzeros, "gptq", g_idx)


# ---- quantiser -----------------------------------------------------------------------------------


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_int4_round_trip(symmetric):
    gen = make_gen(3)
    w = randn((32, 256), torch.bfloat16, gen=gen)
    w_q, scales, zeros = ref.quantize_int4(w, 64, symmetric)
    assert w_q.dtype == torch.uint8 and int(w_q.max()) <= 15 and scales.shape == (4, 32)
    assert (zeros is None) == symmetric
    back = ref.int4_dequantize(w_q, scales, zeros, 64)
    step = scales.to(torch.float64).abs().repeat_interleave(64, 0).t()
    assert ((back - w.to(torch.float64)).abs() <= 0.5 * step * 1.1 + 1e-6).all()
    # and the GEMM on the quantised weight runs
    packed = torch.ops.fastinfer.int4_pack(w_q)
    a = randn((2, 256), torch.bfloat16, gen=gen)
    out = torch.ops.fastinfer.int4_gemm(a, packed, scales, zeros, 64, None)
    assert_fa_close(out, ref.int4_gemm(a, w_q, scales, zeros, 64), naive_gemm(a, w_q, scales, zeros, 64),
                    rel_tol=TOL_REL[torch.bfloat16], floor=1e-5)


# ---- opcheck -------------------------------------------------------------------------------------


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
def test_int4_opcheck(ns):
    be = get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    gen = make_gen(4)
    n, k, group = 32, 128, 64
    w_q, scales, zeros = make_weights(n, k, group, False, torch.bfloat16, gen)
    a = randn((3, k), torch.bfloat16, gen=gen)
    packed = be.ns.int4_pack(w_q)
    qweight, qzeros = ref.gptq_pack(w_q, zeros)
    g_idx = make_act_order(k, group, gen)
    perm = torch.randperm(k, generator=gen)
    cases = [
        ("int4_pack", (w_q,)),
        ("int4_repack", (qweight, qzeros, "gptq", None)),
        ("int4_repack", (qweight, qzeros, "gptq", g_idx)),
        ("int4_repack", (*ref.awq_pack(w_q, zeros), "awq", None)),
        ("int4_gemm", (a, packed, scales, zeros, group, None)),
        ("int4_gemm", (a, packed, scales, None, group, perm)),
    ]
    for op, args in cases:
        torch.library.opcheck(getattr(be.ns, op).default, args)


# ---- bad inputs ------------------------------------------------------------------------------------


def _gemm_args(dtype=torch.bfloat16, m=2, n=32, k=128, group=64):
    gen = make_gen(9)
    w_q, scales, zeros = make_weights(n, k, group, False, dtype, gen)
    return dict(a=randn((m, k), dtype, gen=gen), packed=torch.ops.fastinfer.int4_pack(w_q), scales=scales,
                zeros=zeros, group_size=group, perm=None)


def _call_gemm(ns, **over):
    args = _gemm_args()
    args.update(over)
    return ns.int4_gemm(args["a"], args["packed"], args["scales"], args["zeros"], args["group_size"], args["perm"])


BAD_GEMM = [
    ("a_dtype", lambda d: dict(a=d["a"].to(torch.int32)), r"a must have dtype in"),
    ("a_fp64", lambda d: dict(a=d["a"].double(), scales=d["scales"].double()), r"a must have dtype in"),
    ("a_3d", lambda d: dict(a=d["a"].unsqueeze(0)), r"a must be 2-D"),
    ("k_mismatch", lambda d: dict(a=d["a"][:, :64].contiguous()), r"packed must have shape \[K / 64"),
    ("k_not_tile", lambda d: dict(a=torch.ones(2, 96, dtype=torch.bfloat16)), r"multiple of 64 .*minimum tile"),
    ("packed_n_not_tile", lambda d: dict(packed=d["packed"][:, :8 * 24].contiguous()), r"N a multiple of 16.*minimum tile"),
    ("packed_dtype", lambda d: dict(packed=d["packed"].to(torch.int64)), r"packed must have dtype in"),
    ("group_not_16", lambda d: dict(group_size=24), r"group_size must be a positive multiple of 16"),
    ("k_not_group_multiple", lambda d: dict(group_size=96), r"must be a multiple of group_size"),
    ("scales_shape", lambda d: dict(scales=d["scales"][:1].contiguous()), r"scales must have shape \[K / group_size, N\]"),
    ("scales_dtype", lambda d: dict(scales=d["scales"].half()), r"scales must have the dtype of a"),
    ("zeros_dtype", lambda d: dict(zeros=d["zeros"].to(torch.int32)), r"zeros must have dtype in"),
    ("zeros_shape", lambda d: dict(zeros=d["zeros"].t().contiguous()), r"zeros must have shape"),
    ("zeros_range", lambda d: dict(zeros=d["zeros"] + 16), r"zeros values must be in \[0, 16\)"),
    ("a_noncontig", lambda d: dict(a=torch.cat([d["a"], d["a"]], 1)[:, ::2]), r"a must be contiguous"),
    ("scales_noncontig", lambda d: dict(scales=d["scales"].t().contiguous().t()), r"scales must be contiguous"),
    ("perm_shape", lambda d: dict(perm=torch.arange(64)), r"perm must have K = 128"),
    ("perm_range", lambda d: dict(perm=torch.arange(128) + 1), r"perm values must be in \[0, 128\)"),
    ("packed_device", lambda d: dict(packed=d["packed"].to("meta")), r"packed must be on the device of a"),
    ("zeros_device", lambda d: dict(zeros=d["zeros"].to("meta")), r"zeros must be on the device of a"),
]


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("case,override,arg_re", BAD_GEMM, ids=[c[0] for c in BAD_GEMM])
def test_int4_gemm_bad_input(ns, case, override, arg_re):
    be = get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    with pytest.raises(RuntimeError, match=arg_re) as exc:
        _call_gemm(be.ns, **override(_gemm_args()))
    assert f"{ns}.int4_gemm" in str(exc.value)


def test_int4_gemm_sim_rejects_fp32_and_meta_checks():
    get_backend("sim")
    d = _gemm_args(torch.float32)
    with pytest.raises(RuntimeError, match=r"a must have dtype in \{Half, BFloat16\}"):
        _call_gemm(torch.ops.fastinfer_sim, a=d["a"], scales=d["scales"])
    with pytest.raises(RuntimeError, match=r"group_size must be a positive multiple of 16"):
        _call_gemm(torch.ops.fastinfer, **{k: (v.to("meta") if isinstance(v, torch.Tensor) else v)
                                           for k, v in dict(_gemm_args(), group_size=8).items()})


BAD_PACK = [
    (lambda: torch.zeros(32, 128, dtype=torch.int32), r"w_q must have dtype in"),
    (lambda: torch.zeros(24, 128, dtype=torch.uint8), r"N \(output features\) must be a positive multiple of 16"),
    (lambda: torch.zeros(32, 100, dtype=torch.uint8), r"K \(input features\) must be a positive multiple of 64"),
    (lambda: torch.zeros(32, dtype=torch.uint8), r"w_q must be 2-D"),
    (lambda: torch.full((32, 128), 16, dtype=torch.uint8), r"w_q values must be in \[0, 16\)"),
]


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("i", range(len(BAD_PACK)))
def test_int4_pack_bad_input(ns, i):
    be = get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    make, arg_re = BAD_PACK[i]
    with pytest.raises(RuntimeError, match=arg_re):
        be.ns.int4_pack(make())


BAD_REPACK = [
    (lambda: (torch.zeros(128, 4), torch.zeros(2, 4, dtype=torch.int32), "awq", None), r"qweight must have dtype in"),
    (lambda: (torch.zeros(128, 4, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32), "exl2", None),
     r"fmt must be 'awq' or 'gptq'"),
    (lambda: (torch.zeros(128, 4, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32), "awq", None),
     r"qzeros must have shape \[K / group_size, N / 8\]"),
    (lambda: (torch.zeros(128, 4, dtype=torch.int32), torch.zeros(3, 4, dtype=torch.int32), "awq", None),
     r"qzeros.size\(0\) must be K / group_size"),
    (lambda: (torch.zeros(128, 3, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32), "awq", None),
     r"N \(output features\) must be a positive multiple of 16"),
    (lambda: (torch.zeros(128, 4, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32), "awq",
              torch.zeros(128, dtype=torch.int32)), r"g_idx \(act-order\) is only defined for fmt='gptq'"),
    (lambda: (torch.zeros(16, 32, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32), "gptq",
              torch.full((128,), 2, dtype=torch.int32)), r"g_idx values must be in \[0, 2\)"),
]


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("i", range(len(BAD_REPACK)))
def test_int4_repack_bad_input(ns, i):
    be = get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    make, arg_re = BAD_REPACK[i]
    with pytest.raises(RuntimeError, match=arg_re):
        be.ns.int4_repack(*make())


# ---- python wrappers -----------------------------------------------------------------------------


def test_python_wrappers():
    import fastinfer.ops as ops

    gen = make_gen(2)
    n, k, group = 32, 128, 64
    w_q, scales, zeros = make_weights(n, k, group, False, torch.float32, gen)
    qweight, qzeros = ref.gptq_pack(w_q, zeros)
    g_idx = make_act_order(k, group, gen)
    r = ops.int4_repack(qweight, qzeros, "gptq", g_idx=g_idx)
    assert r.perm is not None and r.perm.shape == (k,)
    assert ops.int4_repack(qweight, qzeros, "gptq").perm is None
    a = randn((3, k), torch.float32, gen=gen)
    out = ops.int4_gemm(a, r.packed, scales, r.zeros, group, perm=r.perm)
    s_full = scales.to(torch.float64)[g_idx.long()].t()
    z_full = zeros.to(torch.float64)[g_idx.long()].t()
    expect = a.double() @ ((w_q.double() - z_full) * s_full).float().double().t()
    assert torch.allclose(out.double(), expect, rtol=1e-5, atol=1e-5)
    assert torch.equal(ops.int4_pack(w_q), ref.int4_pack(w_q))


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
def test_int4_gemm_empty_batch(backend):
    be = get_backend(backend)
    dtype = torch.bfloat16
    w_q, scales, zeros = make_weights(32, 128, 64, False, dtype, make_gen(6))
    a = torch.empty(0, 128, dtype=dtype)
    out = be.ns.int4_gemm(*_to(be.device, a, be.ns.int4_pack(w_q.to(be.device)), scales, zeros), 64, None)
    assert out.shape == (0, 32) and out.dtype == dtype


@pytest.mark.cuda
def test_int4_gemm_is_cuda_graph_capturable():
    """Split-K workspace and counters come from the caching allocator (no host sync): capture, replay."""
    be = get_backend("cuda")
    gen = make_gen(12)
    n, k, group = 4096, 4096, 128
    w_q, scales, zeros = make_weights(n, k, group, False, torch.bfloat16, gen)
    packed = be.ns.int4_pack(w_q.cuda())
    scales, zeros = scales.cuda(), zeros.cuda()
    a = randn((1, k), torch.bfloat16, gen=gen).cuda()
    eager = be.ns.int4_gemm(a, packed, scales, zeros, group, None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = be.ns.int4_gemm(a, packed, scales, zeros, group, None)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager, captured), "split-K reduction must be deterministic across runs"


@pytest.mark.compile
def test_int4_mlp_compiles_fullgraph_dynamic():
    """An int4 MLP (gate_up -> silu*mul -> down) under torch.compile(fullgraph, dynamic M): the fake
    impls trace with symbolic sizes and the compiled result equals eager bit for bit."""
    import fastinfer.ops as ops

    get_backend("cpu")
    torch._dynamo.reset()
    gen = make_gen(31)
    hidden, inter, group = 128, 192, 64
    gu_q, gu_s, gu_z = make_weights(2 * inter, hidden, group, False, torch.float32, gen)
    d_q, d_s, _ = make_weights(hidden, inter, group, True, torch.float32, gen)
    gu_p, d_p = ops.int4_pack(gu_q), ops.int4_pack(d_q)

    def mlp(x):
        h = ops.int4_gemm(x, gu_p, gu_s, gu_z, group)
        h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        return ops.int4_gemm(h.contiguous(), d_p, d_s, None, group)

    compiled = torch.compile(mlp, fullgraph=True, dynamic=True, backend="aot_eager")
    for m in (3, 5):
        x = randn((m, hidden), torch.float32, gen=gen)
        assert_bits_equal(compiled(x), mlp(x), f"compiled int4 mlp, M={m}")
