"""Multi-head latent attention (mla_cache_write, mla_decode_attention) against the fp64 references:
the CPU impl, the CUDA kernels in the simt emulator (two schedule seeds, bit-identical) and the GPU
(-m cuda). Latent caches in the activations' dtype and in fp8 e4m3 with per-tensor or per-token
scales, shuffled block tables, poisoned unused slots (and scales), 1..k query tokens per sequence
under the causal rule or a tree mask, split-KV, the deterministic mode (a sequence alone and in a
batch, bitwise), opcheck and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_bits_equal, assert_fa_close, get_backend, make_gen, poison_, randn
import fastinfer.reference.attention as RA
import fastinfer.reference.mla as R
from test_attention import check_out_lse, cu

BACKEND_NAMES = ["cpu", "sim", "cuda"]
MARKS = {"sim": [pytest.mark.sim], "cuda": [pytest.mark.cuda]}
DTYPES = {"cpu": (torch.float32, torch.bfloat16), "sim": (torch.bfloat16, torch.float16),
          "cuda": (torch.bfloat16, torch.float16)}
LATENT, ROPE, ROW = 512, 64, 576


def params(cases, backends=None):
    return [pytest.param(b, dt, c, marks=MARKS.get(b, []), id=f"{b}-{str(dt)[6:]}-{i}")
            for b in backends or BACKEND_NAMES for dt in DTYPES[b] for i, c in enumerate(cases)]


def latent_cache(seq_lens, bs, dtype, g, kind="same", spare_blocks=2):
    """A shuffled paged latent cache holding `seq_lens` tokens per sequence, written through the
    reference cache write ("same": the activations' dtype; "fp8-tensor" / "fp8-token": e4m3 with a
    per-tensor or per-token scale); unused slots, and the per-token scales of unused slots, poisoned
    with NaN. Returns (cache, block_table, kv_scale or None)."""
    blocks = [math.ceil(n / bs) for n in seq_lens]
    nb = sum(blocks) + spare_blocks
    width = max(blocks + [1]) + 1  # a spare column: tables are usually wider than needed
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    table = torch.full((len(seq_lens), width), -7, dtype=torch.int32)  # unused entries: garbage ids
    used, slots = 0, []
    for b, n in enumerate(seq_lens):
        table[b, : blocks[b]] = perm[used : used + blocks[b]]
        used += blocks[b]
        slots += [int(table[b, j // bs]) * bs + j % bs for j in range(n)]
    slots = torch.tensor(slots, dtype=torch.int64)
    kv_c = randn((len(slots), LATENT), torch.float32, gen=g).to(dtype)
    k_pe = randn((len(slots), ROPE), torch.float32, gen=g, scale=2.0).to(dtype)
    if kind == "same":
        cache = poison_(torch.empty((nb, bs, ROW), dtype=dtype))
        scale = None
    else:
        cache = poison_(torch.empty((nb, bs, ROW), dtype=torch.float8_e4m3fn))
        scale = torch.tensor([0.013]) if kind == "fp8-tensor" else poison_(torch.empty((nb, bs), dtype=torch.float32))
    new_cache, new_scale = R.mla_cache_write(kv_c, k_pe, cache, slots, scale)
    return new_cache.to(cache.dtype), table, new_scale


def naive_mla(q, cache, table, cq, seq_lens, scale, causal, mask=None, kv_scale=None):
    """The same computation in q's dtype (the error-rule baseline)."""
    out = torch.zeros((*q.shape[:2], LATENT), dtype=q.dtype)
    lse = torch.zeros(q.shape[:2], dtype=q.dtype)
    off = 0
    for b in range(len(seq_lens)):
        qs, qe, n = int(cq[b]), int(cq[b + 1]), int(seq_lens[b])
        m = None
        if mask is not None:
            m = mask[off : off + (qe - qs) ** 2]
            off += (qe - qs) ** 2
        vis = RA.visibility_mask(qe - qs, n, causal, -1, m)
        rows = R.gather_latent(cache, table[b], n, kv_scale).to(q.dtype)
        s = torch.einsum("qhd,kd->hqk", q[qs:qe], rows) * scale
        s = s.masked_fill(~vis.unsqueeze(0), float("-inf"))
        lse[qs:qe] = torch.logsumexp(s.float(), -1).to(q.dtype).transpose(0, 1)
        p = torch.softmax(s, -1).nan_to_num(0.0)
        out[qs:qe] = torch.einsum("hqk,kd->qhd", p, rows[:, :LATENT])
    return out, lse


