"""INT4 (W4A16) mixture-of-experts models (CPU ops, float32): compressed-tensors ``pack-quantized``
checkpoints written by compressed-tensors itself, AutoAWQ and AutoGPTQ checkpoints, experts
quantised on load (``quantization="int4"``) and by ``fastinfer quantize``, on Mixtral, Qwen2-MoE,
Qwen3-MoE and OLMoE; the experts run by ``fused_moe_int4``.

Producers. compressed-tensors quantises the hub's per-expert ``nn.Linear`` modules
(:func:`ct_helpers.linearize_experts`) with its own quantisation, packing and save, and its
``decompress_model`` gives the producer's dequantised float model. AutoAWQ / AutoGPTQ tensors are
packed by ``reference.awq_pack`` / ``gptq_pack``, whose nibble orders tests/test_gemm_int4.py checks
against words worked out by hand from AutoAWQ's and AutoGPTQ's packers; their dequantisation is
computed here in float64 from the codes, zero points and fp16 scales. The routers (and Qwen2-MoE's
shared-expert gate) stay float, as the released checkpoints leave them.

Reference. transformers runs the dequantised float model with its eager experts: the activations
are not quantised, so FlashAttention's rule applies directly: the runner's max logit error against
the float64 reference at most twice the float32 reference's (plus 1e-5), and a relative norm error
below 1e-5. ``test_each_int4_detail_is_visible``: the zero points ignored, the gate / up halves or
their scales swapped each move the logits far away.
"""

from __future__ import annotations

import json
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
from fastinfer.layers import ExpertProjections, FusedMoE, RouterMethod, UnquantizedFusedMoEMethod  # noqa: E402
from fastinfer.ops import int4_pack  # noqa: E402
from fastinfer.quant import Int4FusedMoEMethod, Int4LinearMethod  # noqa: E402
from model_helpers import plan_logits as _plan_logits  # noqa: E402
from model_helpers import make_hf_model, prefill_logits, random_prompt, rel_err  # noqa: E402

from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme  # noqa: E402
from ct_helpers import compress, linearize_experts  # noqa: E402

VOCAB = 300
PROMPT = random_prompt(25, VOCAB, 7)
FLOOR = 1e-5

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# hidden 128, vocab 300, 2 layers (test_models_moe_fp8's cases)
CASES = {
    # 4 experts of width 256, 2 per token (renormalised)
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    # layer 0 dense (an int4 MLP), layer 1 routed: 8 experts of width 256, 3 per token, norm_topk_prob
    "qwen3_moe": ("qwen3_moe", dict(num_key_value_heads=4, num_experts=8, num_experts_per_tok=3,
                                    moe_intermediate_size=256, norm_topk_prob=True, mlp_only_layers=[0])),
    # 8 experts of width 64 (group 64), 3 per token, a shared expert of width 128, q/k/v biases
    "qwen2_moe": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64,
                                    shared_expert_intermediate_size=128, norm_topk_prob=True)),
    # one KV head, 8 experts of width 256, 3 per token (not renormalised), q / k / v clipped at 1.5
    "olmoe": ("olmoe", dict(num_attention_heads=2, num_key_value_heads=1, num_experts=8, num_experts_per_tok=3,
                            clip_qkv=1.5, eos_token_id=2)),
}
IGNORE = ["lm_head", r"re:.*mlp\.gate$", r"re:.*block_sparse_moe\.gate$", r"re:.*shared_expert_gate$"]


def _hf(name: str):
    kind, over = CASES[name]
    return make_hf_model(kind, seed=3, **over)


def _w4(strategy: str, symmetric: bool, group_size=None, actorder=None):
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", strategy=strategy, group_size=group_size, symmetric=symmetric, actorder=actorder))}


