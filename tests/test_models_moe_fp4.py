"""NVFP4 (W4A16) mixture-of-experts checkpoints as stored: compressed-tensors ``nvfp4-pack-quantized``
(NVFP4A16) checkpoints written by compressed-tensors itself, on Mixtral and Qwen3-MoE; the experts
run by ``fused_moe_fp4`` (:class:`~fastinfer.quant.Fp4FusedMoEMethod`), the dense linears by
``fp4_gemm``. (gpt-oss's MXFP4 experts: tests/test_models_gpt_oss.py.)

Producer. compressed-tensors quantises the hub's per-expert ``nn.Linear`` modules
(:func:`ct_helpers.linearize_experts`) with its own quantisation, packing and save.

Reference. The producer's own dequantisation of each quantised weight in float32
(``compressed_tensors.quantization.lifecycle.forward.dequantize``: ``e2m1 * (scale /
global_scale)``) written into a float checkpoint (the package's ``decompress_model`` rounds each
weight to bfloat16 on the way, too coarse for this rule), run by transformers with its eager
experts. The activations are not quantised, so FlashAttention's rule applies directly: the
runner's max logit error against the float64 reference at most twice the float32 reference's (plus
1e-5), and a relative norm error below 1e-5 (the kernel divides the fp32 accumulation by the global
scale where the reference divides each scale: fp32 rounding apart). ``test_each_nvfp4_detail_is_visible``:
the global scales or the gate / up halves swapped move the logits far away.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import fastinfer  # noqa: E402,F401
from fastinfer import SamplingParams  # noqa: E402
from fastinfer import reference as ref  # noqa: E402
from fastinfer.engine.llm import LLM  # noqa: E402
from fastinfer.layers import FusedMoE  # noqa: E402
from fastinfer.quant import (  # noqa: E402
    Fp4FusedMoEMethod,
    Fp4LinearMethod,
    Nvfp4DequantizedFusedMoEMethod,
    Nvfp4DequantizedLinearMethod,
)
from model_helpers import plan_logits as _plan_logits  # noqa: E402
from model_helpers import hf_greedy, make_hf_model, prefill_logits, random_prompt, rel_err  # noqa: E402

from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402
from ct_helpers import compress, linearize_experts  # noqa: E402

VOCAB = 300
PROMPT = random_prompt(25, VOCAB, 7)
FLOOR = 1e-5

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# hidden 128, vocab 300, 2 layers (tests/test_models_moe_int4.py's cases)
CASES = {
    # 4 experts of width 256, 2 per token (renormalised)
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    # layer 0 dense (an NVFP4 MLP), layer 1 routed: 8 experts of width 256, 3 per token, norm_topk_prob
    "qwen3_moe": ("qwen3_moe", dict(num_key_value_heads=4, num_experts=8, num_experts_per_tok=3,
                                    moe_intermediate_size=256, norm_topk_prob=True, mlp_only_layers=[0])),
}
IGNORE = ["lm_head", r"re:.*mlp\.gate$", r"re:.*block_sparse_moe\.gate$"]

_CACHE: dict = {}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """``get(key, build)``: ``build(directory)`` once per module for ``key``."""
    def get(key, build):
        if key not in _CACHE:
            _CACHE[key] = build(str(tmp_path_factory.mktemp("-".join(map(str, key)))))
        return _CACHE[key]

    return get


def _hf(name: str):
    kind, over = CASES[name]
    return make_hf_model(kind, seed=3, **over)


def float_checkpoint(store, name: str) -> str:
    def build(d):
        _hf(name).save_pretrained(d)
        return d

    return store(("float", name), build)


def _dequantised_fp32(ct_path: str, deq_path: str, schemes: dict, dst: str) -> str:
    """``deq_path`` (the producer's float checkpoint) with every quantised weight replaced by
    compressed-tensors' float32 dequantisation of ``ct_path``'s tensors."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from compressed_tensors.quantization.lifecycle.forward import dequantize

    args = next(iter(schemes.values())).weights  # one config group: its weights' arguments
    assert all(s.weights == args for s in schemes.values())
    tensors = load_file(os.path.join(deq_path, "model.safetensors"))
    with safe_open(os.path.join(ct_path, "model.safetensors"), "pt") as f:
        quantised = [n[: -len(".weight_packed")] for n in f.keys() if n.endswith(".weight_packed")]
        assert len(quantised) == len(schemes)
        for name in quantised:  # the saved names (transformers writes the hub's module names)
            codes = ref.fp4.e2m1_values(ref.fp4.fp4_unpack(f.get_tensor(name + ".weight_packed"))).float()
            w = dequantize(codes, f.get_tensor(name + ".weight_scale").float(), None, args, torch.float32,
                           f.get_tensor(name + ".weight_global_scale"))
            assert tensors[name + ".weight"].shape == w.shape, name
            tensors[name + ".weight"] = w.contiguous()
    os.makedirs(dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(deq_path, "config.json"), os.path.join(dst, "config.json"))
    return dst


def ct_checkpoint(store, name: str):
    """``(ct_path, fp32 dequantised path)`` of CASES[name] quantised by compressed-tensors (NVFP4A16)."""
    def build(d):
        groups = {"group_0": preset_name_to_scheme("NVFP4A16", ["Linear"])}
        ct_path, deq_path, schemes = compress(linearize_experts(_hf(name)), groups, IGNORE, d + "/m", None)
        return ct_path, _dequantised_fp32(ct_path, deq_path, schemes, d + "/fp32")

    return store(("ct", name), build)


def reference_logits(path: str, dtype) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager").eval()
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0].double()