def tree_masks(q_lens, g):
    return torch.cat([RA.tree_mask(RA.random_tree_parents(n, g)).reshape(-1) for n in q_lens])


# ---------------------------------------------------------------------------------------------
# mla_cache_write: bit for bit against the reference; unnamed rows keep their bits
WRITE_CASES = [  # (tokens, num_blocks, block_size, cache kind, strided inputs)
    (1, 2, 16, "same", False),
    (37, 4, 16, "same", True),
    (29, 3, 64, "fp8-tensor", False),
    (45, 5, 16, "fp8-token", True),
]


@pytest.mark.parametrize("backend,dtype,case", params(WRITE_CASES))
def test_mla_cache_write(backend, dtype, case):
    be = get_backend(backend)
    t, nb, bs, kind, strided = case
    g = make_gen(t + nb)
    fused = randn((t, ROW + 32), dtype, gen=g)  # the fused projection output: kv_c and k_pe are views
    kv_c = fused[:, :LATENT] if strided else fused[:, :LATENT].contiguous()
    k_pe = fused[:, LATENT + 32:] if strided else fused[:, LATENT + 32:].contiguous()
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[::5] = -1  # padding tokens
    fp8 = kind != "same"
    cache = poison_(torch.empty((nb, bs, ROW), dtype=torch.float8_e4m3fn if fp8 else dtype))
    scale = None
    if kind == "fp8-tensor":
        scale = torch.tensor([0.02])
    elif kind == "fp8-token":
        scale = poison_(torch.empty((nb, bs), dtype=torch.float32))
    want_cache, want_scale = R.mla_cache_write(kv_c, k_pe, cache, slots, scale)
    dev = be.device

    def run():
        c, s = cache.to(dev), None if scale is None else scale.to(dev)
        be.ns.mla_cache_write(kv_c.to(dev), k_pe.to(dev), c, slots.to(dev), s)
        return (c.cpu(), torch.zeros(0) if s is None else s.cpu())

    got_cache, got_scale = be.run(run)
    assert_bits_equal(got_cache, want_cache.to(got_cache.dtype), f"{backend} {kind} cache")
    if kind == "fp8-token":
        assert_bits_equal(got_scale, want_scale, f"{backend} per-token scales")
    elif kind == "fp8-tensor":
        assert_bits_equal(got_scale, scale, f"{backend} per-tensor scale (read only)")


# ---------------------------------------------------------------------------------------------
# mla_decode_attention
# (q_lens, seq_lens, H, block_size, causal, tree mask, fixed_split_size, cache kind)
DECODE_CASES = [
    ([1, 1, 1], [1, 37, 300], 16, 16, True, False, 0, "same"),
    ([1, 1], [64, 129], 128, 64, True, False, 0, "same"),  # DeepSeek-V3's 128 heads
    ([3, 2], [40, 77], 16, 16, True, False, 0, "same"),  # speculation: causal over the new tokens
    ([4, 1, 5], [20, 5, 70], 8, 16, True, True, 0, "same"),  # tree speculation
    ([2, 3], [50, 9], 20, 8, False, False, 0, "same"),  # not causal; a head count that is no multiple of 16
    ([1, 1, 1], [1, 37, 300], 16, 16, True, False, 64, "same"),  # the deterministic mode
    ([3, 1], [200, 130], 16, 16, True, True, 128, "fp8-token"),  # deterministic tree rows, fp8
    ([1, 2, 1], [37, 90, 300], 16, 64, True, False, 0, "fp8-tensor"),
    ([1, 1, 1], [1, 37, 300], 16, 16, True, False, 0, "fp8-token"),
    ([2], [2], 4, 8, True, False, 0, "same"),
]