CT_VARIANTS = {  # name -> (config groups, group size the experts run with, asymmetric)
    "W4A16": (lambda: {"group_0": preset_name_to_scheme("W4A16", ["Linear"])}, 128, False),
    "W4A16_ASYM-g64": (lambda: _w4("group", False, 64), 64, True),
    # one group per output channel: gate / up over H = 128, down over I = 256, run as group 128
    "W4A16-channel": (lambda: _w4("channel", True), 128, False),
}
CT_CASES = [("mixtral", "W4A16"), ("qwen3_moe", "W4A16"), ("qwen2_moe", "W4A16_ASYM-g64"), ("olmoe", "W4A16-channel")]

_CACHE: dict = {}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """``get(key, build)``: ``build(directory)`` once per module for ``key``."""
    def get(key, build):
        if key not in _CACHE:
            _CACHE[key] = build(str(tmp_path_factory.mktemp("-".join(map(str, key)))))
        return _CACHE[key]

    return get


def float_checkpoint(store, name: str) -> str:
    def build(d):
        _hf(name).save_pretrained(d)
        return d

    return store(("float", name), build)


def ct_checkpoint(store, name: str, variant: str):
    """``(ct_path, deq_path, schemes)`` of CASES[name] quantised by compressed-tensors."""
    return store(("ct", name, variant),
                 lambda d: compress(linearize_experts(_hf(name)), CT_VARIANTS[variant][0](), IGNORE, d + "/m", None))


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
# compressed-tensors
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,variant", CT_CASES)
def test_compressed_tensors_int4_moe_matches_dequantised_float(store, name, variant):
    """The experts (every expert projection packed by compressed-tensors) run as int4 experts with
    the checkpoint's codes, scales and zero points, the router float; the logits are transformers'
    on the producer's dequantisation."""
    from safetensors import safe_open

    ct_path, deq_path, _ = ct_checkpoint(store, name, variant)
    _, group, asym = CT_VARIANTS[variant]
    with safe_open(os.path.join(ct_path, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert any(".experts.1." in n and n.endswith(".weight_packed") for n in names)  # experts quantised
        router = next(n for n in names if n.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")))
        assert f.get_tensor(router).dtype == torch.float32, router  # the router is not
    llm = LLM(ct_path, num_kv_blocks=8)
    moes = _moe_layers(llm.model)
    assert moes and all(type(m.method) is Int4FusedMoEMethod and m.method.group_size == group for m in moes)
    for m in moes:
        assert type(m.router.method) is RouterMethod and m.router.weight.dtype == torch.float32
        E, H, I = m.num_experts, m.hidden_size, m.intermediate_size
        assert m.w13.shape == (E, H // 64, 8 * 2 * I) and m.w2.shape == (E, I // 64, 8 * H)
        assert m.w13_scales.shape == (E, H // group, 2 * I) and m.w2_scales.shape == (E, I // group, H)
        assert (m.w13_zeros is not None) == asym and (m.w2_zeros is not None) == asym
        assert m.method.describe(m) == f"int4-g{group}{'' if asym else '-sym'}"
    assert all(type(m.method) is Int4LinearMethod for m in _dense_linears(llm))
    out = check_against(llm, deq_path, f"{name} {variant}")
    assert rel_err(out, prefill_logits(LLM(float_checkpoint(store, name), num_kv_blocks=8).model, PROMPT)) > 1e-3
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(llm.generate([PROMPT], params)[0].outputs[0].token_ids) == 4


def test_compressed_tensors_int4_moe_through_transformers_own_loader(store):
    """transformers loading the compressed-tensors directory itself (compressed-tensors decompresses
    the per-expert tensors into its stacked experts) gives the runner's logits."""
    ct_path, _, _ = ct_checkpoint(store, "qwen3_moe", "W4A16")
    out = prefill_logits(LLM(ct_path, num_kv_blocks=8).model, PROMPT)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ct_path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT])).logits[0]
    err = rel_err(out, theirs)
    print(f"qwen3_moe W4A16: rel err vs transformers + compressed-tensors {err:.2e}")
    assert err < 1e-5


# ------------------------------------------------------------------------------------------------
# AutoAWQ / AutoGPTQ
# ------------------------------------------------------------------------------------------------
GROUP = 128


def awq_gptq_checkpoint(store, name: str, fmt: str, act_order: bool = False):
    """``(quantised path, dequantised float path)``: every decoder projection of CASES[name] but the
    routers in AutoAWQ's or AutoGPTQ's tensors (asymmetric, group 128, fp16 scales; GPTQ with its
    ``g_idx``, a random permutation per projection with ``act_order``), experts included."""
    def build(d):
        from safetensors.torch import load_file, save_file

        src = float_checkpoint(store, name)
        t = load_file(os.path.join(src, "model.safetensors"))
        cfg = json.load(open(os.path.join(src, "config.json")))
        gen = torch.Generator().manual_seed(11)
        qt, deq = dict(t), dict(t)
        for key, w in t.items():
            if ".layers." not in key or not key.endswith("proj.weight") and not key.endswith((".w1.weight", ".w2.weight",
                                                                                             ".w3.weight")):
                continue
            p = key[: -len(".weight")]
            n, k = w.shape
            if act_order:
                g_idx = torch.empty(k, dtype=torch.int32)
                g_idx[torch.randperm(k, generator=gen)] = (torch.arange(k) // GROUP).to(torch.int32)
            else:
                g_idx = (torch.arange(k) // GROUP).to(torch.int32)
            order = torch.argsort(g_idx.long(), stable=True)
            q_sorted, s, z = ref.quantize_int4(w[:, order], GROUP, symmetric=False)
            q = torch.empty_like(q_sorted)
            q[:, order] = q_sorted
            s = s.to(torch.float16)
            groups = g_idx.long()
            deq[key] = ((q.double() - z.double()[groups].t()) * s.double()[groups].t()).float()
            del qt[key]
            qt[p + ".qweight"], qt[p + ".qzeros"] = (ref.awq_pack if fmt == "awq" else ref.gptq_pack)(q, z)
            qt[p + ".scales"] = s
            if fmt == "gptq":
                qt[p + ".g_idx"] = g_idx
        qc = ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
              if fmt == "awq" else
              {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order, "sym": False})
        for sub, tensors, config in (("q", qt, dict(cfg, quantization_config=qc)), ("deq", deq, cfg)):
            os.makedirs(os.path.join(d, sub))
            save_file(tensors, os.path.join(d, sub, "model.safetensors"), metadata={"format": "pt"})
            json.dump(config, open(os.path.join(d, sub, "config.json"), "w"))
        return os.path.join(d, "q"), os.path.join(d, "deq")

    return store(("int4", name, fmt, act_order), build)


@pytest.mark.parametrize("name,fmt", [("qwen3_moe", "awq"), ("mixtral", "gptq"), ("olmoe", "awq")])
def test_awq_gptq_moe_matches_dequantised_float(store, name, fmt):
    qpath, deqpath = awq_gptq_checkpoint(store, name, fmt)
    llm = LLM(qpath, num_kv_blocks=8)
    moes = _moe_layers(llm.model)
    assert moes and all(type(m.method) is Int4FusedMoEMethod and m.w13_zeros is not None for m in moes)
    assert all(m.w13_scales.dtype == torch.float32 for m in moes)  # fp16 in the file, exact in float32
    assert all(type(m.method) is Int4LinearMethod for m in _dense_linears(llm))
    out = check_against(llm, deqpath, f"{name} {fmt}")
    assert torch.equal(prefill_logits(LLM(qpath, num_kv_blocks=8, quantization="int4").model, PROMPT), out)


def test_gptq_act_order_experts_are_refused(store):
    """A GPTQ ``g_idx`` that permutes the input features (w1 / w3 span one group of 128: a trivial
    g_idx; w2 two): fused_moe_int4 reads the input in order, so loading refuses, naming the
    projection."""
    qpath, _ = awq_gptq_checkpoint(store, "mixtral", "gptq", act_order=True)
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.block_sparse_moe\.experts\.0\.w2: act-order int4 "
                                         r"experts \(a g_idx permuting the input features\) are not supported"):
        LLM(qpath, num_kv_blocks=8)


# ------------------------------------------------------------------------------------------------
# quantisation on load, fastinfer quantize
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,config", [("mixtral", None), ("qwen2_moe", {"group_size": 64, "symmetric": True})])
def test_int4_on_load(store, tmp_path, name, config):
    """``quantization="int4"``: each expert projection's codes, scales and zero points are
    ``reference.quantize_int4``'s of its float weight (packed by ``int4_pack``, bit for bit); the
    logits are transformers' on the oracle's dequantised weights."""
    from safetensors.torch import load_file, save_file

    path = float_checkpoint(store, name)
    llm = LLM(path, num_kv_blocks=8, quantization="int4", quantization_config=config)
    g = (config or {}).get("group_size", 128)
    sym = (config or {}).get("symmetric", False)
    t = load_file(os.path.join(path, "model.safetensors"))
    deq = dict(t)
    for m in _moe_layers(llm.model):
        assert type(m.method) is Int4FusedMoEMethod and m.method.group_size == g
        assert (m.w13_zeros is None) == sym
        I = m.intermediate_size
        for e in range(m.num_experts):
            gate, up, down = (p.prefix + ".weight" for p in m.expert_projections(e))
            qs = {}
            for key in (gate, up, down):
                q, s, z = ref.quantize_int4(t[key], g, symmetric=sym)
                qs[key] = (q, s, z)
                deq[key] = ref.int4_dequantize(q, s, z, g).float()
            assert torch.equal(m.w13[e], int4_pack(torch.cat([qs[gate][0], qs[up][0]])))
            assert torch.equal(m.w13_scales[e], torch.cat([qs[gate][1], qs[up][1]], 1))
            assert torch.equal(m.w2[e], int4_pack(qs[down][0])) and torch.equal(m.w2_scales[e], qs[down][1])
            if not sym:
                assert torch.equal(m.w13_zeros[e, :, :I], qs[gate][2]) and torch.equal(m.w2_zeros[e], qs[down][2])
    for lin in _dense_linears(llm):
        for part in lin.parts:
            q, s, z = ref.quantize_int4(t[part.prefix + ".weight"], g, symmetric=sym)
            deq[part.prefix + ".weight"] = ref.int4_dequantize(q, s, z, g).float()
    d = tmp_path / "deq"
    d.mkdir()
    save_file(deq, str(d / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(path, "config.json"), d / "config.json")
    check_against(llm, str(d), f"{name} int4 on load")


@pytest.mark.parametrize("name", ["qwen3_moe"])
def test_quantize_cli_writes_what_loading_quantises(store, tmp_path, name):
    """``fastinfer quantize --method int4`` quantises the experts as loading with quantization="int4"
    does (``weight_packed`` / ``weight_scale`` / ``weight_zero_point`` per expert projection; the
    routers and lm_head float): the same logits, bit for bit."""
    from safetensors import safe_open

    from fastinfer.quant import QuantOptions, quantize_checkpoint

    path = float_checkpoint(store, name)
    out = str(tmp_path / "int4")
    quantize_checkpoint(path, out, QuantOptions("int4"))
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert list(f.get_tensor("model.layers.1.mlp.experts.2.down_proj.weight_packed").shape) == [128, 128]
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.float32
    stored = LLM(out, num_kv_blocks=8)
    assert type(stored.model.layers[1].moe.method) is Int4FusedMoEMethod
    on_load = LLM(path, num_kv_blocks=8, quantization="int4")
    assert torch.equal(prefill_logits(stored.model, PROMPT), prefill_logits(on_load.model, PROMPT))


# ------------------------------------------------------------------------------------------------
# each detail matters
# ------------------------------------------------------------------------------------------------
def _undo(moe: FusedMoE, detail: str) -> None:
    I = moe.local_intermediate_size
    if detail == "zero points":
        moe.w13_zeros.fill_(8)
        moe.w2_zeros.fill_(8)
    elif detail == "gate / up halves":
        moe.w13.copy_(torch.cat([moe.w13[:, :, 8 * I:], moe.w13[:, :, :8 * I]], dim=2))
        moe.w13_scales.copy_(torch.cat([moe.w13_scales[:, :, I:], moe.w13_scales[:, :, :I]], dim=2))
        moe.w13_zeros.copy_(torch.cat([moe.w13_zeros[:, :, I:], moe.w13_zeros[:, :, :I]], dim=2))
    elif detail == "gate / up scales":
        moe.w13_scales.copy_(torch.cat([moe.w13_scales[:, :, I:], moe.w13_scales[:, :, :I]], dim=2))
    else:
        raise AssertionError(detail)


@pytest.mark.parametrize("detail", ["zero points", "gate / up halves", "gate / up scales"])
def test_each_int4_detail_is_visible(store, detail):
    qpath, deqpath = awq_gptq_checkpoint(store, "qwen3_moe", "awq")
    llm = LLM(qpath, num_kv_blocks=8)
    ref64 = reference_logits(deqpath, torch.float64)
    with torch.no_grad():
        for moe in _moe_layers(llm.model):
            _undo(moe, detail)
    err = rel_err(prefill_logits(llm.model, PROMPT), ref64)
    print(f"qwen3_moe awq without {detail}: rel err {err:.2e}")
    assert err > 1000 * 1e-5, (detail, err)


# ------------------------------------------------------------------------------------------------
# tensor and expert parallelism
# ------------------------------------------------------------------------------------------------
ENGINE = dict(dtype="float32", device="cpu", num_kv_blocks=16, block_size=16)
GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_tp2_and_ep2_equal_one_rank(store, engines, monkeypatch):
    """compressed-tensors W4A16 Qwen3-MoE (expert width 256: 128 per rank, one group each):
    ``tensor_parallel_size=2`` holds each expert's gate / up rows and down columns with their
    groups and gives one rank's logits within 1e-5 (the activations are not quantised: only the
    all-reduce's order differs) and its greedy tokens; ``expert_parallel_size=2``, half the experts
    whole on each rank, gives them bit for bit."""
    monkeypatch.setenv("FASTINFER_TP_THREADS", "1")
    path = ct_checkpoint(store, "qwen3_moe", "W4A16")[0]
    one = engines(path, **ENGINE)
    params = SamplingParams(**GREEDY)
    tokens = [o.outputs[0].token_ids for o in one.generate([PROMPT], params)]
    a = _plan_logits(one, PROMPT)

    tp = engines(path, tensor_parallel_size=2, **ENGINE)
    moe = tp.model.layers[1].moe  # rank 0's shard
    assert type(moe.method) is Int4FusedMoEMethod and moe.w2.shape[1] == moe.intermediate_size // 2 // 64
    assert moe.w13.shape[2] == 8 * moe.intermediate_size  # gate and up: half the rows each
    err = rel_err(_plan_logits(tp, PROMPT), a)
    print(f"qwen3_moe W4A16: tensor_parallel_size=2 against one rank: rel err {err:.2e}")
    assert err < 1e-5
    assert [o.outputs[0].token_ids for o in tp.generate([PROMPT], params)] == tokens

    ep = engines(path, expert_parallel_size=2, **ENGINE)
    moe = ep.model.layers[1].moe
    assert type(moe.method) is Int4FusedMoEMethod and moe.w13.shape[0] == moe.num_experts // 2
    b = _plan_logits(ep, PROMPT)
    assert torch.equal(a, b), f"max |diff| {(a - b).abs().max():.3e}"
    assert [o.outputs[0].token_ids for o in ep.generate([PROMPT], params)] == tokens
    assert min(ep.stats()["expert_parallel_routed_slots"]) > 0


# ------------------------------------------------------------------------------------------------
# refusals
# ------------------------------------------------------------------------------------------------
H_LAYER, I_LAYER, E_LAYER, K_LAYER = 128, 256, 4, 2
PROJ = ExpertProjections("w1", "w3", "w2")


def _layer(opts: dict, tp=None, tensors=None) -> FusedMoE:
    from fastinfer.layers import TensorDictReader
    from fastinfer.ops import backend
    from fastinfer.quant import OnLoadQuantization, QuantOptions

    g = torch.Generator().manual_seed(4)
    if tensors is None:
        tensors = {"moe.gate.weight": torch.randn(E_LAYER, H_LAYER, generator=g)}
        for e in range(E_LAYER):
            for p, shape in (("w1", (I_LAYER, H_LAYER)), ("w3", (I_LAYER, H_LAYER)), ("w2", (H_LAYER, I_LAYER))):
                tensors[f"moe.experts.{e}.{p}.weight"] = torch.randn(shape, generator=g) * 0.2
    m = FusedMoE(H_LAYER, I_LAYER, E_LAYER, K_LAYER, True, "moe", PROJ, dtype=torch.float32, device="cpu",
                 ops=backend(), quant_config=OnLoadQuantization(QuantOptions("int4", **opts)),
                 **(dict(tp=tp) if tp is not None else {}))
    reader = TensorDictReader(tensors)
    m.router.load_from(reader)
    m.load_from(reader)
    return m


def test_tensor_parallel_shards_hold_whole_groups():
    """Two shards of one int4 layer hold their slices of the unsharded layer's packed words, scales
    and zero points; their partial sums add up to the unsharded output. A cut inside a group
    (tensor_parallel_size=4: 64 features per rank with group 128) is refused."""
    from fastinfer.distributed import ParallelInfo

    whole = _layer({})
    shards = [_layer({}, ParallelInfo(r, 2)) for r in range(2)]
    local = I_LAYER // 2
    s1 = shards[1]
    assert torch.equal(s1.w13[:, :, :8 * local], whole.w13[:, :, 8 * local:8 * I_LAYER])
    assert torch.equal(s1.w13_scales[:, :, local:], whole.w13_scales[:, :, I_LAYER + local:])
    assert torch.equal(s1.w2, whole.w2[:, local // 64:]) and torch.equal(s1.w2_zeros, whole.w2_zeros[:, 1:])
    x = torch.randn(37, H_LAYER, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        one = whole(x)
        two = shards[0].method.apply(shards[0], x, *whole.ops.moe_topk(whole.router(x), K_LAYER, True, "softmax")) + \
            shards[1].method.apply(shards[1], x, *whole.ops.moe_topk(whole.router(x), K_LAYER, True, "softmax"))
    assert rel_err(two, one) < 1e-6
    with pytest.raises(ValueError, match=r"^moe: int4 group size 128 does not divide the hidden size \(128\) and "
                                         r"each rank's expert intermediate size \(64 per rank, tensor_parallel_size=4\)"):
        _layer({}, ParallelInfo(0, 4))


def test_int4_expert_refusals():
    with pytest.raises(ValueError, match=r"^moe\.experts\.0\.w1: its int4 codes cover 192 input features \(padded "
                                         r"groups\), the projection has 128: fused_moe_int4 needs the group "
                                         r"size \(192\) to divide it"):
        _layer({"group_size": 192})
    with pytest.raises(ValueError, match=r"^moe: int4 experts need the hidden size \(128\) and each rank's expert "
                                         r"intermediate size \(32 of 64 on each of tensor_parallel_size=2 ranks\) to be "
                                         r"multiples of 64 \(fused_moe_int4\)$"):
        from fastinfer.distributed import ParallelInfo
        from fastinfer.ops import backend
        from fastinfer.quant import OnLoadQuantization, QuantOptions

        FusedMoE(H_LAYER, 64, E_LAYER, K_LAYER, True, "moe", PROJ, dtype=torch.float32, device="meta", ops=backend(),
                 tp=ParallelInfo(0, 2), quant_config=OnLoadQuantization(QuantOptions("int4")))
    with pytest.raises(ValueError, match=r"quantization='int8' does not quantise mixture-of-experts experts; "
                                         r"quantization='fp8' \(experts per channel\) or 'int4' \(group-wise\) does"):
        from fastinfer.ops import backend
        from fastinfer.quant import OnLoadQuantization, QuantOptions

        FusedMoE(H_LAYER, I_LAYER, E_LAYER, K_LAYER, True, "moe", PROJ, dtype=torch.float32, device="meta",
                 ops=backend(), quant_config=OnLoadQuantization(QuantOptions("int8")))


def test_experts_stored_in_float_load_in_float(store, tmp_path):
    """A GPTQ checkpoint whose experts are float (as ``modules_to_not_convert`` leaves them): float experts, the
    other linears int4."""
    from safetensors.torch import load_file, save_file

    qpath, _ = awq_gptq_checkpoint(store, "mixtral", "gptq")
    src = load_file(os.path.join(float_checkpoint(store, "mixtral"), "model.safetensors"))
    t = {k: v for k, v in load_file(os.path.join(qpath, "model.safetensors")).items() if ".experts." not in k}
    t.update({k: v for k, v in src.items() if ".experts." in k})
    d = tmp_path / "m"
    d.mkdir()
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(qpath, "config.json"), d / "config.json")
    llm = LLM(str(d), num_kv_blocks=8)
    moe = llm.model.layers[0].moe
    assert type(moe.method) is UnquantizedFusedMoEMethod and moe.w13.dtype == torch.float32
    assert type(llm.model.layers[0].qkv_proj.method) is Int4LinearMethod


# ------------------------------------------------------------------------------------------------
# the CUDA kernel sources (simt emulator)
# ------------------------------------------------------------------------------------------------
@pytest.mark.sim
@pytest.mark.parametrize("name,variant", [("qwen2_moe", "W4A16_ASYM-g64"), ("qwen3_moe", "W4A16")])
def test_sim_int4_moe(store, name, variant):
    """bf16 prefill of an int4 MoE model on ``torch.ops.fastinfer_sim`` (fused_moe_int4, int4_gemm,
    moe_topk, attention on the kernel sources), bit-identical across schedule seeds, at most 2x as
    far from the fp32 CPU result as the CPU ops in bf16."""
    from conftest import SIM_SEEDS, raw_bits, require_sim, sim_seed

    from fastinfer.engine.checkpoints import load_checkpoint
    from fastinfer.ops import backend

    require_sim()
    ct_path, _, _ = ct_checkpoint(store, name, variant)
    ids = PROMPT[:17]
    ref32 = prefill_logits(LLM(ct_path, num_kv_blocks=8).model, ids)
    naive = prefill_logits(LLM(ct_path, num_kv_blocks=8, dtype="bfloat16").model, ids)
    model = load_checkpoint(ct_path, torch.bfloat16, "cpu", None, backend("fastinfer_sim"))
    results = []
    for seed in SIM_SEEDS:
        with sim_seed(seed):
            results.append(prefill_logits(model, ids))
    err, err_naive = rel_err(results[0], ref32), rel_err(naive, ref32)
    print(f"sim {name} {variant}: rel err {err:.4f} (cpu bf16: {err_naive:.4f})")
    assert 0 < err_naive < 0.1 and err <= 2 * err_naive, (err, err_naive)
    for other in results[1:]:
        assert torch.equal(raw_bits(results[0]), raw_bits(other)), "sim result depends on the schedule seed"
