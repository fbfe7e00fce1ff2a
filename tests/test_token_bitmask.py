"""apply_token_bitmask (constrained decoding's mask) against the fp64 oracle of
``fastinfer.reference.sampling`` and against xgrammar's own CPU implementation
(``xgrammar.apply_token_bitmask_inplace``, the producer of the layout): the CPU impl, the CUDA
kernel in the simt emulator (two schedule seeds, bit-identical) and the GPU (-m cuda).

The op writes -inf or nothing, so results are compared bit for bit: allowed tokens and unselected
rows keep their exact input bits (random normal logits with a few NaN planted), disallowed tokens
become -inf. Masks are random words with about half the bits set, plus an all-allowed row (the
kernel's early exit), an all-disallowed row and, on wider masks, set padding bits beyond V.
"""

from __future__ import annotations

import pytest
import torch

from conftest import get_backend, make_gen, raw_bits
import fastinfer.reference.sampling as RS

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def make_inputs(B, V, dtype, seed, extra_words=0):
    g = make_gen(seed)
    logits = torch.randn(B, V, generator=g).to(dtype)
    logits.view(-1)[torch.randint(0, B * V, (max(1, B * V // 97),), generator=g)] = float("nan")
    W = (V + 31) // 32 + extra_words
    bitmask = torch.randint(-2 ** 31, 2 ** 31, (B, W), generator=g, dtype=torch.int64).to(torch.int32)
    if B > 1:
        bitmask[0] = -1  # everything allowed
        bitmask[1] = 0   # nothing allowed
    return logits, bitmask


def expected(logits, bitmask, indices):
    """The oracle's -inf positions on the input's own bits (a round trip through float64 would
    change NaN payloads)."""
    ref = RS.apply_token_bitmask(logits, bitmask, indices)
    return logits.masked_fill(torch.isneginf(ref), float("-inf"))


def run_op(be, logits, bitmask, indices):
    dev = be.device

    def call():
        x = logits.to(dev)
        be.ns.apply_token_bitmask(x, bitmask.to(dev), None if indices is None else indices.to(dev))
        return x.cpu()

    return be.run(call)


def assert_same_bits(out, ref, name):
    if not torch.equal(raw_bits(out), raw_bits(ref)):
        bad = (raw_bits(out) != raw_bits(ref)).nonzero()[0].tolist()
        raise AssertionError(f"{name}: differs at {bad}: {out[tuple(bad)]} vs {ref[tuple(bad)]}")


# (B, V, extra mask words, indices): V = 1000 takes the 16-byte path, 33 / 1001 the scalar one
CASES = [
    (3, 33, 0, None),
    (4, 1000, 0, None),
    (5, 1001, 2, None),
    (1, 1, 0, None),
    (6, 64, 1, [4, 1, 3]),
    (5, 1000, 0, [0, 2, 2]),   # a repeated row: masking twice is masking once
    (4, 1003, 0, []),
]
CPU_ONLY = [(3, 49157, 1, None), (9, 32000, 0, [8, 0, 5])]


def params():
    out = []
    for backend in ("cpu", "sim", "cuda"):
        marks = {"sim": [pytest.mark.sim], "cuda": [pytest.mark.cuda]}.get(backend, [])
        cases = CASES + (CPU_ONLY if backend != "sim" else [])
        for i, case in enumerate(cases):
            dt = DTYPES[i % len(DTYPES)]
            idx_dt = torch.int32 if i % 2 else torch.int64
            cid = f"{backend}-{str(dt)[6:]}-B{case[0]}V{case[1]}+{case[2]}" + ("" if case[3] is None else f"-idx{len(case[3])}")
            out.append(pytest.param(backend, dt, idx_dt, case, marks=marks, id=cid))
    return out


@pytest.mark.parametrize("backend,dtype,index_dtype,case", params())
def test_apply_token_bitmask_matches_reference(backend, dtype, index_dtype, case):
    be = get_backend(backend)
    B, V, extra, idx = case
    logits, bitmask = make_inputs(B, V, dtype, seed=B * 7 + V, extra_words=extra)
    indices = None if idx is None else torch.tensor(idx, dtype=index_dtype)
    out = run_op(be, logits, bitmask, indices)
    ref = expected(logits, bitmask, indices)
    assert_same_bits(out, ref, f"{backend} {case}")
    # the case really masks and really keeps (else the comparison is weak)
    rows = range(B) if idx is None else idx
    if rows and V > 32:
        assert torch.isneginf(out[list(rows)]).any() and torch.isfinite(out[list(rows)]).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("indices", [None, [3, 0]])
def test_agrees_with_xgrammar(dtype, indices):
    """xgrammar's CPU implementation, the producer of the layout, is the outside oracle."""
    xgr = pytest.importorskip("xgrammar")
    logits, bitmask = make_inputs(5, 1003, dtype, seed=11)
    ours = logits.clone()
    torch.ops.fastinfer.apply_token_bitmask(ours, bitmask, None if indices is None else torch.tensor(indices))
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=indices)
    assert_same_bits(ours, theirs, f"xgrammar {dtype} indices={indices}")
    assert torch.isneginf(ours).any()


def test_agrees_with_a_grammar_matcher():
    """A real grammar's mask: after the op, exactly the tokens xgrammar's matcher accepts are finite."""
    xgr = pytest.importorskip("xgrammar")
    vocab = ["<eos>", "a", "b", "ab", "ba", "c", "aa", "bb", "abc", "x"] + [f"t{i}" for i in range(40)]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[0])
    compiled = xgr.GrammarCompiler(info).compile_grammar('root ::= ("a" | "b")+ "c"')
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    logits = torch.randn(1, len(vocab), generator=make_gen(3))
    torch.ops.fastinfer.apply_token_bitmask(logits, mask)
    allowed = {vocab[t] for t in torch.isfinite(logits[0]).nonzero().flatten().tolist()}
    assert allowed == {"a", "b", "ab", "ba", "aa", "bb", "abc"}
    assert matcher.accept_token(vocab.index("ab"))
    matcher.fill_next_token_bitmask(mask)
    logits = torch.randn(1, len(vocab), generator=make_gen(4))
    torch.ops.fastinfer.apply_token_bitmask(logits, mask)
    allowed = {vocab[t] for t in torch.isfinite(logits[0]).nonzero().flatten().tolist()}
    assert allowed == {"a", "b", "ab", "ba", "aa", "bb", "c", "abc"}


def test_pack_unpack_roundtrip():
    g = make_gen(5)
    allowed = torch.rand(3, 70, generator=g) < 0.5
    packed = RS.pack_token_bitmask(allowed)
    assert packed.dtype == torch.int32 and packed.shape == (3, 3)
    assert torch.equal(RS.unpack_token_bitmask(packed, 70), allowed)
    # bit j of word i is token 32 i + j; bit 31 is the sign bit
    one = RS.pack_token_bitmask(torch.tensor([[False] * 31 + [True] + [False, True]]))
    assert one.tolist() == [[-2 ** 31, 2]]


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("indices", [None, [2, 0]])
def test_apply_token_bitmask_opcheck(ns, indices):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    logits, bitmask = make_inputs(3, 70, torch.bfloat16, seed=2)
    logits = torch.nan_to_num(logits)
    idx = None if indices is None else torch.tensor(indices, dtype=torch.int32)
    torch.library.opcheck(getattr(torch.ops, ns).apply_token_bitmask.default, (logits, bitmask, idx))


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("B,V,idx", [(0, 40, None), (3, 0, None), (3, 40, [])])
def test_empty(ns, B, V, idx):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    logits = torch.randn(B, V)
    before = logits.clone()
    bitmask = torch.zeros(B, (V + 31) // 32, dtype=torch.int32)
    getattr(torch.ops, ns).apply_token_bitmask(logits, bitmask, None if idx is None else torch.tensor(idx, dtype=torch.int64))
    assert torch.equal(logits, before)


# ---------------------------------------------------------------------------------------------
# bad input: a RuntimeError naming the argument, never a crash
def _args(**over):
    logits, bitmask = make_inputs(3, 70, torch.float32, seed=1)
    a = dict(logits=logits, bitmask=bitmask, indices=None)
    a.update(over)
    return a


BAD = [
    ("logits-dtype", lambda: _args(logits=torch.randn(3, 70, dtype=torch.float64)), "logits must"),
    ("logits-1d", lambda: _args(logits=torch.randn(70)), "logits must be 2-D"),
    ("logits-noncontig", lambda: _args(logits=torch.randn(70, 3).t()), "logits must be contiguous"),
    ("bitmask-dtype", lambda: _args(bitmask=torch.zeros(3, 3, dtype=torch.int64)), "bitmask must be int32"),
    ("bitmask-1d", lambda: _args(bitmask=torch.zeros(3, dtype=torch.int32)), "bitmask must be 2-D"),
    ("bitmask-batch", lambda: _args(bitmask=torch.zeros(2, 3, dtype=torch.int32)), "bitmask must have batch = 3"),
    ("bitmask-too-narrow", lambda: _args(bitmask=torch.zeros(3, 2, dtype=torch.int32)), "at least ceil"),
    ("bitmask-noncontig", lambda: _args(bitmask=torch.zeros(6, 3, dtype=torch.int32)[::2]), "bitmask must be contiguous"),
    ("indices-dtype", lambda: _args(indices=torch.tensor([0.0, 1.0])), "indices must"),
    ("indices-2d", lambda: _args(indices=torch.zeros(1, 2, dtype=torch.int64)), "indices must be 1-D"),
    ("indices-range", lambda: _args(indices=torch.tensor([0, 3])), "indices values must be in"),
    ("indices-negative", lambda: _args(indices=torch.tensor([-1])), "indices values must be in"),
    ("indices-noncontig", lambda: _args(indices=torch.tensor([0, 9, 1, 9])[::2]), "indices must be contiguous"),
]


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("case,make,msg", BAD, ids=[b[0] for b in BAD])
def test_apply_token_bitmask_bad_input(ns, case, make, msg):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    a = make()
    with pytest.raises(RuntimeError, match=msg) as exc:
        getattr(torch.ops, ns).apply_token_bitmask(*a.values())
    assert f"{ns}.apply_token_bitmask:" in str(exc.value)


def test_device_mismatch_is_refused():
    a = _args(bitmask=_args()["bitmask"].to("meta"))
    with pytest.raises(RuntimeError, match="bitmask must be on the device of logits"):
        torch.ops.fastinfer.apply_token_bitmask(*a.values())


def test_python_wrapper():
    import fastinfer.ops as ops

    logits, bitmask = make_inputs(4, 100, torch.float32, seed=8)
    x = logits.clone()
    assert ops.apply_token_bitmask(x, bitmask, [3, 1]) is x
    assert_same_bits(x, expected(logits, bitmask, torch.tensor([3, 1])), "wrapper")
    be = ops.Backend("fastinfer")
    y = logits.clone()
    be.apply_token_bitmask(y, bitmask)
    assert_same_bits(y, expected(logits, bitmask, None), "backend")