@pytest.mark.parametrize("backend,dtype,case", params(DECODE_CASES))
def test_mla_decode_attention(backend, dtype, case):
    be = get_backend(backend)
    q_lens, seq_lens, h, bs, causal, tree, split, kind = case
    g = make_gen(sum(seq_lens) + h + bs)
    cache, table, kv_scale = latent_cache(seq_lens, bs, dtype, g, kind)
    q = randn((sum(q_lens), h, ROW), dtype, gen=g)
    mask = tree_masks(q_lens, g) if tree else None
    cq, lens = cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32)
    scale, dev = 1.0 / math.sqrt(192), be.device
    ref_out, ref_lse = R.mla_decode_attention(q, cache, table, lens, cq, scale, causal, mask, kv_scale, split)
    naive_out, naive_lse = naive_mla(q, cache, table, cq, lens, scale, causal, mask, kv_scale)
    opt = (lambda t: None if t is None else t.to(dev))
    for splits in ((0,) if split or backend == "cpu" else (0, 1, 3)):
        out, lse = be.run(lambda: tuple(t.cpu() for t in be.ns.mla_decode_attention(
            q.to(dev), cache.to(dev), table.to(dev), lens.to(dev), cq.to(dev), scale, causal, opt(mask), splits, True,
            opt(kv_scale), split)))
        assert out.shape == (q.shape[0], h, LATENT) and out.dtype == dtype
        check_out_lse(out, lse, ref_out, ref_lse, naive_out, naive_lse, f"mla decode splits={splits}")


@pytest.mark.parametrize("backend", [pytest.param(b, marks=MARKS.get(b, [])) for b in BACKEND_NAMES])
@pytest.mark.parametrize("kind", ["same", "fp8-token"])
def test_mla_deterministic_batch_invariant(backend, kind):
    """fixed_split_size > 0: a sequence's out and lse have the same bits alone and in a batch of
    other sequences (other lengths, other q_lens)."""
    be = get_backend(backend)
    dtype = torch.bfloat16
    g = make_gen(41)
    seq_lens, q_lens, h = [5, 300, 130, 64], [1, 2, 1, 3], 16
    cache, table, kv_scale = latent_cache(seq_lens, 16, dtype, g, kind)
    q = randn((sum(q_lens), h, ROW), dtype, gen=g)
    dev, opt = be.device, (lambda t: None if t is None else t.to(dev))
    lens = torch.tensor(seq_lens, dtype=torch.int32)

    def run(rows, seqs):
        qs = torch.cat([q[int(cu(q_lens)[b]):int(cu(q_lens)[b + 1])] for b in seqs])
        return be.run(lambda: tuple(t.cpu() for t in be.ns.mla_decode_attention(
            qs.to(dev), cache.to(dev), table[seqs].to(dev), lens[seqs].to(dev), cu([q_lens[b] for b in seqs]).to(dev),
            0.07, True, None, 0, True, opt(kv_scale), 64)))

    batch = run(None, [0, 1, 2, 3])
    alone = run(None, [1])
    assert_bits_equal(batch[0][1:3], alone[0], f"{backend} {kind} out: alone vs in a batch")
    assert_bits_equal(batch[1][1:3], alone[1], f"{backend} {kind} lse: alone vs in a batch")


