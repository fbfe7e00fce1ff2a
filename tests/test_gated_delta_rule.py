"""gated_delta_rule (Gated DeltaNet's recurrence, with a state pool) against its fp64 oracle, and the
oracle against the definition the models run: transformers' Qwen3.5 ``torch_chunk_gated_delta_rule``
and ``torch_recurrent_gated_delta_rule`` evaluated in float64. CPU impl (per-token and chunked
paths) and the CUDA kernel in the simt emulator (two schedule seeds, bit-identical) on small odd
shapes; the deterministic mode's bitwise equality of one prefill, prefill in chunks and decode.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from conftest import assert_fa_close, backend_params, get_backend, make_gen, poison_, randn, raw_bits
import fastinfer.reference.linear_attention as RL


def _seqs(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def _inputs(Hk, Hv, Dk, Dv, lens, initial, dtype, gen, l2norm=True, beta_fp32=True, row_pad=0, num_slots=None):
    """q, k, v (column slices of a fused [T, (2 Hk Dk + Hv Dv) + row_pad] buffer when row_pad > 0),
    g (a model-like log decay), beta, cu_seqlens, a state pool whose slots outside the batch, and
    those of sequences without an initial state, are poisoned (never read: a NaN would show),
    slots, has_initial_state. Without l2norm, k is scaled to norm ~1 (the delta rule's stable range)."""
    T, B = sum(lens), len(lens)
    kd, vd = Hk * Dk, Hv * Dv
    fused = randn((T, 2 * kd + vd + row_pad), torch.float32, gen=gen)
    if not l2norm:
        fused[:, kd:2 * kd] *= Dk ** -0.5
    fused = fused.to(dtype)
    q = fused[:, :kd].unflatten(1, (Hk, Dk))
    k = fused[:, kd:2 * kd].unflatten(1, (Hk, Dk))
    v = fused[:, 2 * kd:2 * kd + vd].unflatten(1, (Hv, Dv))
    if not row_pad:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    a = randn((T, Hv), torch.float32, gen=gen)
    A_log = torch.rand(Hv, generator=gen) * 2 - 1
    g = -A_log.exp() * torch.nn.functional.softplus(a + 0.5)
    beta = torch.sigmoid(randn((T, Hv), torch.float32, gen=gen))
    if not beta_fp32:
        beta = beta.to(dtype)
    num_slots = num_slots or 2 * B + 2
    slots = torch.tensor([2 * b + 1 for b in range(B)], dtype=torch.int32)
    states = poison_(torch.empty(num_slots, Hv, Dk, Dv, dtype=torch.float32))
    has = None if initial is None else torch.tensor(initial, dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        if initial is None or initial[i]:
            states[s] = randn((Hv, Dk, Dv), torch.float32, gen=gen, scale=0.5)
    return q, k, v, g, beta, _seqs(lens), states, slots, has


def _naive(q, k, v, g, beta, cu, states, slots, has, l2norm):
    """The recurrence in q's dtype with torch ops (FlashAttention's same-precision baseline)."""
    dt = q.dtype
    Hk, Dk, Hv = q.shape[1], q.shape[2], v.shape[1]
    q, k = (x.repeat_interleave(Hv // Hk, dim=1) for x in (q, k))
    if l2norm:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * Dk ** -0.5
    g, beta = g.to(dt), beta.to(dt)
    o = torch.empty(v.shape, dtype=dt)
    for i, slot in enumerate(slots.tolist()):
        S = states[slot].to(dt) if has is None or bool(has[i]) else torch.zeros(states.shape[1:], dtype=dt)
        for t in range(int(cu[i]), int(cu[i + 1])):
            S = S * g[t].exp()[:, None, None]
            u = beta[t][:, None] * (v[t] - (S * k[t][:, :, None]).sum(1))
            S = S + k[t][:, :, None] * u[:, None, :]
            o[t] = (S * q[t][:, :, None]).sum(1)
    return o


def _call(be, q, k, v, g, beta, cu, states, slots, has, l2norm, history=None, deterministic=False):
    dev = be.device
    return be.ns.gated_delta_rule(q.to(dev), k.to(dev), v.to(dev), g.to(dev), beta.to(dev), cu.to(dev), states,
                                  slots.to(dev), None if has is None else has.to(dev), None, l2norm,
                                  history, deterministic)


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


# (Hk, Hv, Dk, Dv, lens, has_initial_state or None (decode), l2norm, beta_fp32, history, row_pad)
GDN_CASES = [
    (1, 2, 64, 64, [5, 1, 0, 3], [False, True, True, False], True, True, False, 0),  # prefill: new, continued, empty
    (2, 2, 64, 128, [1, 1, 1], None, False, False, False, 0),                          # decode, beta in q's dtype
    (1, 2, 128, 64, [3, 4], None, True, True, True, 24),                               # verification: history, fused view
    (2, 4, 64, 64, [70, 9, 131], [True, False, False], True, True, False, 0),          # CPU: the chunked path (> 64)
    (1, 1, 128, 128, [67], [True], False, True, False, 16),                           # chunked, no l2norm, fused view
]


@pytest.mark.parametrize(
    "backend,dtype,Hk,Hv,Dk,Dv,lens,initial,l2norm,beta_fp32,history,row_pad",
    backend_params({"cpu": GDN_CASES, "sim": GDN_CASES, "cuda": GDN_CASES},
                   {"sim": (torch.float32, torch.float16, torch.bfloat16),
                    "cuda": (torch.float32, torch.float16, torch.bfloat16)}),
)
def test_gated_delta_rule_vs_reference(backend, dtype, Hk, Hv, Dk, Dv, lens, initial, l2norm, beta_fp32, history,
                                       row_pad):
    be = get_backend(backend)
    gen = make_gen(200 + Hk + Hv + Dk + sum(lens))
    q, k, v, g, beta, cu, states, slots, has = _inputs(Hk, Hv, Dk, Dv, lens, initial, dtype, gen, l2norm, beta_fp32,
                                                       row_pad)
    want, want_states, want_hist = RL.gated_delta_rule(q, k, v, g, beta, cu, states, slots, has, None, l2norm)
    dev, T = be.device, q.shape[0]

    def run():
        s = states.clone().to(dev)
        h = poison_(torch.empty(T, Hv, Dk, Dv, device=dev)) if history else None
        out = _call(be, q, k, v, g, beta, cu, s, slots, has, l2norm, h)
        return (out, s) + ((h,) if history else ())

    got = be.run(run)
    out, new_states = got[0], got[1].cpu()
    assert out.dtype == dtype and out.shape == (T, Hv, Dv)
    assert_fa_close(out, want, _naive(q, k, v, g, beta, cu, states, slots, has, l2norm), floor=1e-5)
    batch = torch.zeros(states.shape[0], dtype=torch.bool)
    batch[slots.long()] = True
    # fp32 states: the rounding of fp32 arithmetic over the tokens, whatever q's dtype
    assert _rel(new_states[batch], want_states[batch]) < 2e-5
    assert torch.equal(raw_bits(new_states[~batch]), raw_bits(states[~batch]))
    if history:
        assert _rel(got[2], want_hist) < 2e-5
        last = cu[1:].long() - 1
        assert torch.equal(got[2].cpu()[last[0]], new_states[slots[0]])


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
def test_explicit_scale_int64_slots(backend):
    """An explicit scale, int64 state_indices and Hv = 4 Hk (value heads 0..3 read key head 0)."""
    be = get_backend(backend)
    gen = make_gen(41)
    q, k, v, g, beta, cu, states, slots, has = _inputs(1, 4, 64, 64, [4, 2], None, torch.bfloat16, gen)
    slots = slots.long()
    want, want_states, _ = RL.gated_delta_rule(q, k, v, g, beta, cu, states, slots, has, 0.3, True)
    dev = be.device

    def run():
        s = states.clone().to(dev)
        out = be.ns.gated_delta_rule(q.to(dev), k.to(dev), v.to(dev), g.to(dev), beta.to(dev), cu.to(dev), s,
                                     slots.to(dev), None, 0.3, True, None, False)
        return out, s

    out, new_states = be.run(run)
    assert _rel(out, want) < 1e-2 and _rel(new_states.cpu()[slots], want_states[slots]) < 2e-5
    default, _, _ = RL.gated_delta_rule(q, k, v, g, beta, cu, states, slots, has, None, True)
    assert _rel(out, default) > 0.5  # the scale was applied (default 1/8)


def _in_float64(fn):
    """transformers' function with its fp32 casts made fp64 (``torch.float32`` looked up in its
    globals), so that the definition itself, not its fp32 rounding, is compared."""
    fn = inspect.unwrap(fn)

    class Torch64:
        def __getattr__(self, name):
            return torch.float64 if name == "float32" else getattr(torch, name)

    glb = dict(fn.__globals__, torch=Torch64())
    f = types.FunctionType(fn.__code__, glb, fn.__name__, fn.__defaults__, fn.__closure__)
    f.__kwdefaults__ = fn.__kwdefaults__
    return f


@pytest.mark.parametrize("l2norm", [False, True])
def test_reference_is_transformers(l2norm):
    """The oracle against transformers' Qwen3.5 chunked and recurrent functions in float64: two
    sequences of a varlen batch (70 tokens: two of transformers' 64-token chunks, and 5), Hv = 2 Hk,
    one from an initial state, one from zeros; outputs, final states, and the history's last row."""
    q35 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    chunk, recurrent = _in_float64(q35.torch_chunk_gated_delta_rule), _in_float64(q35.torch_recurrent_gated_delta_rule)
    gen = make_gen(11)
    Hk, Hv, Dk, Dv, lens = 2, 4, 8, 12, [70, 5]
    T = sum(lens)
    q = randn((T, Hk, Dk), torch.float64, gen=gen)
    k = randn((T, Hk, Dk), torch.float64, gen=gen, scale=Dk ** -0.5)
    v = randn((T, Hv, Dv), torch.float64, gen=gen)
    g = -torch.rand(T, Hv, generator=gen, dtype=torch.float64)
    beta = torch.rand(T, Hv, generator=gen, dtype=torch.float64)
    states = randn((3, Hv, Dk, Dv), torch.float64, gen=gen)
    slots, has = torch.tensor([2, 0]), torch.tensor([True, False])
    o, new_states, hist = RL.gated_delta_rule(q, k, v, g, beta, _seqs(lens), states, slots, has, None, l2norm)
    a = 0
    for b, n in enumerate(lens):
        rows = slice(a, a + n)
        init = states[slots[b]][None] if has[b] else None
        for fn in (chunk, recurrent):
            their_o, their_s = fn(q[None, rows], k[None, rows], v[None, rows], g[None, rows], beta[None, rows],
                                  initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
            assert their_o.dtype == torch.float64
            torch.testing.assert_close(o[rows], their_o[0], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(new_states[slots[b]], their_s[0], rtol=1e-12, atol=1e-12)
        assert torch.equal(hist[a + n - 1], new_states[slots[b]])
        a += n
    assert torch.equal(new_states[1], states[1])


def test_chunked_error_does_not_grow():
    """The CPU chunked path (default mode, one 4096-token sequence) against the oracle: its relative
    error at 4096 tokens is no worse than at 512 (the chunk-to-chunk state carry does not
    accumulate error), and it is the chunked path (its bits differ from the per-token order's)."""
    be = get_backend("cpu")
    gen = make_gen(21)
    errs = {}
    for T in (512, 4096):
        q, k, v, g, beta, cu, states, slots, has = _inputs(1, 1, 64, 64, [T], [False], torch.float32, gen)
        want, want_states, _ = RL.gated_delta_rule(q, k, v, g, beta, cu, states, slots, has, None, True)
        s1, s2 = states.clone(), states.clone()
        chunked = _call(be, q, k, v, g, beta, cu, s1, slots, has, True)
        per_token = _call(be, q, k, v, g, beta, cu, s2, slots, has, True, deterministic=True)
        assert not torch.equal(chunked, per_token)
        errs[T] = (_rel(chunked, want), _rel(s1[slots], want_states[slots]), _rel(per_token, want))
    for T, (e_out, e_state, e_tok) in errs.items():
        assert e_out < 1e-5 and e_state < 1e-5, (T, errs)
        assert e_out < 10 * e_tok, (T, errs)
    assert errs[4096][0] < 2 * errs[512][0] + 1e-7, errs
    assert errs[4096][1] < 2 * errs[512][1] + 1e-7, errs


def _prefill_chunked_decode(be, dtype, deterministic, lens_split):
    """One sequence run as one prefill, as prefill chunks (each from the state the last left), and
    as a prefill then one-token decodes: (outputs, states) of each."""
    dev = be.device
    gen = make_gen(31)
    T = sum(lens_split)
    q, k, v, g, beta, cu, states, _, _ = _inputs(1, 2, 64, 64, [T], [False], dtype, gen)
    slot = torch.tensor([1], dtype=torch.int32)

    def run_pieces(pieces):
        s = torch.zeros(3, 2, 64, 64, device=dev)
        outs, a = [], 0
        for i, n in enumerate(pieces):
            r = slice(a, a + n)
            outs.append(_call(be, q[r], k[r], v[r], g[r], beta[r], _seqs([n]), s, slot, torch.tensor([i > 0]), True,
                              deterministic=deterministic))
            a += n
        return torch.cat(outs), s

    def run():
        whole = run_pieces([T])
        chunked = run_pieces(lens_split)
        stepped = run_pieces([lens_split[0]] + [1] * (T - lens_split[0]))
        return whole + chunked + stepped

    return be.run(run)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
def test_deterministic_prefill_chunks_decode_bitwise(backend):
    """deterministic=True: one prefill (longer than a CPU chunk on the CPU), prefill in pieces and
    token-by-token decode give the same bits, outputs and states."""
    be = get_backend(backend)
    wo, ws, co, cs, so, ss = _prefill_chunked_decode(be, torch.bfloat16, True, [70, 33, 27])
    assert torch.equal(raw_bits(wo), raw_bits(co)) and torch.equal(raw_bits(wo), raw_bits(so))
    assert torch.equal(ws, cs) and torch.equal(ws, ss)


def test_default_mode_prefill_chunks_agree():
    """Default mode on the CPU: the 130-token prefill (chunked form) against the same tokens as
    pieces and as decode steps (the per-token order for short pieces): equal to rounding."""
    be = get_backend("cpu")
    wo, ws, co, cs, so, ss = _prefill_chunked_decode(be, torch.float32, False, [70, 33, 27])
    assert not torch.equal(wo, so)
    for o, s in ((co, cs), (so, ss)):
        assert _rel(o, wo) < 1e-5 and _rel(s, ws) < 1e-5


# ---- the op's contract: opcheck, bad input ------------------------------------------------------


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
def test_gated_delta_rule_opcheck(ns):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    gen = make_gen(3)
    q, k, v, g, beta, cu, states, slots, has = _inputs(1, 2, 64, 64, [3, 2], [True, False], torch.bfloat16, gen)
    states = torch.nan_to_num(states)  # opcheck compares the mutated pool, NaN != NaN
    history = torch.zeros(5, 2, 64, 64)
    torch.library.opcheck(getattr(torch.ops, ns).gated_delta_rule.default,
                          (q, k, v, g, beta, cu, states, slots, has, None, True, history, False))


def _args(**over):
    gen = make_gen(9)
    q, k, v, g, beta, cu, states, slots, has = _inputs(1, 2, 64, 64, [3, 2], [True, False], torch.float32, gen)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu, states=torch.nan_to_num(states), state_indices=slots,
                has_initial_state=has, scale=None, use_qk_l2norm=True, state_history=None, deterministic=False)
    args.update(over)
    return args


BAD = [
    ("q_dtype", lambda a: dict(q=a["q"].to(torch.int32)), r"q must have dtype in"),
    ("k_dtype", lambda a: dict(k=a["k"].half()), r"k must have the dtype of q"),
    ("k_shape", lambda a: dict(k=a["k"][:4]), r"k must have the shape of q"),
    ("v_rows", lambda a: dict(v=a["v"][:4]), r"v must have num_tokens = 5"),
    ("heads", lambda a: dict(q=torch.ones(5, 3, 64), k=torch.ones(5, 3, 64)), r"must be a multiple of num_k_heads"),
    ("dk", lambda a: dict(q=torch.ones(5, 1, 32), k=torch.ones(5, 1, 32)), r"head_dim_k must be 64 or 128, got 32"),
    ("dv", lambda a: dict(v=torch.ones(5, 2, 96)), r"head_dim_v must be 64 or 128, got 96"),
    ("g_dtype", lambda a: dict(g=a["g"].half()), r"g must be float32"),
    ("g_shape", lambda a: dict(g=a["g"][:, :1]), r"g must have shape \[5, 2\]"),
    ("beta_dtype", lambda a: dict(beta=a["beta"].half()), r"beta must be float32 or the dtype of q"),
    ("states_dtype", lambda a: dict(states=a["states"].half()), r"states must be float32"),
    ("states_shape", lambda a: dict(states=torch.zeros(6, 2, 64, 128)), r"states must have shape \[num_slots, 2, 64, 64\]"),
    ("slots_count", lambda a: dict(state_indices=torch.tensor([0], dtype=torch.int32)), r"state_indices must have batch = 2"),
    ("slots_range", lambda a: dict(state_indices=torch.tensor([0, 6], dtype=torch.int32)),
     r"state_indices values must be in \[0, 6\)"),
    ("slots_distinct", lambda a: dict(state_indices=torch.tensor([1, 1], dtype=torch.int32)), r"must be distinct"),
    ("slots_dtype", lambda a: dict(state_indices=a["state_indices"].float()), r"state_indices must have dtype in"),
    ("cu_dtype", lambda a: dict(cu_seqlens=a["cu_seqlens"].long()), r"cu_seqlens must be int32"),
    ("cu_end", lambda a: dict(cu_seqlens=torch.tensor([0, 3, 4], dtype=torch.int32)), r"cu_seqlens must start at 0 and end"),
    ("has_dtype", lambda a: dict(has_initial_state=torch.tensor([1, 0], dtype=torch.int32)), r"has_initial_state must be bool"),
    ("history_shape", lambda a: dict(state_history=torch.zeros(4, 2, 64, 64)), r"state_history must have shape \[5, 2, 64, 64\]"),
    ("history_dtype", lambda a: dict(state_history=torch.zeros(5, 2, 64, 64, dtype=torch.half)),
     r"state_history must be float32"),
    ("scale_nan", lambda a: dict(scale=float("nan")), r"scale must be finite and > 0"),
    ("scale_zero", lambda a: dict(scale=0.0), r"scale must be finite and > 0"),
    ("q_strided_dims", lambda a: dict(q=torch.ones(5, 1, 128)[:, :, ::2]), r"q must have contiguous heads"),
    ("states_noncontig", lambda a: dict(states=torch.zeros(6, 2, 64, 64).transpose(2, 3)), r"states must be contiguous"),
    ("states_device", lambda a: dict(states=a["states"].to("meta")), r"states must be on the device of q"),
]


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("case,override,msg", BAD, ids=[c[0] for c in BAD])
def test_gated_delta_rule_bad_input(ns, case, override, msg):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    args = _args()
    args.update(override(args))
    with pytest.raises(RuntimeError, match=msg) as e:
        getattr(torch.ops, ns).gated_delta_rule(*args.values())
    assert f"{ns}.gated_delta_rule" in str(e.value)
