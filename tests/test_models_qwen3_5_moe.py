"""The MoE variants of the hybrid (Gated DeltaNet) decoder: Qwen3.5-MoE (transformers'
``Qwen3_5MoeForCausalLM``) and Qwen3-Next (``Qwen3NextForCausalLM``), float32 parity with
transformers 5 on tiny random checkpoints written with ``save_pretrained``.

Both: 4 layers (3 linear-attention + 1 full-attention), hidden 64, attention head_dim 256 with
partial rotary 0.25, GQA 2/1, linear heads 2 key / 4 value of 64, 8 experts of width 32, top-2, a
shared expert of width 48 with its sigmoid gate. Qwen3.5-MoE routes every layer and always
renormalises the top-k weights; Qwen3-Next keeps a dense MLP on ``mlp_only_layers`` (layer 1 here),
renormalises only with ``norm_topk_prob`` (off here, transformers' default is on) and stores the
Gated DeltaNet input projections interleaved per key head (``in_proj_qkvz``, ``in_proj_ba``).
Checks: logits of every prompt position (relative error < 1e-5), whole and in chunks; each MoE
detail moves the logits (the test can fail); 32 greedy tokens identical to transformers'
``generate`` through ``LLM`` batched, with chunked prefill, with preemption and with prefix caching
(the tokens and logprobs of the uncached run; in the deterministic mode bit for bit); the multimodal
Qwen3.5-MoE checkpoint's text model; fp8 experts on load against the float model whose experts run the fp64 oracle of ``fused_moe_fp8``
on the same codes and scales; the quantisation refusals; the CUDA kernel sources in the emulator
(and on a GPU, ``-m cuda``) in bf16 / fp16.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import fastinfer  # noqa: E402
from conftest import SIM_SEEDS, raw_bits, require_sim, sim_seed  # noqa: E402
from fastinfer import LLM, SamplingParams  # noqa: E402
from fastinfer.layers import BatchBuilder  # noqa: E402
from fastinfer.models import Qwen3_5ForCausalLM, load_config, load_model  # noqa: E402
from model_helpers import random_prompt, rel_err  # noqa: E402

VOCAB = 263
BS = 16
REL_TOL = 1e-5
NEW_TOKENS = 32

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
               head_dim=256, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_conv_kernel_dim=4, max_position_embeddings=512,
               layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
CONFIGS = {
    "qwen3_5_moe": dict(_COMMON),
    "qwen3_next": dict(_COMMON, intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=False),
}
ARCHITECTURES = {"qwen3_5_moe": "Qwen3_5MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}


def _hf_classes(kind):
    import transformers as t

    if kind == "qwen3_5_moe":
        return t.Qwen3_5MoeTextConfig, t.Qwen3_5MoeForCausalLM
    return t.Qwen3NextConfig, t.Qwen3NextForCausalLM


def randomize(hf, seed: int) -> None:
    """Weights larger than transformers' init (visible routing, mixing), zero-centred norms around 0."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "linear_attn.norm" in name:  # a plain scale
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif "norm" in name:  # zero-centred: the model scales by 1 + weight
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):  # the router: clear preferences
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def hf_model(kind: str, seed: int = 0, **overrides):
    config_cls, model_cls = _hf_classes(kind)
    torch.manual_seed(seed)
    hf = model_cls(config_cls(**dict(CONFIGS[kind], **overrides))).eval()
    randomize(hf, seed)
    return hf


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    hf = hf_model(request.param)
    path = str(tmp_path_factory.mktemp(request.param) / "tiny")
    hf.save_pretrained(path)
    return request.param, hf, path


