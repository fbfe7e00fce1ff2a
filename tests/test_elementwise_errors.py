"""Bad input must raise ``RuntimeError`` naming the offending argument -- never crash.

Every case is run against ``torch.ops.fastinfer`` (CPU impls) and ``torch.ops.fastinfer_sim``.
Valid dtypes for both namespaces are bf16/fp16, so the cases are built in bf16; "wrong dtype"
uses float64 / integer tensors, which no namespace accepts.

Each case is ``(op, make_args, argument_regex)``: ``make_args()`` returns the positional args.
"""

from __future__ import annotations

import pytest
import torch

from conftest import get_backend

BF, HF, F64 = torch.bfloat16, torch.float16, torch.float64
E4M3 = torch.float8_e4m3fn
T, H, F_, HQ, HKV, D, NB, BS, MAXP = 5, 64, 32, 4, 2, 64, 2, 8, 32


def r(*shape, dtype=BF, device="cpu"):
    return torch.randn(*shape).to(dtype).to(device)


def noncontig(*shape, dtype=BF):
    """A non-contiguous tensor of ``shape`` (transposed storage)."""
    return r(*reversed(shape), dtype=dtype).permute(*reversed(range(len(shape))))


def w(n=H, dtype=BF, device="cpu"):
    return (torch.rand(n) + 0.5).to(dtype).to(device)


def pos(n=T, dtype=torch.int64, hi=MAXP):
    return torch.arange(n, dtype=torch.int64).remainder(hi).to(dtype)


def cache_(rot=D, dtype=torch.float32):
    return torch.rand(MAXP, rot).to(dtype)


def qk_stride_last(h):
    """[T, h, D] view with stride(-1) == 2."""
    return r(T, h, 2 * D)[..., ::2]


def qk_stride_head(h):
    """[T, h, D] view with stride(-2) == 2*D (last dim contiguous, heads not packed)."""
    return r(T, h, 2, D)[:, :, 0, :]


def kvc(dtype=BF, hkv=HKV, d=D, nb=NB, bs=BS):
    return torch.zeros(nb, bs, hkv, d, dtype=dtype)


def slots(n=T, dtype=torch.int64, vals=None):
    s = torch.tensor(vals) if vals is not None else torch.arange(n)
    return s.to(dtype)


S1 = lambda: torch.tensor([0.5], dtype=torch.float32)  # noqa: E731

