"""causal_conv1d (the short convolution of Gated DeltaNet / Mamba layers, with a state pool) against
its fp64 oracle, and the oracle against the definition the models run: transformers' Qwen3.5
``causal_conv1d_fn`` (prefill: ``F.conv1d`` with padding ``W - 1``) and ``causal_conv1d_update``
(decode: the state concatenated in front of the new tokens). CPU impl and the CUDA kernels in the
simt emulator (two schedule seeds, bit-identical) on small odd shapes; the new states are copies of
inputs, so they must equal the oracle's exactly.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_fa_close, backend_params, get_backend, make_gen, poison_, randn, raw_bits
import fastinfer.reference.linear_attention as RL


def _seqs(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def _inputs(D, W, lens, initial, bias, dtype, gen, slots=None, num_slots=None, row_pad=0):
    """x [T, D] (a column slice of a [T, D + row_pad] tensor when row_pad > 0), weight, bias,
    cu_seqlens, a state pool whose slots outside the batch, and those of sequences without an
    initial state, are poisoned (never read: a NaN would show), slots, has_initial_state."""
    T, B = sum(lens), len(lens)
    num_slots = num_slots or 2 * B + 2
    slots = torch.tensor(slots if slots is not None else [2 * b + 1 for b in range(B)], dtype=torch.int32)
    wide = randn((T, D + row_pad), dtype, gen=gen)
    x = wide[:, :D] if row_pad else wide
    weight = randn((D, W), dtype, gen=gen, scale=0.5)
    b = randn((D,), dtype, gen=gen, scale=0.3) if bias else None
    states = poison_(torch.empty(num_slots, W - 1, D, dtype=dtype))
    has = None if initial is None else torch.tensor(initial, dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        if initial is None or initial[i]:
            states[s] = randn((W - 1, D), dtype, gen=gen)
    return x, weight, b, _seqs(lens), states, slots, has


def _naive(x, weight, bias, cu, states, slots, has, activation):
    """The contract in x's dtype with torch ops (FlashAttention's same-precision baseline)."""
    D, W = weight.shape
    out = torch.empty_like(x)
    for i, slot in enumerate(slots.tolist()):
        a, e = int(cu[i]), int(cu[i + 1])
        prefix = states[slot] if has is None or bool(has[i]) else torch.zeros(W - 1, D, dtype=x.dtype)
        pad = torch.cat([prefix, x[a:e]])
        for t in range(e - a):
            acc = bias.clone() if bias is not None else torch.zeros(D, dtype=x.dtype)
            for k in range(W):
                acc = acc + weight[:, k] * pad[t + k]
            out[a + t] = torch.nn.functional.silu(acc) if activation == "silu" else acc
    return out


# (D, W, lens, has_initial_state or None (decode), bias, activation, row_pad)
CONV_CASES = [
    (40, 4, [5, 1, 0, 9], [False, True, True, False], True, "silu", 0),  # prefill: new, continued, empty
    (33, 3, [1, 1, 1], None, False, "none", 0),                          # decode, one token each
    (130, 2, [17, 2], [True, False], True, "silu", 0),                   # two channel blocks
    (24, 4, [3, 4], None, True, "silu", 8),                              # verification (k + 1 rows), strided x
    (8, 4, [2], [True], False, "silu", 0),                               # fewer rows than W - 1
    (20, 3, [9, 11, 0, 13], [False, True, False, True], True, "silu", 0),  # 16-token chunks cross sequences
]


@pytest.mark.parametrize(
    "backend,dtype,D,W,lens,initial,bias,activation,row_pad",
    backend_params({"cpu": CONV_CASES, "sim": CONV_CASES, "cuda": CONV_CASES},
                   {"sim": (torch.float32, torch.bfloat16), "cuda": (torch.float32, torch.bfloat16)}),
)
def test_causal_conv1d_vs_reference(backend, dtype, D, W, lens, initial, bias, activation, row_pad):
    be = get_backend(backend)
    gen = make_gen(100 + D + W + sum(lens))
    x, weight, b, cu, states, slots, has = _inputs(D, W, lens, initial, bias, dtype, gen, row_pad=row_pad)
    want, want_states = RL.causal_conv1d(x, weight, b, cu, states, slots, has, activation)
    dev = be.device

    def run():
        s = states.clone().to(dev)
        out = be.ns.causal_conv1d(x.to(dev), weight.to(dev), None if b is None else b.to(dev), cu.to(dev), s,
                                  slots.to(dev), None if has is None else has.to(dev), activation)
        return out, s

    out, new_states = be.run(run)
    assert out.dtype == dtype and out.shape == x.shape
    assert_fa_close(out, want, _naive(x, weight, b, cu, states, slots, has, activation), floor=1e-5)
    # the batch's slots hold copies of inputs (exact); every other slot keeps its poison bits
    new_states = new_states.cpu()
    batch = torch.zeros(states.shape[0], dtype=torch.bool)
    batch[slots.long()] = True
    assert torch.equal(raw_bits(new_states[batch]), raw_bits(want_states[batch].to(dtype)))
    assert torch.equal(raw_bits(new_states[~batch]), raw_bits(states[~batch]))


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
def test_chunks_continue_bitwise(backend):
    """A sequence run as one prefill, as two chunks (the second from the state the first left), or
    as a prefill then one-token decodes gives the same bits: the state is all that carries over."""
    be = get_backend(backend)
    dev, dtype, D, W = be.device, torch.bfloat16, 48, 4
    gen = make_gen(5)
    x = randn((12, D), dtype, gen=gen)
    weight, bias = randn((D, W), dtype, gen=gen, scale=0.5), randn((D,), dtype, gen=gen)
    slot = torch.tensor([2], dtype=torch.int32, device=dev)

    def conv(rows, states, initial):
        has = torch.tensor([initial], device=dev)
        return be.ns.causal_conv1d(rows.to(dev), weight.to(dev), bias.to(dev),
                                   _seqs([rows.shape[0]]).to(dev), states, slot, has, "silu")

    def run():
        whole_s, chunk_s, step_s = (torch.zeros(4, W - 1, D, dtype=dtype, device=dev) for _ in range(3))
        whole = conv(x, whole_s, False)
        chunked = torch.cat([conv(x[:7], chunk_s, False), conv(x[7:], chunk_s, True)])
        stepped = torch.cat([conv(x[:5], step_s, False)] + [conv(x[t:t + 1], step_s, True) for t in range(5, 12)])
        return whole, chunked, stepped, whole_s, chunk_s, step_s

    whole, chunked, stepped, whole_s, chunk_s, step_s = be.run(run)
    assert torch.equal(raw_bits(whole), raw_bits(chunked)) and torch.equal(raw_bits(whole), raw_bits(stepped))
    assert torch.equal(whole_s, chunk_s) and torch.equal(whole_s, step_s)
    assert torch.equal(whole_s[2].cpu(), x[-(W - 1):])


def test_reference_is_transformers_conv():
    """The oracle against transformers' Qwen3.5 definitions (float64): prefill as
    ``causal_conv1d_fn`` (channels-first [1, D, L]) and decode / multi-token update as
    ``causal_conv1d_update``, whose state is ``[1, D, W]`` with the oldest column unused (our state
    is its last ``W - 1`` columns, token-major)."""
    q35 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    gen = make_gen(7)
    D, W, L = 12, 4, 9
    x = randn((L, D), torch.float64, gen=gen)
    weight, bias = randn((D, W), torch.float64, gen=gen), randn((D,), torch.float64, gen=gen)
    states = torch.zeros(1, W - 1, D, dtype=torch.float64)
    slot = torch.tensor([0])
    ours, after = RL.causal_conv1d(x, weight, bias, _seqs([L]), states, slot, torch.tensor([False]), "silu")
    theirs = q35.causal_conv1d_fn.__wrapped__(x.t()[None], weight, bias, "silu") \
        if hasattr(q35.causal_conv1d_fn, "__wrapped__") else q35.causal_conv1d_fn(x.t()[None], weight, bias, "silu")
    torch.testing.assert_close(ours, theirs[0].t(), rtol=1e-12, atol=1e-12)
    assert torch.equal(after[0], x[-(W - 1):])
    for new in (1, 3):  # decode, and verification of 3 rows
        rows = randn((new, D), torch.float64, gen=gen)
        their_state = torch.cat([randn((D, 1), torch.float64, gen=gen), after[0].t()], dim=1)[None].contiguous()
        update = getattr(q35.causal_conv1d_update, "__wrapped__", q35.causal_conv1d_update)
        theirs = update(rows.t()[None].contiguous(), their_state, weight, bias, "silu")
        ours, after = RL.causal_conv1d(rows, weight, bias, _seqs([new]), after, slot, None, "silu")
        torch.testing.assert_close(ours, theirs[0].t(), rtol=1e-12, atol=1e-12)
        assert torch.equal(after[0], their_state[0, :, 1:].t())


# ---- the op's contract: opcheck, bad input ------------------------------------------------------


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
def test_causal_conv1d_opcheck(ns):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    gen = make_gen(3)
    x, weight, b, cu, states, slots, has = _inputs(16, 4, [3, 2], [True, False], True, torch.bfloat16, gen)
    states = torch.nan_to_num(states)  # opcheck compares the mutated pool, NaN != NaN
    torch.library.opcheck(getattr(torch.ops, ns).causal_conv1d.default, (x, weight, b, cu, states, slots, has, "silu"))


def _args(**over):
    gen = make_gen(9)
    x, weight, b, cu, states, slots, has = _inputs(16, 4, [3, 2], [True, False], True, torch.float32, gen)
    args = dict(x=x, weight=weight, bias=b, cu_seqlens=cu, conv_states=torch.nan_to_num(states),
                state_indices=slots, has_initial_state=has, activation="silu")
    args.update(over)
    return args


BAD = [
    ("width", lambda a: dict(weight=torch.ones(16, 5), conv_states=torch.zeros(5, 4, 16)), r"width .* must be in \[2, 4\]"),
    ("weight_rows", lambda a: dict(weight=torch.ones(8, 4)), r"weight must have dim = 16 rows"),
    ("weight_dtype", lambda a: dict(weight=a["weight"].half()), r"weight must have the dtype of x"),
    ("x_dtype", lambda a: dict(x=a["x"].to(torch.int32)), r"x must have dtype in"),
    ("bias_shape", lambda a: dict(bias=torch.ones(15)), r"bias must have dim = 16 entries"),
    ("states_shape", lambda a: dict(conv_states=torch.zeros(5, 4, 16)), r"conv_states must have shape \[num_slots, 3, 16\]"),
    ("states_dtype", lambda a: dict(conv_states=a["conv_states"].half()), r"conv_states must have the dtype of x"),
    ("slots_count", lambda a: dict(state_indices=torch.tensor([0], dtype=torch.int32)), r"state_indices must have batch = 2"),
    ("slots_range", lambda a: dict(state_indices=torch.tensor([0, 6], dtype=torch.int32)),
     r"state_indices values must be in \[0, 6\)"),
    ("slots_distinct", lambda a: dict(state_indices=torch.tensor([1, 1], dtype=torch.int32)), r"must be distinct"),
    ("slots_dtype", lambda a: dict(state_indices=a["state_indices"].float()), r"state_indices must have dtype in"),
    ("cu_dtype", lambda a: dict(cu_seqlens=a["cu_seqlens"].long()), r"cu_seqlens must be int32"),
    ("cu_end", lambda a: dict(cu_seqlens=torch.tensor([0, 3, 4], dtype=torch.int32)), r"cu_seqlens must start at 0 and end"),
    ("cu_order", lambda a: dict(cu_seqlens=torch.tensor([0, 4, 3, 5], dtype=torch.int32),
                                state_indices=torch.tensor([0, 1, 2], dtype=torch.int32),
                                has_initial_state=None), r"cu_seqlens must be non-decreasing"),
    ("has_dtype", lambda a: dict(has_initial_state=torch.tensor([1, 0], dtype=torch.int32)), r"has_initial_state must be bool"),
    ("has_count", lambda a: dict(has_initial_state=torch.tensor([True])), r"has_initial_state must have batch = 2"),
    ("activation", lambda a: dict(activation="gelu"), r"activation must be 'silu' or 'none'"),
    ("x_channels_strided", lambda a: dict(x=torch.ones(5, 32)[:, ::2]), r"x must have contiguous channels"),
    ("states_device", lambda a: dict(conv_states=a["conv_states"].to("meta")), r"conv_states must be on the device of x"),
]


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("case,override,msg", BAD, ids=[c[0] for c in BAD])
def test_causal_conv1d_bad_input(ns, case, override, msg):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    args = _args()
    args.update(override(args))
    with pytest.raises(RuntimeError, match=msg) as e:
        getattr(torch.ops, ns).causal_conv1d(*args.values())
    assert f"{ns}.causal_conv1d" in str(e.value)