def _logits(model, ids, slot=1, chunks=(None,)):
    """Logits of every position of ``ids``: one prefill per chunk (state slot ``slot``)."""
    caches = model.allocate_kv_cache(8, BS, num_state_slots=3)
    table = list(range(8))
    out, start = [], 0
    for end in list(chunks[1:] if chunks[0] is None else chunks) + [len(ids)]:
        b = BatchBuilder(BS)
        b.prefill(ids[start:end], start, table, logits="all", state_slot=slot)
        out.append(model(b.build(), caches))
        start = end
    return torch.cat(out)


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _hf_generate(hf, ids, n=NEW_TOKENS):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_config_parse(checkpoint):
    kind, _, path = checkpoint
    c = load_config(path)
    assert c.architecture == ARCHITECTURES[kind] and c.is_hybrid and c.qk_norm and c.attn_output_gate
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) == \
        (8, 2, 32, 48)
    if kind == "qwen3_5_moe":
        assert c.moe_renormalize and c.dense_mlp_layers == []
    else:
        assert not c.moe_renormalize and c.dense_mlp_layers == [1] and c.intermediate_size == 96


def test_logits_match_transformers(checkpoint):
    kind, hf, path = checkpoint
    model = load_model(path, dtype=torch.float32)
    assert isinstance(model, Qwen3_5ForCausalLM)
    routed = [layer.moe is not None for layer in model.layers]
    assert routed == ([True, False, True, True] if kind == "qwen3_next" else [True] * 4)
    ids = random_prompt(77, VOCAB, seed=3)  # > 64 tokens: the chunked recurrence on both sides
    ref = _hf_logits(hf, ids)
    assert rel_err(_logits(model, ids), ref) < REL_TOL
    assert rel_err(_logits(model, ids, slot=2, chunks=(5, 40)), ref) < REL_TOL
    # the tensors as transformers' modules hold them (stacked experts), not as saved
    from fastinfer.layers import TensorDictReader

    held = load_model(TensorDictReader(dict(hf.state_dict()), "the modules"), config=model.config,
                      dtype=torch.float32)
    assert rel_err(_logits(held, ids), ref) < REL_TOL


def test_each_detail_is_visible(checkpoint):
    """The shared expert, its gate and the routing's renormalisation each move the logits far beyond
    the tolerance; Qwen3-Next's interleaved projections read as one flat layout would too."""
    kind, hf, path = checkpoint
    ids = random_prompt(30, VOCAB, seed=5)
    ref = _hf_logits(hf, ids)
    base = load_model(path, dtype=torch.float32)
    assert rel_err(_logits(base, ids), ref) < REL_TOL

    def moved(model):
        return rel_err(_logits(model, ids), ref)

    m = load_model(path, dtype=torch.float32)
    for layer in m.layers:
        if layer.shared_expert is not None:
            with torch.no_grad():
                layer.shared_expert.down_proj.weight.zero_()
    assert moved(m) > 100 * REL_TOL
    m = load_model(path, dtype=torch.float32)
    with torch.no_grad():
        m.layers[0].shared_expert.gate.weight.zero_()  # sigmoid(0) = 1/2 instead of the gate
    assert moved(m) > 100 * REL_TOL
    m = load_model(path, dtype=torch.float32)
    for layer in m.layers:
        if layer.moe is not None:
            layer.moe.renormalize = not layer.moe.renormalize
    assert moved(m) > 100 * REL_TOL
    if kind == "qwen3_next":  # the in_proj_qkvz rows taken in flat (Qwen3.5) order
        m = load_model(path, dtype=torch.float32)
        from safetensors.torch import load_file

        w = load_file(f"{path}/model.safetensors")["model.layers.0.linear_attn.in_proj_qkvz.weight"]
        with torch.no_grad():
            p = m.layers[0].linear_attn.in_proj.weight
            p[: w.shape[0]] = w
        assert moved(m) > 100 * REL_TOL


def _llm(path, **kw):
    kw = dict(dict(dtype="float32", device="cpu", block_size=BS), **kw)
    kw.setdefault("num_kv_blocks", 64)
    return LLM(path, **kw)


def _prompts():
    return [random_prompt(n, VOCAB, seed=10 + n) for n in (7, 70, 23, 41)]


@pytest.fixture(scope="module")
def expected(checkpoint):
    _, hf, _ = checkpoint
    return [_hf_generate(hf, p) for p in _prompts()]


def _generate(llm, prompts):
    out = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in out]


def test_greedy_batched_matches_generate(checkpoint, expected):
    llm = _llm(checkpoint[2], max_num_seqs=4)
    assert _generate(llm, _prompts()) == expected
    assert llm.engine_core.scheduler.num_preemptions == 0