KERNELS = [pytest.param("sim", marks=pytest.mark.sim), pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("case", [DECODE_CASES[i] for i in (2, 3, 6, 8)], ids=["causal", "tree", "det-fp8", "fp8"])
def test_mla_decode_32_row_ctas(backend, case, monkeypatch):
    """The 32-row CTA shape (the devices with 99 KiB of shared memory per block), whatever this
    device is: the same cases against the reference."""
    monkeypatch.setenv("FASTINFER_TEST_MLA_ROWS", "32")
    test_mla_decode_attention(backend, torch.bfloat16, case)


@pytest.mark.parametrize("backend", KERNELS)
def test_mla_deterministic_launch_groups(backend, monkeypatch):
    """The deterministic mode's chunks folded over several launches (a small partials budget) give
    the bits of one launch: the fold continues from its fp32 running state."""
    be = get_backend(backend)
    g = make_gen(12)
    seq_lens, q_lens, h = [300, 77], [2, 1], 16
    cache, table, kv_scale = latent_cache(seq_lens, 16, torch.bfloat16, g, "fp8-token")
    q = randn((sum(q_lens), h, ROW), torch.bfloat16, gen=g)
    dev, lens = be.device, torch.tensor(seq_lens, dtype=torch.int32)

    def run():
        return be.run(lambda: tuple(t.cpu() for t in be.ns.mla_decode_attention(
            q.to(dev), cache.to(dev), table.to(dev), lens.to(dev), cu(q_lens).to(dev), 0.07, True, None, 0, True,
            kv_scale.to(dev), 64)))

    one = run()
    monkeypatch.setenv("FASTINFER_TEST_FIXED_SPLIT_PARTIAL_BYTES", str(2 * 3 * h * 513 * 4))  # 2 chunks a launch
    grouped = run()
    assert_bits_equal(grouped[0], one[0], "out: 2 chunks a launch vs one launch")
    assert_bits_equal(grouped[1], one[1], "lse: 2 chunks a launch vs one launch")


@pytest.mark.parametrize("backend", [pytest.param(b, marks=MARKS.get(b, [])) for b in BACKEND_NAMES])
def test_mla_nonfinite(backend):
    """A NaN in a key row (its rotary part or its latent, which is also the value) makes exactly the
    rows that see the key NaN, out and lse; keys the causal rule hides never reach a row's lse, nor
    its out on the CPU (the kernel's tensor-core P V carries a hidden NaN latent element into that
    column of the other rows of its key tile, as the prefill kernel's: docs/design.md)."""
    be = get_backend(backend)
    dtype = torch.bfloat16
    g = make_gen(5)
    cache, table, _ = latent_cache([20], 16, dtype, g)
    q = randn((3, 16, ROW), dtype, gen=g)
    dev = be.device
    for key, dim in ((19, LATENT + 5), (18, 7)):  # key 19: only the last query sees it; key 18: the last two
        bad = cache.clone()
        bad[int(table[0, key // 16]), key % 16, dim] = float("nan")
        out, lse = be.run(lambda: tuple(t.cpu() for t in be.ns.mla_decode_attention(
            q.to(dev), bad.to(dev), table.to(dev), torch.tensor([20], dtype=torch.int32).to(dev), cu([3]).to(dev),
            0.05, True, None, 0, True, None, 0)))
        seen = key - 17  # rows key - 17 .. 2 see the key
        assert torch.isfinite(lse[:seen]).all(), (key, dim)
        if backend == "cpu" or dim >= LATENT:
            assert torch.isfinite(out[:seen]).all(), (key, dim)
        else:
            others = torch.cat([out[:seen, :, :dim], out[:seen, :, dim + 1:]], dim=-1)
            assert torch.isfinite(others).all(), (key, dim)
        assert torch.isnan(out[seen:]).all() and torch.isnan(lse[seen:]).all(), (key, dim)


def test_mla_matches_transformers_attention_math():
    """The absorbed form equals DeepSeek-V3's attention as transformers computes it (per head
    k_nope = W_UK kv_c, v = W_UV kv_c, scores q_nope . k_nope + q_pe . k_pe): absorbing W_UK into
    the query and applying W_UV after the op gives the same output (fp64 reference, then the CPU
    op in float32)."""
    g = make_gen(8)
    h, nope, vdim, n = 4, 128, 128, 23
    kv_c = randn((n, LATENT), torch.float64, gen=g)
    k_pe = randn((n, ROPE), torch.float64, gen=g)
    w_uk = randn((h, nope, LATENT), torch.float64, gen=g, scale=0.05)
    w_uv = randn((h, vdim, LATENT), torch.float64, gen=g, scale=0.05)
    q_nope = randn((1, h, nope), torch.float64, gen=g)
    q_pe = randn((1, h, ROPE), torch.float64, gen=g)
    scale = (nope + ROPE) ** -0.5
    k_nope = torch.einsum("hnl,tl->thn", w_uk, kv_c)
    v = torch.einsum("hvl,tl->thv", w_uv, kv_c)
    s = (torch.einsum("qhn,thn->hqt", q_nope, k_nope) + torch.einsum("qhr,tr->hqt", q_pe, k_pe)) * scale
    want = torch.einsum("hqt,thv->qhv", torch.softmax(s, -1), v)
    q = torch.cat([torch.einsum("qhn,hnl->qhl", q_nope, w_uk), q_pe], dim=-1)
    cache = torch.cat([kv_c, k_pe], 1).reshape(1, n, ROW)
    table, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    cache32 = torch.zeros(1, 32, ROW)
    cache32[0, :n] = cache[0].float()
    for out_latent in (R.mla_decode_attention(q, cache, table, lens, cu([1]), scale)[0],
                       torch.ops.fastinfer.mla_decode_attention(q.float(), cache32, table, lens, cu([1]), scale)[0]):
        got = torch.einsum("qhl,hvl->qhv", out_latent.double(), w_uv)
        tol = 1e-12 if out_latent.dtype == torch.float64 else 1e-5
        assert ((got - want).norm() / want.norm()).item() < tol


# ---------------------------------------------------------------------------------------------
# opcheck and bad input
def _write_args(**over):
    args = dict(kv_c=torch.randn(5, LATENT, dtype=torch.bfloat16), k_pe=torch.randn(5, ROPE, dtype=torch.bfloat16),
                kv_cache=torch.zeros(3, 16, ROW, dtype=torch.bfloat16), slot_mapping=torch.tensor([0, 3, -1, 17, 40]),
                kv_scale=None)
    args.update(over)
    return list(args.values())


def _decode_args(**over):
    args = dict(q=torch.randn(3, 16, ROW, dtype=torch.bfloat16), kv_cache=torch.randn(4, 16, ROW, dtype=torch.bfloat16),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                seq_lens=torch.tensor([20, 3], dtype=torch.int32), cu_seqlens_q=cu([2, 1]), scale=0.07, causal=True,
                custom_mask=None, num_splits=0, return_lse=False, kv_scale=None, fixed_split_size=0)
    args.update(over)
    return list(args.values())


FP8_CACHE = torch.zeros(4, 16, ROW, dtype=torch.float8_e4m3fn)
BAD = [
    ("mla_cache_write", "latent-width", lambda: _write_args(kv_c=torch.randn(5, 448, dtype=torch.bfloat16)), r"kv_c must have 512"),
    ("mla_cache_write", "rotary-width", lambda: _write_args(k_pe=torch.randn(5, 128, dtype=torch.bfloat16)), r"k_pe must have 64"),
    ("mla_cache_write", "rotary-tokens", lambda: _write_args(k_pe=torch.randn(4, ROPE, dtype=torch.bfloat16)), r"k_pe must have num_tokens"),
    ("mla_cache_write", "rotary-dtype", lambda: _write_args(k_pe=torch.randn(5, ROPE, dtype=torch.float16)), r"k_pe must have the dtype"),
    ("mla_cache_write", "cache-row", lambda: _write_args(kv_cache=torch.zeros(3, 16, 512, dtype=torch.bfloat16)), r"kv_cache must have 576"),
    ("mla_cache_write", "cache-layout", lambda: _write_args(kv_cache=torch.zeros(3, 16, 1, ROW, dtype=torch.bfloat16)), r"kv_cache must be 3-D"),
    ("mla_cache_write", "cache-dtype", lambda: _write_args(kv_cache=torch.zeros(3, 16, ROW, dtype=torch.float16)), r"kv_cache must have the dtype"),
    ("mla_cache_write", "cache-noncontig", lambda: _write_args(kv_cache=torch.zeros(3, ROW, 16, dtype=torch.bfloat16).transpose(1, 2)),
     r"kv_cache must be contiguous"),
    ("mla_cache_write", "fp8-no-scale", lambda: _write_args(kv_cache=torch.zeros(3, 16, ROW, dtype=torch.float8_e4m3fn)), r"kv_scale is required"),
    ("mla_cache_write", "fp8-scale-shape", lambda: _write_args(kv_cache=torch.zeros(3, 16, ROW, dtype=torch.float8_e4m3fn),
                                                               kv_scale=torch.ones(3, 8)), r"kv_scale must be float32 with 1 element"),
    ("mla_cache_write", "scale-not-fp8", lambda: _write_args(kv_scale=torch.ones(1)), r"kv_scale must be None unless"),
    ("mla_cache_write", "slot-range", lambda: _write_args(slot_mapping=torch.tensor([0, 3, -1, 17, 48])), r"slot_mapping values"),
    ("mla_cache_write", "slot-dtype", lambda: _write_args(slot_mapping=torch.tensor([0., 3, -1, 17, 40])), r"slot_mapping"),
    ("mla_decode_attention", "q-width", lambda: _decode_args(q=torch.randn(3, 16, 512, dtype=torch.bfloat16)), r"q must have 576"),
    ("mla_decode_attention", "q-dtype", lambda: _decode_args(q=torch.randn(3, 16, ROW, dtype=torch.float16)), r"kv_cache must have the dtype of q"),
    ("mla_decode_attention", "q-rank", lambda: _decode_args(q=torch.randn(3, ROW, dtype=torch.bfloat16)), r"q must be 3-D"),
    ("mla_decode_attention", "q-heads-strided", lambda: _decode_args(q=torch.randn(3, ROW, 16, dtype=torch.bfloat16).transpose(1, 2)), r"\bq\b"),
    ("mla_decode_attention", "cache-row", lambda: _decode_args(kv_cache=torch.randn(4, 16, 512, dtype=torch.bfloat16)), r"kv_cache must have 576"),
    ("mla_decode_attention", "cache-layout", lambda: _decode_args(kv_cache=torch.randn(4, 16, 1, ROW, dtype=torch.bfloat16)), r"kv_cache must be 3-D"),
    ("mla_decode_attention", "block-size", lambda: _decode_args(kv_cache=torch.randn(4, 12, ROW, dtype=torch.bfloat16)), r"block_size"),
    ("mla_decode_attention", "fp8-no-scale", lambda: _decode_args(kv_cache=FP8_CACHE), r"kv_scale is required"),
    ("mla_decode_attention", "fp8-scale-shape", lambda: _decode_args(kv_cache=FP8_CACHE, kv_scale=torch.ones(4)), r"kv_scale must be float32"),
    ("mla_decode_attention", "fp8-scale-dtype", lambda: _decode_args(kv_cache=FP8_CACHE, kv_scale=torch.ones(1).double()),
     r"kv_scale must be float32"),
    ("mla_decode_attention", "table-dtype", lambda: _decode_args(block_table=torch.tensor([[0, 1], [2, 3]])), r"block_table"),
    ("mla_decode_attention", "block-id", lambda: _decode_args(block_table=torch.tensor([[0, 9], [2, 3]], dtype=torch.int32)), r"block_table"),
    ("mla_decode_attention", "seq-too-long", lambda: _decode_args(seq_lens=torch.tensor([33, 3], dtype=torch.int32)), r"seq_lens"),
    ("mla_decode_attention", "q-longer-than-k", lambda: _decode_args(seq_lens=torch.tensor([1, 3], dtype=torch.int32)), r"queries"),
    ("mla_decode_attention", "cu-total", lambda: _decode_args(cu_seqlens_q=cu([1, 1])), r"cu_seqlens_q"),
    ("mla_decode_attention", "cu-size", lambda: _decode_args(cu_seqlens_q=cu([3])), r"cu_seqlens_q"),
    ("mla_decode_attention", "mask-size", lambda: _decode_args(custom_mask=torch.ones(4, dtype=torch.bool)), r"custom_mask"),
    ("mla_decode_attention", "mask-dtype", lambda: _decode_args(custom_mask=torch.ones(5, dtype=torch.int32)), r"custom_mask must be bool"),
    ("mla_decode_attention", "splits", lambda: _decode_args(num_splits=-1), r"num_splits"),
    ("mla_decode_attention", "fixed-split", lambda: _decode_args(fixed_split_size=100), r"fixed_split_size"),
    ("mla_decode_attention", "fixed-and-splits", lambda: _decode_args(fixed_split_size=64, num_splits=2), r"num_splits must be 0"),
    ("mla_decode_attention", "scale-nan", lambda: _decode_args(scale=float("nan")), r"scale must be a finite number"),
]


NAMESPACES = ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)]


@pytest.mark.parametrize("ns", NAMESPACES)
@pytest.mark.parametrize("op,case,make_args,arg_re", BAD, ids=[f"{b[0]}-{b[1]}" for b in BAD])
def test_mla_bad_input(ns, op, case, make_args, arg_re):
    be = get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    with pytest.raises(RuntimeError, match=arg_re) as exc:
        getattr(be.ns, op)(*make_args())
    assert f"{ns}.{op}:" in str(exc.value)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_mla_opcheck(ns):
    be = get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    g = make_gen(3)
    bf = torch.bfloat16
    cache, table, _ = latent_cache([20, 3], 16, bf, g)
    cache = cache.nan_to_num(0.5)
    q = randn((3, 16, ROW), bf, gen=g)
    lens = torch.tensor([20, 3], dtype=torch.int32)
    kv_c, k_pe = randn((4, LATENT), bf, gen=g), randn((4, ROPE), bf, gen=g)
    slots = torch.tensor([1, 5, -1, 30])
    cases = [
        ("mla_cache_write", (kv_c, k_pe, cache.clone(), slots, None), None),
        ("mla_decode_attention", (q, cache, table, lens, cu([2, 1]), 0.07, True, None, 0, True, None, 0), None),
        ("mla_decode_attention", (q, cache, table, lens, cu([2, 1]), 0.07, True, torch.tensor([1, 0, 1, 1, 1], dtype=torch.bool),
                                  2, False, None, 0), None),
        ("mla_decode_attention", (q, cache, table, lens, cu([2, 1]), 0.07, True, None, 0, True, None, 64), None),
    ]
    for op, args, _ in cases:
        torch.library.opcheck(getattr(be.ns, op).default, args)
    # fp8 caches: test_schema multiplies every input, which torch does not implement for
    # float8_e4m3fn tensors: the other checks.
    fp8_cache, fp8_table, token_scale = latent_cache([20, 3], 16, bf, g, "fp8-token")
    token_scale = token_scale.nan_to_num(0.01)
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(be.ns.mla_cache_write.default, (kv_c, k_pe, fp8_cache.clone(), slots, token_scale.clone()),
                          test_utils=utils)
    torch.library.opcheck(be.ns.mla_decode_attention.default,
                          (q, fp8_cache, fp8_table, lens, cu([2, 1]), 0.07, True, None, 0, True, token_scale, 0),
                          test_utils=utils)


@pytest.mark.cuda
def test_mla_decode_is_cuda_graph_capturable():
    """No host sync and no allocation outside the caching allocator (split-KV workspace, custom mask
    offsets): capture, then replay."""
    be = get_backend("cuda")
    g = make_gen(9)
    q_lens, seq_lens = [3, 1], [700, 33]
    cache, table, kv_scale = latent_cache(seq_lens, 64, torch.bfloat16, g, "fp8-token")
    cache, table, kv_scale = cache.cuda(), table.clamp_min(0).cuda(), kv_scale.nan_to_num(0.01).cuda()
    q = randn((sum(q_lens), 128, ROW), torch.bfloat16, gen=g).cuda()
    lens, cq = torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), cu(q_lens).cuda()
    mask = tree_masks(q_lens, g).cuda()

    def call():
        return be.ns.mla_decode_attention(q, cache, table, lens, cq, 0.07, True, mask, 0, True, kv_scale, 0)

    eager = call()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up on the capture stream
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
