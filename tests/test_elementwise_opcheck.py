"""``torch.library.opcheck`` for every op (CPU impls and the sim namespace), the Python wrappers in
``fastinfer.ops``, and one ``torch.compile(fullgraph=True)`` chain of all five ops.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_bits_equal, get_backend, make_gen, poison_

BF = torch.bfloat16


def _inputs(dtype, gen, fp8=False, t=5, hq=4, hkv=2, d=64, h=96, f=48, nb=3, bs=8, maxp=40):
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    qkv = r(t, (hq + 2 * hkv) * d)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    cdt = torch.float8_e4m3fn if fp8 else dtype
    kc = poison_(torch.empty(nb, bs, hkv, d, dtype=cdt))
    vc = poison_(torch.empty(nb, bs, hkv, d, dtype=cdt))
    slots = torch.tensor([3, -1, 0, 17, 9][:t], dtype=torch.int64)
    return dict(
        x=r(t, h), res=r(t, h), w=(torch.rand(h, generator=gen) + 0.5).to(dtype), gu=r(t, 2 * f),
        out_h=torch.empty(t, h, dtype=dtype), out_f=torch.empty(t, f, dtype=dtype),
        pos=torch.randint(0, maxp, (t,), generator=gen, dtype=torch.int32),
        q=q, k=k, v=v, qkv=qkv,
        cache=torch.rand(maxp, d, generator=gen),
        cache_partial=torch.rand(maxp, d // 2, generator=gen).to(dtype),
        kc=kc, vc=vc, slots=slots,
        ks=torch.tensor([0.02]) if fp8 else None, vs=torch.tensor([0.03]) if fp8 else None,
    )


def _op_cases(dtype):
    g = make_gen(7)
    a = _inputs(dtype, g)
    b = _inputs(dtype, g, fp8=True)
    return [
        ("rms_norm", (a["x"], a["w"], 1e-6)),
        ("rms_norm_out", (a["out_h"], a["x"], a["w"], 1e-6)),
        ("fused_add_rms_norm", (a["x"].clone(), a["res"].clone(), a["w"], 1e-6)),
        ("rms_norm", (a["x"], None, 1e-6)),
        ("fused_add_rms_norm", (a["x"].clone(), a["res"].clone(), None, 1e-6)),
        ("rms_norm", (a["x"], a["w"], 1e-6, 1.0)),
        ("fused_add_rms_norm", (a["x"].clone(), a["res"].clone(), a["w"], 1e-6, 1.0)),
        ("gated_rms_norm", (a["x"], a["res"], a["w"], 1e-6)),
        ("gated_rms_norm", (a["x"], a["res"], None, 1e-6)),
        ("gated_rms_norm", (a["x"], a["res"], a["w"], 1e-6, 1.0)),
        ("silu_and_mul", (a["gu"],)),
        ("silu_and_mul_out", (a["out_f"], a["gu"])),
        ("gelu_and_mul", (a["gu"],)),
        ("gelu_and_mul_out", (a["out_f"], a["gu"])),
        ("activation", (a["x"], "gelu_new")),
        ("activation", (a["x"], "gelu_fast")),
        ("activation_out", (a["out_h"], a["x"], "quick_gelu")),
        ("gelu_tanh_and_mul", (a["gu"],)),
        ("gelu_tanh_and_mul_out", (a["out_f"], a["gu"])),
        ("rotary_embedding", (a["pos"], a["q"], a["k"], a["cache"], True)),
        ("rotary_embedding", (a["pos"].long(), a["q"], a["k"], a["cache_partial"], False)),
        ("reshape_and_cache", (a["k"], a["v"], a["kc"], a["vc"], a["slots"], None, None)),
        ("reshape_and_cache", (b["k"], b["v"], b["kc"], b["vc"], b["slots"].int(), b["ks"], b["vs"])),
    ]


OPCHECK_PARAMS = [
    pytest.param("cpu", torch.float32, id="cpu-float32"),
    pytest.param("cpu", BF, id="cpu-bfloat16"),
    pytest.param("sim", torch.float16, id="sim-float16", marks=pytest.mark.sim),
    pytest.param("cuda", BF, id="cuda-bfloat16", marks=pytest.mark.cuda),
]


_CASE_NAMES = [c[0] for c in _op_cases(BF)]
_CASE_IDS = [n + (f"_{_CASE_NAMES[:i].count(n) + 1}" if n in _CASE_NAMES[:i] else "") for i, n in enumerate(_CASE_NAMES)]


@pytest.mark.parametrize("bname,dtype", OPCHECK_PARAMS)
@pytest.mark.parametrize("idx", range(len(_CASE_NAMES)), ids=_CASE_IDS)
def test_opcheck(bname, dtype, idx):
    be = get_backend(bname)
    name, args = _op_cases(dtype)[idx]
    args = tuple(a.to(be.device) if isinstance(a, torch.Tensor) else a for a in args)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args):
        # opcheck's test_schema compares values with arithmetic that has no fp8 kernels on CPU
        utils = utils[1:]
    torch.library.opcheck(getattr(be.ns, name).default, args, test_utils=utils)


def test_wrappers_match_ops():
    """``fastinfer.ops`` wrappers call the registered ops (and the _out variants when out= is given)."""
    import fastinfer.ops as fo

    get_backend("cpu")
    ops = torch.ops.fastinfer
    a = _inputs(torch.float32, make_gen(8))
    assert torch.equal(fo.rms_norm(a["x"], a["w"], 1e-5), ops.rms_norm(a["x"], a["w"], 1e-5))
    out = poison_(torch.empty_like(a["x"]))
    assert fo.rms_norm(a["x"], a["w"], 1e-5, out=out) is out
    assert torch.equal(out, ops.rms_norm(a["x"], a["w"], 1e-5))
    assert torch.equal(fo.silu_and_mul(a["gu"]), ops.silu_and_mul(a["gu"]))
    out = poison_(torch.empty_like(a["out_f"]))
    assert fo.silu_and_mul(a["gu"], out=out) is out
    assert torch.equal(out, ops.silu_and_mul(a["gu"]))
    assert torch.equal(fo.gelu_and_mul(a["gu"]), ops.gelu_and_mul(a["gu"]))
    out = poison_(torch.empty_like(a["out_f"]))
    assert fo.gelu_and_mul(a["gu"], out=out) is out and torch.equal(out, ops.gelu_and_mul(a["gu"]))
    assert torch.equal(fo.activation(a["x"], "quick_gelu"), ops.activation(a["x"], "quick_gelu"))
    out = poison_(torch.empty_like(a["x"]))
    assert fo.activation(a["x"], "gelu_new", out=out) is out and torch.equal(out, ops.activation(a["x"], "gelu_new"))
    assert torch.equal(fo.gelu_tanh_and_mul(a["gu"]), ops.gelu_tanh_and_mul(a["gu"]))
    out = poison_(torch.empty_like(a["out_f"]))
    assert fo.gelu_tanh_and_mul(a["gu"], out=out) is out
    assert torch.equal(out, ops.gelu_tanh_and_mul(a["gu"]))
    x, res = a["x"].clone(), a["res"].clone()
    x2, res2 = a["x"].clone(), a["res"].clone()
    rx, rr = fo.fused_add_rms_norm(x, res, a["w"])
    ops.fused_add_rms_norm(x2, res2, a["w"], 1e-6)
    assert rx is x and rr is res and torch.equal(x, x2) and torch.equal(res, res2)
    q, k = a["q"].clone(), a["k"].clone()
    q2, k2 = a["q"].clone(), a["k"].clone()
    rq, rk = fo.rotary_embedding(a["pos"], q, k, a["cache"])
    ops.rotary_embedding(a["pos"], q2, k2, a["cache"], True)
    assert rq is q and rk is k and torch.equal(q, q2) and torch.equal(k, k2)
    kc, vc = a["kc"].clone(), a["vc"].clone()
    assert fo.reshape_and_cache(a["k"], a["v"], kc, vc, a["slots"]) is None
    ref_k = a["kc"].clone()
    ops.reshape_and_cache(a["k"], a["v"], ref_k, a["vc"].clone(), a["slots"], None, None)
    assert_bits_equal(kc, ref_k, "k_cache")


def _layer(x, residual, w, qkv, positions, cos_sin, k_cache, v_cache, slots, gate_up, hq, hkv, d):
    import fastinfer.ops as fo

    t = x.shape[0]
    h = fo.rms_norm(x, w, 1e-5)
    h2 = h * 1.5  # plain torch op in between: the ops must compose with the rest of the graph
    fo.fused_add_rms_norm(h2, residual, w, 1e-5)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    fo.rotary_embedding(positions, q, k, cos_sin, True)
    fo.reshape_and_cache(k, v, k_cache, v_cache, slots)
    a = fo.silu_and_mul(gate_up)
    return h2, residual, qkv, k_cache, v_cache, a


@pytest.mark.compile
def test_compile_fullgraph_chain():
    get_backend("cpu")
    torch._dynamo.reset()
    a = _inputs(torch.float32, make_gen(9))
    hq, hkv, d = 4, 2, 64

    def args():
        return (a["x"].clone(), a["res"].clone(), a["w"], a["qkv"].clone(), a["pos"], a["cache"],
                a["kc"].clone(), a["vc"].clone(), a["slots"], a["gu"], hq, hkv, d)

    eager_args, comp_args = args(), args()
    eager = _layer(*eager_args)
    compiled = torch.compile(_layer, fullgraph=True, backend="aot_eager")
    got = compiled(*comp_args)
    for i, (e, g) in enumerate(zip(eager, got)):
        assert_bits_equal(g, e, f"output {i}")
    # in-place effects on the caller's tensors are the same too
    for i in (1, 3, 6, 7):
        assert_bits_equal(comp_args[i], eager_args[i], f"mutated arg {i}")