def test_greedy_chunked_prefill(checkpoint, expected):
    assert _generate(_llm(checkpoint[2], max_num_seqs=4, max_num_batched_tokens=16), _prompts()) == expected


def test_greedy_with_preemption(checkpoint, expected):
    llm = _llm(checkpoint[2], max_num_seqs=4, num_kv_blocks=10, max_model_len=128)
    assert _generate(llm, _prompts()) == expected
    assert llm.engine_core.scheduler.num_preemptions > 0


def _run_with_logprobs(llm, batches, max_tokens=NEW_TOKENS):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    toks, lps, cached = [], [], []
    for prompts in batches:
        for o in llm.generate(prompts, sp):
            c = o.outputs[0]
            toks.append(c.token_ids)
            lps.append([d[t] for d, t in zip(c.logprobs, c.token_ids)])
            cached.append(o.num_cached_tokens)
    return toks, torch.tensor(lps, dtype=torch.float64), cached


def test_prefix_cache_matches_uncached(checkpoint):
    """Prefix caching with state snapshots, chunked prefill and preemption (a 12-block KV pool): the
    tokens and logprobs of the run without the cache, with cache hits."""
    shared = random_prompt(40, VOCAB, seed=3)
    first = [shared + random_prompt(40, VOCAB, seed=4)]
    batch = [shared + random_prompt(n, VOCAB, seed=60 + n) for n in (10, 21, 35)]
    batches = [first, batch[:1], batch[1:], batch]
    kw = dict(max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=12, max_model_len=128)
    want_toks, want_lps, plain_cached = _run_with_logprobs(_llm(checkpoint[2], enable_prefix_caching=False, **kw),
                                                           batches)
    assert sum(plain_cached) == 0
    llm = _llm(checkpoint[2], enable_prefix_caching=True, **kw)
    toks, lps, cached = _run_with_logprobs(llm, batches)
    assert toks == want_toks
    assert rel_err(lps, want_lps) < REL_TOL
    assert sum(cached) > 0 and llm.engine_core.scheduler.num_preemptions > 0


def test_deterministic_bit_for_bit(checkpoint):
    """The deterministic mode: each request's tokens and logprob floats equal, bit for bit, those of a
    run with one prefill per prompt and no cache, with prefill in chunks of 7, prefix-cache hits and
    preemption (a 12-block KV pool; the shared-expert gate's sigmoid laid out by Backend.rowwise)."""
    shared = random_prompt(40, VOCAB, seed=3)
    batch = [shared + random_prompt(n, VOCAB, seed=60 + n) for n in (10, 21, 35)]
    batches = [[shared + random_prompt(40, VOCAB, seed=4)], batch[:1], batch[1:], batch]
    kw = dict(max_num_seqs=4, deterministic=True)
    want_toks, want_lps, _ = _run_with_logprobs(_llm(checkpoint[2], enable_prefix_caching=False, **kw), batches)
    llm = _llm(checkpoint[2], max_num_batched_tokens=7, num_kv_blocks=12, max_model_len=128, **kw)
    toks, lps, cached = _run_with_logprobs(llm, batches)
    assert toks == want_toks and torch.equal(lps, want_lps)
    assert sum(cached) > 0 and llm.engine_core.scheduler.num_preemptions > 0