def check_against(llm: LLM, float_path: str, what: str) -> torch.Tensor:
    """FlashAttention's rule against transformers running ``float_path`` (the dequantised model)."""
    out = prefill_logits(llm.model, PROMPT)
    ref64, ref32 = reference_logits(float_path, torch.float64), reference_logits(float_path, torch.float32)
    err, naive = float((out.double() - ref64).abs().max()), float((ref32 - ref64).abs().max())
    rel = rel_err(out, ref64)
    print(f"{what}: rel err {rel:.2e}, max {err:.2e} (torch fp32: {naive:.2e})")
    assert err <= 2 * naive + FLOOR and rel < 1e-5, (what, rel, err, naive)
    return out


def _moe_layers(model):
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def _dense_linears(llm):
    return [m for m in llm.model.linear_layers() if m is not llm.model.lm_head and not m.prefix.endswith(".gate")]


# ------------------------------------------------------------------------------------------------
# compressed-tensors NVFP4A16
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_compressed_tensors_nvfp4_moe_matches_dequantised_float(store, name):
    """Every expert projection packed by compressed-tensors runs on fused_moe_fp4 with the
    checkpoint's codes, e4m3 scales and global scales (gate, up and down each its own), the router
    float, the dense linears on fp4_gemm; the logits are transformers' on the producer's float32
    dequantisation, the greedy tokens too; the FP4 error against the float model is visible."""
    from safetensors import safe_open

    ct_path, fp32_path = ct_checkpoint(store, name)
    with safe_open(os.path.join(ct_path, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert any(".experts.1." in n and n.endswith(".weight_global_scale") for n in names)  # experts quantised
        router = next(n for n in names if n.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")))
        assert f.get_tensor(router).dtype == torch.float32, router  # the router is not
    llm = LLM(ct_path, num_kv_blocks=8)
    moes = _moe_layers(llm.model)
    assert moes and all(type(m.method) is Fp4FusedMoEMethod and m.method.format == "nvfp4" for m in moes)
    for m in moes:
        E, H, I = m.num_experts, m.hidden_size, m.intermediate_size
        assert m.w13.shape == (E, H // 64, 8 * 2 * I) and m.w2.shape == (E, I // 64, 8 * H)
        assert m.w13_scales.shape == (E, H // 16, 2 * I) and m.w2_scales.shape == (E, I // 16, H)
        assert m.w13_global_scale.shape == (E, 2) and m.w2_global_scale.shape == (E,)
        assert not torch.equal(m.w13_global_scale[:, 0], m.w13_global_scale[:, 1])  # each projection its own
        assert m.method.describe(m) == "nvfp4"
    assert all(type(m.method) is Fp4LinearMethod for m in _dense_linears(llm))
    from fastinfer.quant import describe_quantization

    assert "experts-nvfp4" in describe_quantization(llm.model).split(",")
    out = check_against(llm, fp32_path, f"{name} NVFP4A16")
    fp4_err = rel_err(out, prefill_logits(LLM(float_checkpoint(store, name), num_kv_blocks=8).model, PROMPT))
    print(f"{name} NVFP4A16: rel err {fp4_err:.3f} against the float model")
    assert fp4_err > 1e-3
    tokens = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(fp32_path, dtype=torch.float32,
                                                           experts_implementation="eager").eval()
    assert list(tokens[0].outputs[0].token_ids) == hf_greedy(hf, PROMPT, 8)


def test_fp4_weights_float_dequantises(store):
    """``fp4_weights="float"``: the same checkpoint's experts and linears dequantised at load (float32,
    compressed-tensors' arithmetic) into float experts and linears; transformers' logits on the
    dequantised model under the same rule."""
    ct_path, fp32_path = ct_checkpoint(store, "qwen3_moe")
    llm = LLM(ct_path, num_kv_blocks=8, fp4_weights="float")
    moes = _moe_layers(llm.model)
    assert moes and all(type(m.method) is Nvfp4DequantizedFusedMoEMethod and m.w13.dtype == torch.float32
                        for m in moes)
    assert all(type(m.method) is Nvfp4DequantizedLinearMethod for m in _dense_linears(llm))
    check_against(llm, fp32_path, "qwen3_moe NVFP4A16 dequantised")
    with pytest.raises(ValueError, match=r"fp4_weights must be 'stored' or 'float', got 'fp4'"):
        LLM(ct_path, num_kv_blocks=8, fp4_weights="fp4")


def _swap_halves(moe: FusedMoE, detail: str) -> None:
    I = moe.local_intermediate_size
    if detail == "gate / up global scales":
        moe.w13_global_scale.fill_(1.0)
    elif detail == "down global scale":
        moe.w2_global_scale.fill_(1.0)
    elif detail == "gate / up halves":
        moe.w13.copy_(torch.cat([moe.w13[:, :, 8 * I:], moe.w13[:, :, :8 * I]], dim=2))
        moe.w13_scales.copy_(torch.cat([moe.w13_scales[:, :, I:], moe.w13_scales[:, :, :I]], dim=2))
    else:
        raise AssertionError(detail)


@pytest.mark.parametrize("detail", ["gate / up global scales", "down global scale", "gate / up halves"])
def test_each_nvfp4_detail_is_visible(store, detail):
    """Each detail undone (a global scale not divided by, the gate and up halves swapped) puts the
    logits 1000 x the tolerance away: the parity test can fail."""
    ct_path, fp32_path = ct_checkpoint(store, "qwen3_moe")
    llm = LLM(ct_path, num_kv_blocks=8)
    with torch.no_grad():
        for moe in _moe_layers(llm.model):
            _swap_halves(moe, detail)
    err = rel_err(prefill_logits(llm.model, PROMPT), reference_logits(fp32_path, torch.float64))
    print(f"qwen3_moe NVFP4A16 without {detail}: rel err {err:.2e}")
    assert err > 1000 * 1e-5, (detail, err)


@pytest.mark.parametrize("suffix,tensor,expect", [
    ("weight_scale", lambda t: t.view(torch.uint8), r"has dtype torch\.uint8, expected torch\.float8_e4m3fn"),
    ("weight_packed", lambda t: t[:, :-1].contiguous(), r"has shape \[256, 63\], expected \[256, 64\]"),
    ("weight_global_scale", lambda t: t.repeat(2), r"has shape \[2\], expected \[1\]"),
])
def test_bad_expert_tensors_name_the_tensor(store, tmp_path, suffix, tensor, expect):
    """A stored NVFP4 expert tensor of the wrong dtype or shape is one error naming it."""
    from safetensors.torch import load_file, save_file

    ct_path, _ = ct_checkpoint(store, "qwen3_moe")
    bad = tmp_path / "bad"
    shutil.copytree(ct_path, bad)
    t = load_file(os.path.join(bad, "model.safetensors"))
    name = f"model.layers.1.mlp.experts.5.up_proj.{suffix}"
    t[name] = tensor(t[name])
    save_file(t, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"^tensor '{name}' {expect}"):
        LLM(str(bad), num_kv_blocks=8)


# ------------------------------------------------------------------------------------------------
# tensor and expert parallelism
# ------------------------------------------------------------------------------------------------
ENGINE = dict(dtype="float32", device="cpu", num_kv_blocks=16, block_size=16)
GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_tp2_and_ep2_equal_one_rank(store, engines, monkeypatch):
    """NVFP4A16 Qwen3-MoE (expert width 256: 128 per rank, whole 64 x 16 tiles and 16-groups):
    ``tensor_parallel_size=2`` holds each expert's gate / up rows and down columns with their
    scales (the global scales whole) and gives one rank's logits within 1e-5 (the activations are
    not quantised: only the all-reduce's order differs) and its greedy tokens;
    ``expert_parallel_size=2``, half the experts whole on each rank, gives them bit for bit."""
    monkeypatch.setenv("FASTINFER_TP_THREADS", "1")
    path = ct_checkpoint(store, "qwen3_moe")[0]
    one = engines(path, **ENGINE)
    params = SamplingParams(**GREEDY)
    tokens = [o.outputs[0].token_ids for o in one.generate([PROMPT], params)]
    a = _plan_logits(one, PROMPT)

    tp = engines(path, tensor_parallel_size=2, **ENGINE)
    moe = tp.model.layers[1].moe  # rank 0's shard
    assert type(moe.method) is Fp4FusedMoEMethod and moe.w2.shape[1] == moe.intermediate_size // 2 // 64
    assert moe.w13.shape[2] == 8 * moe.intermediate_size  # gate and up: half the rows each
    err = rel_err(_plan_logits(tp, PROMPT), a)
    print(f"qwen3_moe NVFP4A16: tensor_parallel_size=2 against one rank: rel err {err:.2e}")
    assert err < 1e-5
    assert [o.outputs[0].token_ids for o in tp.generate([PROMPT], params)] == tokens

    ep = engines(path, expert_parallel_size=2, **ENGINE)
    moe = ep.model.layers[1].moe
    assert type(moe.method) is Fp4FusedMoEMethod and moe.w13.shape[0] == moe.num_experts // 2
    b = _plan_logits(ep, PROMPT)
    assert torch.equal(a, b), f"max |diff| {(a - b).abs().max():.3e}"
    assert [o.outputs[0].token_ids for o in ep.generate([PROMPT], params)] == tokens
    assert min(ep.stats()["expert_parallel_routed_slots"]) > 0


def test_shards_that_are_not_whole_tiles_load_dequantised(store):
    """Eight ranks of a width-256 expert (32 intermediate features each, not a multiple of
    fused_moe_fp4's 64) load the NVFP4 experts dequantised, each its slice; their partial sums add
    up to the one-rank FP4 experts' output (the same weights: fp32 rounding apart)."""
    from safetensors.torch import load_file

    from fastinfer.distributed import ParallelInfo
    from fastinfer.layers import ExpertProjections, TensorDictReader
    from fastinfer.models import load_config
    from fastinfer.ops import backend
    from fastinfer.quant import resolve_quantization

    ct_path, _ = ct_checkpoint(store, "qwen3_moe")
    cfg = load_config(ct_path)
    qc = resolve_quantization(cfg)
    tensors = load_file(os.path.join(ct_path, "model.safetensors"))
    projections = ExpertProjections("gate_proj", "up_proj", "down_proj")

    def layer(tp=None) -> FusedMoE:
        m = FusedMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok, True,
                     "model.layers.1.mlp", projections, dtype=torch.float32, device="cpu", ops=backend(),
                     quant_config=qc, **(dict(tp=tp) if tp is not None else {}))
        reader = TensorDictReader(tensors)
        m.router.load_from(reader)
        m.load_from(reader)
        return m

    whole = layer()
    assert type(whole.method) is Fp4FusedMoEMethod
    x = torch.randn(29, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        w, ids = whole.ops.moe_topk(whole.router(x), whole.top_k, True, "softmax")
        one = whole.method.apply(whole, x, w, ids)
        shards = [layer(ParallelInfo(r, 8)) for r in range(8)]
        assert all(type(s.method) is Nvfp4DequantizedFusedMoEMethod and s.w13.shape[1] == 64 for s in shards)
        parts = sum(s.method.apply(s, x, w, ids).double() for s in shards)
    err = rel_err(parts, one)
    print(f"8 dequantised shards against one FP4 layer: rel err {err:.2e}")
    assert err < 1e-6


# ------------------------------------------------------------------------------------------------
# the CUDA kernel sources (simt emulator)
# ------------------------------------------------------------------------------------------------
@pytest.mark.sim
def test_sim_nvfp4_moe(store):
    """bf16 prefill of the NVFP4A16 Qwen3-MoE model on ``torch.ops.fastinfer_sim`` (fused_moe_fp4,
    fp4_gemm, moe_topk, attention on the kernel sources), bit-identical across schedule seeds, at
    most 2x as far from the fp32 CPU result as the CPU ops in bf16 (tests/test_models_moe_int4.py's
    rule)."""
    from conftest import SIM_SEEDS, raw_bits, require_sim, sim_seed

    from fastinfer.engine.checkpoints import load_checkpoint
    from fastinfer.ops import backend

    require_sim()
    ct_path, _ = ct_checkpoint(store, "qwen3_moe")
    ids = PROMPT[:17]
    ref32 = prefill_logits(LLM(ct_path, num_kv_blocks=8).model, ids)
    naive = prefill_logits(LLM(ct_path, num_kv_blocks=8, dtype="bfloat16").model, ids)
    model = load_checkpoint(ct_path, torch.bfloat16, "cpu", None, backend("fastinfer_sim"))
    assert type(model.layers[1].moe.method) is Fp4FusedMoEMethod
    results = []
    for seed in SIM_SEEDS:
        with sim_seed(seed):
            results.append(prefill_logits(model, ids))
    err, err_naive = rel_err(results[0], ref32), rel_err(naive, ref32)
    print(f"sim qwen3_moe NVFP4A16: rel err {err:.4f} (cpu bf16: {err_naive:.4f})")
    assert 0 < err_naive < 0.1 and err <= 2 * err_naive, (err, err_naive)
    for other in results[1:]:
        assert torch.equal(raw_bits(results[0]), raw_bits(other)), "sim result depends on the schedule seed"