CASES = [
    # ---------------- rms_norm
    ("rms_norm", "dtype-x", lambda: (r(T, H, dtype=F64), w(dtype=F64), 1e-6), r"\bx\b"),
    ("rms_norm", "dtype-x-int", lambda: (torch.ones(T, H, dtype=torch.int32), w(), 1e-6), r"\bx\b"),
    ("rms_norm", "dtype-weight", lambda: (r(T, H), w(dtype=HF), 1e-6), r"\bweight\b"),
    ("rms_norm", "rank-x", lambda: (torch.tensor(1.0, dtype=BF), w(1), 1e-6), r"\bx\b"),
    ("rms_norm", "rank-weight", lambda: (r(T, H), w().view(1, H), 1e-6), r"\bweight\b"),
    ("rms_norm", "shape-weight", lambda: (r(T, H), w(H + 1), 1e-6), r"\bweight\b"),
    ("rms_norm", "device-weight", lambda: (r(T, H), w(device="meta"), 1e-6), r"\bweight\b|device"),
    ("rms_norm", "noncontig-x", lambda: (noncontig(T, H), w(), 1e-6), r"\bx\b"),
    ("rms_norm", "noncontig-weight", lambda: (r(T, H), r(H, 2)[:, 0], 1e-6), r"\bweight\b"),
    ("rms_norm", "eps", lambda: (r(T, H), w(), -1e-6), r"\beps\b"),
    ("rms_norm", "weightless-dtype-x", lambda: (r(T, H, dtype=F64), None, 1e-6), r"\bx\b"),
    ("rms_norm", "weightless-eps", lambda: (r(T, H), None, float("nan")), r"\beps\b"),
    ("rms_norm", "weight_offset-weightless", lambda: (r(T, H), None, 1e-6, 1.0), r"\bweight_offset\b"),
    ("rms_norm", "weight_offset-nan", lambda: (r(T, H), w(), 1e-6, float("nan")), r"\bweight_offset\b"),
    ("fused_add_rms_norm", "weight_offset-weightless", lambda: (r(T, H), r(T, H), None, 1e-6, 1.0), r"\bweight_offset\b"),
    # ---------------- gated_rms_norm
    ("gated_rms_norm", "dtype-x", lambda: (r(T, H, dtype=F64), r(T, H, dtype=F64), w(dtype=F64), 1e-6), r"\bx\b"),
    ("gated_rms_norm", "dtype-gate", lambda: (r(T, H), r(T, H, dtype=HF), w(), 1e-6), r"\bgate\b"),
    ("gated_rms_norm", "shape-gate", lambda: (r(T, H), r(T, H + 2), w(), 1e-6), r"\bgate\b"),
    ("gated_rms_norm", "rank-gate", lambda: (r(T, H), r(1, T, H), w(), 1e-6), r"\bgate\b"),
    ("gated_rms_norm", "device-gate", lambda: (r(T, H), r(T, H, device="meta"), w(), 1e-6), r"\bgate\b|device"),
    ("gated_rms_norm", "noncontig-gate", lambda: (r(T, H), noncontig(T, H), w(), 1e-6), r"\bgate\b"),
    ("gated_rms_norm", "noncontig-x", lambda: (noncontig(T, H), r(T, H), w(), 1e-6), r"\bx\b"),
    ("gated_rms_norm", "shape-weight", lambda: (r(T, H), r(T, H), w(H + 1), 1e-6), r"\bweight\b"),
    ("gated_rms_norm", "eps", lambda: (r(T, H), r(T, H), w(), -1.0), r"\beps\b"),
    ("gated_rms_norm", "weight_offset-weightless", lambda: (r(T, H), r(T, H), None, 1e-6, 1.0), r"\bweight_offset\b"),
    # ---------------- rms_norm_out
    ("rms_norm_out", "shape-out", lambda: (r(T, H + 1), r(T, H), w(), 1e-6), r"\bout\b"),
    ("rms_norm_out", "dtype-out", lambda: (r(T, H, dtype=HF), r(T, H), w(), 1e-6), r"\bout\b"),
    ("rms_norm_out", "noncontig-out", lambda: (noncontig(T, H), r(T, H), w(), 1e-6), r"\bout\b"),
    ("rms_norm_out", "dtype-x", lambda: (r(T, H, dtype=F64), r(T, H, dtype=F64), w(dtype=F64), 1e-6), r"\bx\b|\bout\b"),
    ("rms_norm_out", "eps", lambda: (r(T, H), r(T, H), w(), -1.0), r"\beps\b"),
    # ---------------- fused_add_rms_norm
    ("fused_add_rms_norm", "dtype-x", lambda: (r(T, H, dtype=F64), r(T, H, dtype=F64), w(dtype=F64), 1e-6), r"\bx\b"),
    ("fused_add_rms_norm", "dtype-residual", lambda: (r(T, H), r(T, H, dtype=HF), w(), 1e-6), r"\bresidual\b"),
    ("fused_add_rms_norm", "dtype-weight", lambda: (r(T, H), r(T, H), w(dtype=HF), 1e-6), r"\bweight\b"),
    ("fused_add_rms_norm", "shape-residual", lambda: (r(T, H), r(T + 1, H), w(), 1e-6), r"\bresidual\b"),
    ("fused_add_rms_norm", "shape-weight", lambda: (r(T, H), r(T, H), w(H - 2), 1e-6), r"\bweight\b"),
    ("fused_add_rms_norm", "rank-x", lambda: (torch.tensor(1.0, dtype=BF), torch.tensor(1.0, dtype=BF), w(1), 1e-6), r"\bx\b|\bresidual\b"),
    ("fused_add_rms_norm", "noncontig-x", lambda: (noncontig(T, H), r(T, H), w(), 1e-6), r"\bx\b"),
    ("fused_add_rms_norm", "noncontig-residual", lambda: (r(T, H), noncontig(T, H), w(), 1e-6), r"\bresidual\b"),
    ("fused_add_rms_norm", "device-residual", lambda: (r(T, H), r(T, H, device="meta"), w(), 1e-6), r"\bresidual\b|device"),
    ("fused_add_rms_norm", "eps", lambda: (r(T, H), r(T, H), w(), -0.5), r"\beps\b"),
    ("fused_add_rms_norm", "weightless-shape-residual", lambda: (r(T, H), r(T, H + 2), None, 1e-6), r"\bresidual\b"),
    # ---------------- silu_and_mul(_out)
    ("silu_and_mul", "dtype-x", lambda: (r(T, 2 * F_, dtype=F64),), r"\bx\b"),
    ("silu_and_mul", "dtype-x-int", lambda: (torch.ones(T, 2 * F_, dtype=torch.int64),), r"\bx\b"),
    ("silu_and_mul", "rank-x", lambda: (torch.tensor(1.0, dtype=BF),), r"\bx\b"),
    ("silu_and_mul", "odd-x", lambda: (r(T, 2 * F_ + 1),), r"\bx\b"),
    ("silu_and_mul", "noncontig-x", lambda: (noncontig(T, 2 * F_),), r"\bx\b"),
    ("silu_and_mul_out", "shape-out", lambda: (r(T, 2 * F_), r(T, 2 * F_)), r"\bout\b"),
    ("silu_and_mul_out", "dtype-out", lambda: (r(T, F_, dtype=HF), r(T, 2 * F_)), r"\bout\b"),
    ("silu_and_mul_out", "noncontig-out", lambda: (noncontig(T, F_), r(T, 2 * F_)), r"\bout\b"),
    ("silu_and_mul_out", "device-out", lambda: (r(T, F_, device="meta"), r(T, 2 * F_)), r"\bout\b|device"),
    ("silu_and_mul_out", "odd-x", lambda: (r(T, F_), r(T, 2 * F_ + 1)), r"\bx\b|\bout\b"),
    # ---------------- gelu_tanh_and_mul(_out): the same checks
    ("gelu_tanh_and_mul", "dtype-x", lambda: (r(T, 2 * F_, dtype=F64),), r"\bx\b"),
    ("gelu_tanh_and_mul", "rank-x", lambda: (torch.tensor(1.0, dtype=BF),), r"\bx\b"),
    ("gelu_tanh_and_mul", "odd-x", lambda: (r(T, 2 * F_ + 1),), r"\bx\b"),
    ("gelu_tanh_and_mul", "noncontig-x", lambda: (noncontig(T, 2 * F_),), r"\bx\b"),
    ("gelu_tanh_and_mul_out", "shape-out", lambda: (r(T, 2 * F_), r(T, 2 * F_)), r"\bout\b"),
    ("gelu_tanh_and_mul_out", "dtype-out", lambda: (r(T, F_, dtype=HF), r(T, 2 * F_)), r"\bout\b"),
    ("gelu_tanh_and_mul_out", "device-out", lambda: (r(T, F_, device="meta"), r(T, 2 * F_)), r"\bout\b|device"),
    # ---------------- gelu_and_mul(_out), activation(_out)
    ("gelu_and_mul", "dtype-x", lambda: (r(T, 2 * F_, dtype=F64),), r"\bx\b"),
    ("gelu_and_mul", "odd-x", lambda: (r(T, 2 * F_ + 1),), r"\bx\b"),
    ("gelu_and_mul", "noncontig-x", lambda: (noncontig(T, 2 * F_),), r"\bx\b"),
    ("gelu_and_mul_out", "shape-out", lambda: (r(T, 2 * F_), r(T, 2 * F_)), r"\bout\b"),
    ("gelu_and_mul_out", "dtype-out", lambda: (r(T, F_, dtype=HF), r(T, 2 * F_)), r"\bout\b"),
    ("activation", "unknown-activation", lambda: (r(T, H), "gelu_slow"), r"\bactivation\b.*gelu_slow"),
    ("activation", "vllm-name", lambda: (r(T, H), "gelu_quick"), r"\bactivation\b"),
    ("activation", "dtype-x", lambda: (r(T, H, dtype=F64), "gelu_new"), r"\bx\b"),
    ("activation", "noncontig-x", lambda: (noncontig(T, H), "gelu_fast"), r"\bx\b"),
    ("activation_out", "shape-out", lambda: (r(T, H + 1), r(T, H), "quick_gelu"), r"\bout\b"),
    ("activation_out", "dtype-out", lambda: (r(T, H, dtype=HF), r(T, H), "quick_gelu"), r"\bout\b"),
    ("activation_out", "noncontig-out", lambda: (noncontig(T, H), r(T, H), "gelu_new"), r"\bout\b"),
    ("activation_out", "unknown-activation", lambda: (r(T, H), r(T, H), "relu"), r"\bactivation\b"),
    # ---------------- rotary_embedding
    ("rotary_embedding", "dtype-positions", lambda: (pos().float(), r(T, HQ, D), r(T, HKV, D), cache_(), True), r"\bpositions\b"),
    ("rotary_embedding", "rank-positions", lambda: (pos().view(T, 1), r(T, HQ, D), r(T, HKV, D), cache_(), True), r"\bpositions\b"),
    ("rotary_embedding", "shape-positions", lambda: (pos(T + 1), r(T, HQ, D), r(T, HKV, D), cache_(), True), r"\bpositions\b|\bq\b"),
    ("rotary_embedding", "range-positions-hi", lambda: (pos().fill_(MAXP), r(T, HQ, D), r(T, HKV, D), cache_(), True), r"\bpositions\b"),
    ("rotary_embedding", "range-positions-neg", lambda: (pos().fill_(-1), r(T, HQ, D), r(T, HKV, D), cache_(), False), r"\bpositions\b"),
    ("rotary_embedding", "range-positions-i32", lambda: (pos(dtype=torch.int32).fill_(MAXP + 3), r(T, HQ, D), r(T, HKV, D), cache_(), True), r"\bpositions\b"),
    ("rotary_embedding", "dtype-q", lambda: (pos(), r(T, HQ, D, dtype=F64), r(T, HKV, D, dtype=F64), cache_(), True), r"\bq\b"),
    ("rotary_embedding", "dtype-k", lambda: (pos(), r(T, HQ, D), r(T, HKV, D, dtype=HF), cache_(), True), r"\bk\b"),
    ("rotary_embedding", "rank-q", lambda: (pos(), r(T, HQ * D), r(T, HKV, D), cache_(), True), r"\bq\b"),
    ("rotary_embedding", "rank-k", lambda: (pos(), r(T, HQ, D), r(T, HKV, D, 1), cache_(), True), r"\bk\b"),
    ("rotary_embedding", "shape-k-tokens", lambda: (pos(), r(T, HQ, D), r(T + 1, HKV, D), cache_(), True), r"\bk\b"),
    ("rotary_embedding", "shape-k-headdim", lambda: (pos(), r(T, HQ, D), r(T, HKV, D // 2), cache_(D // 2), True), r"\bk\b"),
    ("rotary_embedding", "stride-q-last", lambda: (pos(), qk_stride_last(HQ), r(T, HKV, D), cache_(), True), r"\bq\b"),
    ("rotary_embedding", "stride-k-head", lambda: (pos(), r(T, HQ, D), qk_stride_head(HKV), cache_(), True), r"\bk\b"),
    ("rotary_embedding", "dtype-cache", lambda: (pos(), r(T, HQ, D), r(T, HKV, D), cache_(dtype=F64), True), r"\bcos_sin_cache\b"),
    ("rotary_embedding", "dtype-cache-other-half", lambda: (pos(), r(T, HQ, D), r(T, HKV, D), cache_(dtype=HF), True), r"\bcos_sin_cache\b"),
    ("rotary_embedding", "odd-cache", lambda: (pos(), r(T, HQ, D), r(T, HKV, D), cache_(D - 1), True), r"\bcos_sin_cache\b"),
    ("rotary_embedding", "wide-cache", lambda: (pos(), r(T, HQ, D), r(T, HKV, D), cache_(D + 2), True), r"\bcos_sin_cache\b"),
    ("rotary_embedding", "rank-cache", lambda: (pos(), r(T, HQ, D), r(T, HKV, D), cache_().view(-1), True), r"\bcos_sin_cache\b"),
    ("rotary_embedding", "noncontig-cache", lambda: (pos(), r(T, HQ, D), r(T, HKV, D), torch.rand(D, MAXP).t(), True), r"\bcos_sin_cache\b"),
    ("rotary_embedding", "device-cache", lambda: (pos(), r(T, HQ, D), r(T, HKV, D), cache_().to("meta"), True), r"\bcos_sin_cache\b|device"),
    # ---------------- reshape_and_cache
    ("reshape_and_cache", "dtype-k", lambda: (r(T, HKV, D, dtype=F64), r(T, HKV, D, dtype=F64), kvc(F64), kvc(F64), slots(), None, None), r"\bk\b"),
    ("reshape_and_cache", "dtype-v", lambda: (r(T, HKV, D), r(T, HKV, D, dtype=HF), kvc(), kvc(), slots(), None, None), r"\bv\b"),
    ("reshape_and_cache", "rank-k", lambda: (r(T, HKV * D), r(T, HKV, D), kvc(), kvc(), slots(), None, None), r"\bk\b"),
    ("reshape_and_cache", "shape-v", lambda: (r(T, HKV, D), r(T, HKV + 1, D), kvc(), kvc(), slots(), None, None), r"\bv\b"),
    ("reshape_and_cache", "stride-k-last", lambda: (qk_stride_last(HKV), r(T, HKV, D), kvc(), kvc(), slots(), None, None), r"\bk\b"),
    ("reshape_and_cache", "stride-v-head", lambda: (r(T, HKV, D), qk_stride_head(HKV), kvc(), kvc(), slots(), None, None), r"\bv\b"),
    ("reshape_and_cache", "rank-k_cache", lambda: (r(T, HKV, D), r(T, HKV, D), kvc().view(NB * BS, HKV, D), kvc(), slots(), None, None), r"\bk_cache\b"),
    ("reshape_and_cache", "shape-k_cache", lambda: (r(T, HKV, D), r(T, HKV, D), kvc(hkv=HKV + 1), kvc(), slots(), None, None), r"\bk_cache\b"),
    ("reshape_and_cache", "shape-v_cache", lambda: (r(T, HKV, D), r(T, HKV, D), kvc(), kvc(bs=BS * 2), slots(), None, None), r"\bv_cache\b"),
    ("reshape_and_cache", "dtype-k_cache", lambda: (r(T, HKV, D), r(T, HKV, D), kvc(HF), kvc(), slots(), None, None), r"\bk_cache\b"),
    ("reshape_and_cache", "dtype-v_cache", lambda: (r(T, HKV, D), r(T, HKV, D), kvc(E4M3), kvc(), slots(), S1(), S1()), r"\bv_cache\b"),
    ("reshape_and_cache", "noncontig-k_cache", lambda: (r(T, HKV, D), r(T, HKV, D), kvc(nb=2 * NB)[::2], kvc(), slots(), None, None), r"\bk_cache\b"),
    ("reshape_and_cache", "dtype-slot_mapping", lambda: (r(T, HKV, D), r(T, HKV, D), kvc(), kvc(), slots().float(), None, None), r"\bslot_mapping\b"),
    ("reshape_and_cache", "shape-slot_mapping", lambda: (r(T, HKV, D), r(T, HKV, D), kvc(), kvc(), slots(T - 1), None, None), r"\bslot_mapping\b"),
    ("reshape_and_cache", "range-slot-hi", lambda: (r(T, HKV, D), r(T, HKV, D), kvc(), kvc(), slots(vals=[0, 1, 2, 3, NB * BS]), None, None), r"\bslot_mapping\b"),
    ("reshape_and_cache", "range-slot-lo", lambda: (r(T, HKV, D), r(T, HKV, D), kvc(), kvc(), slots(vals=[0, -2, 2, 3, 4], dtype=torch.int32), None, None), r"\bslot_mapping\b"),
    ("reshape_and_cache", "fp8-missing-k_scale", lambda: (r(T, HKV, D), r(T, HKV, D), kvc(E4M3), kvc(E4M3), slots(), None, S1()), r"\bk_scale\b"),
    ("reshape_and_cache", "fp8-missing-v_scale", lambda: (r(T, HKV, D), r(T, HKV, D), kvc(E4M3), kvc(E4M3), slots(), S1(), None), r"\bv_scale\b"),
    ("reshape_and_cache", "fp8-dtype-k_scale", lambda: (r(T, HKV, D), r(T, HKV, D), kvc(E4M3), kvc(E4M3), slots(), S1().to(BF), S1()), r"\bk_scale\b"),
    ("reshape_and_cache", "fp8-numel-v_scale", lambda: (r(T, HKV, D), r(T, HKV, D), kvc(E4M3), kvc(E4M3), slots(), S1(), torch.ones(HKV + 1)), r"\bv_scale\b"),
    ("reshape_and_cache", "fp8-2d-k_scale", lambda: (r(T, HKV, D), r(T, HKV, D), kvc(E4M3), kvc(E4M3), slots(), torch.ones(1, HKV), S1()), r"\bk_scale\b"),
    ("reshape_and_cache", "fp8-noncontig-k_scale", lambda: (r(T, HKV, D), r(T, HKV, D), kvc(E4M3), kvc(E4M3), slots(), torch.ones(2 * HKV)[::2], S1()), r"\bk_scale\b"),
    ("reshape_and_cache", "fp8-device-k_scale", lambda: (r(T, HKV, D), r(T, HKV, D), kvc(E4M3), kvc(E4M3), slots(), S1().to("meta"), S1()), r"\bk_scale\b|device"),
    ("reshape_and_cache", "same-dtype-with-scale", lambda: (r(T, HKV, D), r(T, HKV, D), kvc(), kvc(), slots(), S1(), S1()), r"\bk_scale\b"),
]

NAMESPACES = ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)]


@pytest.mark.parametrize("ns_name", NAMESPACES)
@pytest.mark.parametrize("op,case,make_args,arg_re", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_bad_input(ns_name, op, case, make_args, arg_re):
    be = get_backend("sim" if ns_name == "fastinfer_sim" else "cpu")
    args = make_args()
    fn = getattr(be.ns, op)
    with pytest.raises(RuntimeError, match=arg_re) as exc:
        fn(*args)
    msg = str(exc.value)
    # message format: "fastinfer.<op>: <argument> must ..., got ..."
    assert f"{ns_name}.{op}:" in msg or "device" in msg, msg


def test_fp32_rejected_by_sim():
    """The sim namespace (like CUDA) takes float16/bfloat16 only."""
    be = get_backend("sim")
    with pytest.raises(RuntimeError, match=r"\bx\b"):
        be.ns.rms_norm(torch.randn(2, 64), torch.ones(64), 1e-6)


def test_fp32_accepted_by_cpu():
    be = get_backend("cpu")
    out = be.ns.rms_norm(torch.randn(2, 64), torch.ones(64), 1e-6)
    assert out.dtype == torch.float32


def _cuda_device_cases():
    c, g = "cuda", "cpu"
    return [
        ("rms_norm", lambda: (r(T, H, device=c), w(device=g), 1e-6), r"\bweight\b"),
        ("rms_norm_out", lambda: (r(T, H, device=g), r(T, H, device=c), w(device=c), 1e-6), r"\bout\b"),
        ("fused_add_rms_norm", lambda: (r(T, H, device=c), r(T, H, device=g), w(device=c), 1e-6), r"\bresidual\b"),
        ("gated_rms_norm", lambda: (r(T, H, device=c), r(T, H, device=g), w(device=c), 1e-6), r"\bgate\b"),
        ("silu_and_mul", lambda: (r(T, 2 * F_, device=g).to(torch.float64),), r"\bx\b"),
        ("silu_and_mul_out", lambda: (r(T, F_, device=g), r(T, 2 * F_, device=c)), r"\bout\b"),
        ("rotary_embedding", lambda: (pos(), r(T, HQ, D, device=c), r(T, HKV, D, device=c), cache_().to(c), True), r"\bpositions\b"),
        ("rotary_embedding", lambda: (pos().to(c), r(T, HQ, D, device=c), r(T, HKV, D, device=c), cache_(), True), r"\bcos_sin_cache\b"),
        ("reshape_and_cache", lambda: (r(T, HKV, D, device=c), r(T, HKV, D, device=c), kvc().to(c), kvc().to(c), slots(), None, None), r"\bslot_mapping\b"),
        ("reshape_and_cache", lambda: (r(T, HKV, D, device=c), r(T, HKV, D, device=c), kvc(E4M3).to(c), kvc(E4M3).to(c), slots().to(c), S1(), S1().to(c)), r"\bk_scale\b"),
    ]


@pytest.mark.cuda
@pytest.mark.parametrize("idx", range(len(_cuda_device_cases())))
def test_bad_device_cuda(idx):
    """CUDA tensors mixed with CPU tensors: RuntimeError naming the CPU argument."""
    be = get_backend("cuda")
    op, make_args, arg_re = _cuda_device_cases()[idx]
    with pytest.raises(RuntimeError, match=arg_re):
        getattr(be.ns, op)(*make_args())