def test_multimodal_checkpoint_text_model(tmp_path):
    """A ``Qwen3_5MoeForConditionalGeneration`` checkpoint (tiny vision tower) runs its text model:
    transformers' multimodal model's logits on text."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen3_5MoeConfig(text_config=dict(CONFIGS["qwen3_5_moe"]), vision_config=dict(
        depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64, num_position_embeddings=16))
    hf = Qwen3_5MoeForConditionalGeneration(config).eval()
    randomize(hf, 0)
    path = str(tmp_path / "vl")
    hf.save_pretrained(path)
    assert load_config(path).architecture == "Qwen3_5MoeForCausalLM"
    ids = random_prompt(20, VOCAB, seed=9)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0].float()
    assert rel_err(_logits(load_model(path, dtype=torch.float32), ids), ref) < REL_TOL


def test_config_refusals(checkpoint):
    from fastinfer.models import ModelConfig

    kind, _, path = checkpoint
    d = dict(ModelConfig.from_pretrained(path).raw, num_experts_per_tok=9)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_dict(d)
    assert dataclasses.replace(load_config(path)).num_experts == 8


def test_fp8_experts_on_load(checkpoint):
    """``quantization="fp8"``: the routed experts in fp8 (per channel, ``fused_moe_fp8``), every linear
    in float. Reference: the float model whose routed layers run the fp64 oracle of ``fused_moe_fp8``
    (``reference.moe.fused_moe_fp8``: the activations quantised per row, the GEMM between per
    64-group) on the fp8 model's own codes and scales, within 1e-5 relative (measured 7.4e-7); the
    fp8 cost itself (float model unchanged) must be 1000x that (measured 9e-2 to 1.4e-1)."""
    from fastinfer.layers import Linear, UnquantizedLinearMethod
    from fastinfer.quant import QuantOptions
    from fastinfer.quant.resolve import resolve_quantization
    from fastinfer.reference.moe import fused_moe_fp8

    kind, _, path = checkpoint
    qc = resolve_quantization(load_config(path), QuantOptions.from_any("fp8", None))
    fp8 = load_model(path, dtype=torch.float32, quant_config=qc)
    assert type(fp8.layers[0].moe.method).__name__ == "Fp8FusedMoEMethod"
    assert fp8.layers[0].moe.w13.dtype == torch.float8_e4m3fn
    assert all(isinstance(m.method, UnquantizedLinearMethod) for m in fp8.modules() if isinstance(m, Linear))
    ref = load_model(path, dtype=torch.float32)
    ids = random_prompt(77, VOCAB, seed=3)
    got, plain = _logits(fp8, ids), _logits(ref, ids)
    for q, layer in zip(fp8.layers, ref.layers):
        if layer.moe is not None:
            def oracle(x, q=q.moe, m=layer.moe):
                w, e = m.ops.moe_topk(m.router(x), m.top_k, m.renormalize, m.scoring)
                return fused_moe_fp8(x, q.w13, q.w2, q.w13_scale, q.w2_scale, w, e).to(x.dtype)
            layer.moe.forward = oracle
    want = _logits(ref, ids)
    assert rel_err(got, want) < REL_TOL
    assert rel_err(got, plain) > 1000 * REL_TOL
    llm = _llm(path, quantization="fp8", max_num_seqs=2)
    toks = _generate(llm, _prompts()[:2])
    assert all(len(t) == NEW_TOKENS for t in toks)


def test_quantisation_refusals(checkpoint):
    from fastinfer.quant import QuantOptions
    from fastinfer.quant.resolve import resolve_quantization

    config = load_config(checkpoint[2])
    with pytest.raises(ValueError, match=r"quantization='int4' is not supported for Qwen3.*only the routed experts"):
        resolve_quantization(config, QuantOptions.from_any("int4", None))
    dense = dataclasses.replace(config, architecture="Qwen3_5ForCausalLM", num_experts=0)
    with pytest.raises(ValueError, match=r"quantization='fp8' is not supported for Qwen3_5ForCausalLM"):
        resolve_quantization(dense, QuantOptions.from_any("fp8", None))
    from fastinfer.quant import quantize_checkpoint

    with pytest.raises(ValueError, match=r"quantize does not write Qwen3.* checkpoints"):
        quantize_checkpoint(checkpoint[2], checkpoint[2] + "-fp8", QuantOptions.from_any("fp8", None))
    from fastinfer.quant.resolve import OnLoadQuantization  # every linear quantised: refused by the model

    with pytest.raises(ValueError, match=r"quantised linears are not supported for Qwen3.*would be fp8"):
        load_model(checkpoint[2], dtype=torch.float32, quant_config=OnLoadQuantization(QuantOptions.from_any("fp8",
                                                                                                            None)))


def _chunked_and_decoded(model, ids, other, device="cpu"):
    """Logits of ``ids`` run as a 13-token chunk, a 16-token chunk batched with the first chunk of
    ``other`` (another slot), then one decode row of each: the rows of ``ids`` only."""
    caches = model.allocate_kv_cache(6, BS, num_state_slots=3, device=device)
    a_table, b_table = [1, 0], [3, 2]

    def run(b):
        return model(b.build(), caches)

    b = BatchBuilder(BS, device)
    b.prefill(ids[:13], 0, a_table, logits="all", state_slot=2)
    first = run(b)
    b = BatchBuilder(BS, device)
    b.prefill(ids[13:29], 13, a_table, logits="all", state_slot=2)
    b.prefill(other, 0, b_table, logits="last", state_slot=0)
    second = run(b)[:16]
    b = BatchBuilder(BS, device)
    b.decode(ids[29], 29, a_table, state_slot=2)
    b.decode(5, len(other), b_table, state_slot=0)
    third = run(b)[:1]
    return torch.cat([first, second, third]).float().cpu()


# measured (2026-12-06, CPU), Qwen3.5-MoE / Qwen3-Next: the emulated kernels vs fp32 bf16 8.4e-2 /
# 8.3e-2 (bound 1.9e-1 / 1.2e-1), fp16 2.0e-2 / 6.9e-3 (bound 4.2e-2 / 1.5e-2); vs the CPU ops in
# the same dtype bf16 2.6e-2 / 2.5e-2, fp16 2.4e-2 / 1.3e-3: a half-precision router may pick
# another expert for a token than the other backend's, so that comparison takes the same bound
HALF_DTYPES = [torch.bfloat16, torch.float16]


def _half_bounds(kind, hf, path, ids, other, dtype):
    """``(fp32 logits, CPU logits in dtype, 2 x transformers' own error in dtype)``."""
    ref = _chunked_and_decoded(load_model(path, dtype=torch.float32), ids, other)
    cpu = _chunked_and_decoded(load_model(path, dtype=dtype), ids, other)
    hf_half = hf_model(kind).to(dtype)
    return ref, cpu, 2 * rel_err(_hf_logits(hf_half, ids), _hf_logits(hf, ids))


@pytest.mark.sim
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_sim_kernels_end_to_end(checkpoint, dtype):
    """The CUDA kernel sources (simt emulator: the Gated DeltaNet ops, moe_topk, fused_moe, the
    shared expert's GEMMs, paged attention) in half precision: two chunks and a decode row beside
    another sequence, against the CPU ops in the same dtype and against fp32 (each within twice
    transformers' own error in that dtype); bit-identical across emulator schedule seeds."""
    require_sim()
    kind, hf, path = checkpoint
    ids, other = random_prompt(30, VOCAB, seed=6), random_prompt(9, VOCAB, seed=8)
    ref, cpu, bound = _half_bounds(kind, hf, path, ids, other, dtype)
    model = load_model(path, dtype=dtype, ops=fastinfer.ops.backend("fastinfer_sim"))
    results = []
    for seed in SIM_SEEDS:
        with sim_seed(seed):
            results.append(_chunked_and_decoded(model, ids, other))
    assert rel_err(results[0], cpu) < bound
    assert rel_err(results[0], ref) < bound
    for other_run in results[1:]:
        assert torch.equal(raw_bits(results[0]), raw_bits(other_run)), "sim result depends on the schedule seed"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_cuda_model_matches_cpu(checkpoint, dtype):
    """On a GPU: the CUDA kernels end to end (chunks + decode beside another sequence) against the
    CPU ops in the same dtype and against fp32 (as the emulator test)."""
    if not fastinfer.cuda_available():
        pytest.skip("no CUDA device / fastinfer CUDA build")
    kind, hf, path = checkpoint
    ids, other = random_prompt(30, VOCAB, seed=6), random_prompt(9, VOCAB, seed=8)
    ref, cpu, bound = _half_bounds(kind, hf, path, ids, other, dtype)
    out = _chunked_and_decoded(load_model(path, dtype=dtype, device="cuda"), ids, other, device="cuda")
    assert rel_err(out, cpu) < bound
    assert rel_err(out, ref) < bound
