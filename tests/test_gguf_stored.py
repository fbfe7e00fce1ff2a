"""GGUF weights as stored: Q4_0, Q4_1 and Q4_K linears run on ``int4_gemm`` without a dequantised
copy (``gguf_weights="auto"``, the default), the other types dequantised with a notice
(``"stored"``: refused).

Oracle: the ``gguf`` package itself. Its quantisers write the Q4_0 / Q4_1 / Q8_0 tensors (Q4_K,
which it only reads, gets random blocks with finite fp16 scales: every such block is a valid
weight), and ``gguf.dequantize`` gives the float weights the stored path must compute with: the
block decoding is checked against it weight by weight, the models against the same file loaded
with ``gguf_weights="float"`` (every tensor through ``gguf.dequantize``, itself checked against
transformers' GGUF loader in tests/test_gguf.py), FlashAttention's rule in float32.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from fastinfer.engine.llm import LLM  # noqa: E402
from fastinfer.engine.params import SamplingParams  # noqa: E402
from fastinfer.layers import UnquantizedLinearMethod  # noqa: E402
from fastinfer.models.gguf import GGUF_INT4_TYPES, gguf_int4_blocks  # noqa: E402
from fastinfer.quant import Int4LinearMethod, describe_quantization  # noqa: E402
from gguf_helpers import tiny_tokenizer_meta  # noqa: E402
from model_helpers import plan_logits, prefill_logits, rel_err  # noqa: E402
from test_gguf import SMOLLM, _gguf_name, _llamacpp_permute, _write_gguf, needs_smollm, tiny  # noqa: E402,F401

Q = gguf.GGMLQuantizationType
IDS = list(range(5, 200, 3))


def random_blocks(qtype, n: int, k: int, seed: int) -> np.ndarray:
    """``uint8 [n, row bytes]``: random blocks of ``qtype`` whose fp16 scale fields hold finite
    values of a weight's size (scale 0.002..0.02, minimum -0.1..0; Q4_K's sub-block scales and
    mins are the random 6-bit fields)."""
    rng = np.random.default_rng(seed)
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // size, nbytes), dtype=np.uint8)
    if qtype == Q.Q6_K:  # its fp16 d is the block's last two bytes (int8 sub-block scales before it)
        raw[..., -2:] = rng.uniform(0.00002, 0.0002, (n, k // size, 1)).astype(np.float16).view(np.uint8)
        return raw.reshape(n, -1)
    if qtype == Q.Q2_K:  # d and dmin are its last four bytes
        raw[..., -4:-2] = rng.uniform(0.001, 0.004, (n, k // size, 1)).astype(np.float16).view(np.uint8)
        raw[..., -2:] = rng.uniform(0.0, 0.004, (n, k // size, 1)).astype(np.float16).view(np.uint8)
        return raw.reshape(n, -1)
    heads = {Q.Q4_0: [(0.002, 0.02)], Q.Q4_1: [(0.002, 0.02), (-0.1, 0.0)],
             Q.Q5_0: [(0.001, 0.01)], Q.Q5_1: [(0.001, 0.01), (-0.1, 0.0)],
             Q.Q4_K: [(0.0001, 0.0004), (0.0, 0.001)], Q.Q5_K: [(0.00005, 0.0002), (0.0, 0.001)],
             Q.Q8_0: [(0.0001, 0.001)]}[qtype]
    for i, (lo, hi) in enumerate(heads):
        raw[..., 2 * i:2 * i + 2] = rng.uniform(lo, hi, (n, k // size, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q8_0])
@pytest.mark.parametrize("source", ["random", "gguf.quantize"])
def test_int4_blocks_are_what_gguf_dequantizes(qtype, source):
    """codes, scales and minimums (and the high plane of the types wider than 4 bits) reassembled
    in float64 equal ``gguf.dequantize`` to within its float32 rounding (its products and sums),
    exactly for the types whose weights are one product."""
    if source == "gguf.quantize" and qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        pytest.skip("the gguf package does not quantise the k-quants")
    n, k = 48, 512
    if source == "random":
        raw = random_blocks(qtype, n, k, seed=int(qtype))
    else:
        w = np.random.default_rng(1).standard_normal((n, k)).astype(np.float32) * 0.05
        raw = gguf.quants.quantize(w, qtype)
    want = gguf.dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    g = gguf_int4_blocks(qtype.name, raw, n, k)
    wide = qtype in (Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q8_0)
    G = 16 if qtype == Q.Q6_K else 32
    assert g.group_size == G and g.codes.dtype == np.uint8 and g.codes.max() <= 15
    assert g.scales.shape == (k // G, n) and (g.mins is None) == (qtype == Q.Q4_0)
    assert (g.high is None) != wide
    scales = np.repeat(g.scales.T.astype(np.float64), G, axis=1)
    got = (g.codes.astype(np.float64) - 8) * scales
    if g.mins is not None:
        got += np.repeat(g.mins.T.astype(np.float64), G, axis=1)
    if wide:
        assert g.high.dtype == np.uint8 and g.high.shape == (n, k)
        # Q8_0's high nibble, or the bits above the low four + 8
        span = {Q.Q8_0: (0, 15), Q.Q6_K: (8, 11)}.get(qtype, (8, 9))
        assert (g.high.min(), g.high.max()) == span
        got += 16 * (g.high.astype(np.float64) - 8) * scales
    exact = qtype in (Q.Q4_0, Q.Q5_0, Q.Q8_0)  # w = d (q - c): one rounding-free product
    tol = 0.0 if exact else 2 ** -23 * 4 * np.abs(want).max()
    assert np.abs(got - want).max() <= tol


# each layer's linears in one GGML type (the tiny model: hidden 256, intermediate 704, 5 layers): a
# k-quant needs K a multiple of its 256-weight super-block, so the MLP's down projection (K = 704)
# falls back to the block type beside it; layer 4's q / k / v are Q2_K (no kernel: dequantised), its
# o_proj F16
LAYER_TYPES = [Q.Q4_0, Q.Q4_K, Q.Q8_0, Q.Q5_K, Q.Q6_K]
_FALLBACK = {Q.Q4_K: Q.Q4_1, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q5_0}
_KQUANTS = tuple(_FALLBACK) + (Q.Q2_K,)
_WIDE = (Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q8_0)  # two nibble planes


def _layer_type(i: int, name: str, k: int):
    """The GGML type of layer ``i``'s tensor ``name`` with ``k`` input features (None: F16)."""
    if i == 4 and ".self_attn." in name:
        return None if "o_proj" in name else Q.Q2_K
    qtype = LAYER_TYPES[i]
    return _FALLBACK[qtype] if qtype in _FALLBACK and k % 256 else qtype


def _stored_tiny(tiny, path):
    """The tiny model as a GGUF file with each layer's linears in the types of :func:`_layer_type`
    (the block types quantised by ``gguf.quants.quantize``, the k-quants random blocks; layer 4's
    o_proj in F16), q/k rows permuted as llama.cpp's converter stores them."""
    cfg, tensors = tiny
    tensors = dict(tensors)
    raw = {}
    for i in range(len(LAYER_TYPES)):
        for name in [n for n in tensors if n.startswith(f"model.layers.{i}.") and n.endswith("proj.weight")]:
            t = _layer_type(i, name, tensors[name].shape[1])
            if t is None:
                continue
            w = tensors.pop(name).numpy()
            if name.endswith("q_proj.weight"):
                w = _llamacpp_permute(w, cfg["num_attention_heads"])
            elif name.endswith("k_proj.weight"):
                w = _llamacpp_permute(w, cfg["num_key_value_heads"])
            blocks = (random_blocks(t, w.shape[0], w.shape[1], seed=i) if t in _KQUANTS
                      else gguf.quants.quantize(w.astype(np.float32), t))
            raw[_gguf_name(name)] = (blocks, t)
    return _write_gguf(path, cfg, tensors, tokenizer=tiny_tokenizer_meta(), raw=raw, f16=("layers.4.",))


@pytest.fixture(scope="module")
def stored_tiny(tiny, tmp_path_factory):
    return _stored_tiny(tiny, tmp_path_factory.mktemp("gguf-stored") / "tiny.gguf")


def test_stored_linears_run_on_int4_and_match_the_dequantised_file(stored_tiny, caplog):
    """The Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0 linears load as int4 linears (group
    32, Q6_K 16, the implied zero point 8; all but Q4_0 with float minimums, the 5-, 6- and 8-bit
    types with a high plane), the Q2_K and F16 ones as float, and one notice names Q2_K; the logits
    equal the dequantised file's within float32 noise, and so do greedy tokens."""
    with caplog.at_level(logging.WARNING, logger="fastinfer"):
        llm = LLM(stored_tiny, dtype="float32", num_kv_blocks=16)
    notices = [r.getMessage() for r in caplog.records if "GGUF tensors of type" in r.getMessage()]
    assert notices == ["tiny.gguf: GGUF tensors of type Q2_K run dequantised to float32 (no kernel for them yet)"]
    layers = llm.model.layers
    seen = set()
    for i in range(len(LAYER_TYPES)):
        for slot, part in (("qkv_proj", "self_attn.q_proj"), ("o_proj", "self_attn.o_proj"),
                           ("gate_up_proj", "mlp.gate_proj"), ("down_proj", "mlp.down_proj")):
            m = getattr(layers[i], slot)
            qtype = _layer_type(i, f"model.layers.{i}.{part}.weight", m.in_features)
            if qtype in (None, Q.Q2_K):
                assert type(m.method) is UnquantizedLinearMethod, (i, slot)
                continue
            seen.add(qtype)
            assert type(m.method) is Int4LinearMethod, (i, slot)
            assert m.group_sizes == [16 if qtype == Q.Q6_K else 32], (i, slot)
            assert m.zeros0 is None and (m.mins0 is None) == (qtype == Q.Q4_0), (i, slot)
            assert (m.high_packed0 is None) == (qtype not in _WIDE), (i, slot)
    assert seen == {Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q8_0}
    assert describe_quantization(llm.model) == "int4-g16-sym,int4-g32-sym"
    out = prefill_logits(llm.model, IDS)
    dequantised = LLM(stored_tiny, dtype="float32", num_kv_blocks=16, gguf_weights="float")
    assert describe_quantization(dequantised.model) == "none"
    ref = prefill_logits(dequantised.model, IDS)
    err = rel_err(out, ref)
    print(f"tiny GGUF (Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0 stored): rel err {err:.2e} against the dequantised file")
    assert err < 1e-5
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert llm.generate([IDS[:9]], params)[0].outputs[0].token_ids == \
        dequantised.generate([IDS[:9]], params)[0].outputs[0].token_ids


def test_each_stored_detail_is_visible(stored_tiny):
    """Dropping the Q4_K / Q5_K / Q6_K / Q8_0 minimums, Q8_0's, Q5_K's or Q6_K's high plane or the
    implied zero point of 8 moves the logits far away."""
    ref = prefill_logits(LLM(stored_tiny, dtype="float32", num_kv_blocks=16, gguf_weights="float").model, IDS)
    for layer, what in ((1, "minimums"), (3, "minimums"), (2, "minimums"), (2, "high plane"), (3, "high plane"),
                        (4, "minimums"), (4, "high plane"), (0, "zero point")):
        llm = LLM(stored_tiny, dtype="float32", num_kv_blocks=16)
        m = llm.model.layers[layer].gate_up_proj
        with torch.no_grad():
            if what == "minimums":
                m.mins0.zero_()
            elif what == "high plane":
                m.high_scales0.zero_()
            else:
                m.zeros0 = torch.zeros_like(m.scales0, dtype=torch.uint8)
        err = rel_err(prefill_logits(llm.model, IDS), ref)
        print(f"layer {layer} without its {what}: rel err {err:.2e}")
        assert err > 1e-3, (layer, what, err)  # a hundred times the agreement above (< 1e-5)


def test_tensor_parallel_slices_the_stored_planes(stored_tiny, engines, monkeypatch):
    """tensor_parallel_size=2: each rank holds its rows (column-parallel) or input features
    (row-parallel) of the codes, scales, minimums and Q8_0's high plane, and the logits equal one
    rank's within float32 noise (the all-reduce's order), greedy tokens too."""
    monkeypatch.setenv("FASTINFER_TP_THREADS", "1")
    kw = dict(dtype="float32", num_kv_blocks=16, enable_prefix_caching=False)
    one = engines(stored_tiny, **kw)
    tp = engines(stored_tiny, tensor_parallel_size=2, **kw)
    q8 = tp.model.layers[2]  # rank 0's shard of the Q8_0 layer
    whole = one.model.layers[2]
    assert torch.equal(q8.o_proj.high_packed0, whole.o_proj.high_packed0[:2])  # row-parallel: K 128 of 256
    assert torch.equal(q8.o_proj.mins0, whole.o_proj.mins0[:4])
    assert q8.gate_up_proj.high_scales0.shape[1] == whole.gate_up_proj.high_scales0.shape[1] // 2
    err = rel_err(plan_logits(tp, IDS[:20]), plan_logits(one, IDS[:20]))
    print(f"tiny GGUF stored, tensor_parallel_size=2 against one rank: rel err {err:.2e}")
    assert err < 1e-5
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert tp.generate([IDS[:9]], params)[0].outputs[0].token_ids == \
        one.generate([IDS[:9]], params)[0].outputs[0].token_ids


def test_pipeline_parallel_stages_read_their_layers(stored_tiny, engines, monkeypatch):
    """pipeline_parallel_size=2 on the stored GGUF file: stage 0 (here) holds layers 0-2 as stored
    and none of the others, and the logits equal one process's bit for bit, greedy tokens too."""
    monkeypatch.setenv("FASTINFER_TP_THREADS", "1")
    kw = dict(dtype="float32", num_kv_blocks=16)
    one = engines(stored_tiny, **kw)
    pp = engines(stored_tiny, pipeline_parallel_size=2, **kw)
    assert [layer.layer_idx for layer in pp.model.layers] == [0, 1, 2] and pp.model.lm_head is None
    assert type(pp.model.layers[2].o_proj.method) is Int4LinearMethod
    assert torch.equal(pp.model.layers[2].o_proj.high_packed0, one.model.layers[2].o_proj.high_packed0)
    assert torch.equal(plan_logits(pp, IDS[:20]), plan_logits(one, IDS[:20]))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert pp.generate([IDS[:9]], params)[0].outputs[0].token_ids == \
        one.generate([IDS[:9]], params)[0].outputs[0].token_ids


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision(stored_tiny, dtype):
    """In float16 and bfloat16 the stored path is about as close to the float32 result as the
    dequantised file in that dtype (FlashAttention's 2x): int4_gemm rounds each fp16 block scale to
    the activation dtype (exact in float16; in bfloat16 one error shared by a group's 32 weights,
    times q - 8 of each; Q8_0's two planes each rounded to it, summed in float32), and the centred
    minimum term is float32. Measured: float16 3.3e-3 against 2.6e-3, bfloat16 1.6e-2 against
    2.2e-2."""
    ref = prefill_logits(LLM(stored_tiny, dtype="float32", num_kv_blocks=16, gguf_weights="float").model, IDS)
    naive = prefill_logits(LLM(stored_tiny, dtype=dtype, num_kv_blocks=16, gguf_weights="float").model, IDS)
    ours = prefill_logits(LLM(stored_tiny, dtype=dtype, num_kv_blocks=16).model, IDS)
    e, e_naive = rel_err(ours, ref), rel_err(naive, ref)
    print(f"{dtype}: stored {e:.2e}, dequantised {e_naive:.2e} from the float32 result")
    assert 0 < e < 2 * e_naive


@needs_smollm
def test_smollm2_q4_1_runs_as_stored():
    """The shipped SmolLM2-135M-Instruct Q4_1 file: every decoder linear runs as stored (its
    576 / 192 / 1536 sizes are whole int4 tiles), its Q8_0 token embedding is dequantised (a gather;
    lm_head is tied to it), and float32 greedy tokens equal the dequantised file's."""
    llm = LLM(SMOLLM, dtype="float32", num_kv_blocks=8)
    assert all(type(m.method) is Int4LinearMethod for m in llm.model.linear_layers() if m is not llm.model.lm_head)
    assert describe_quantization(llm.model) == "int4-g32-sym"
    prompt = llm.tokenizer.encode("The capital of France is")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ours = llm.generate([prompt], params)[0].outputs[0].token_ids
    dequantised = LLM(SMOLLM, dtype="float32", num_kv_blocks=8, gguf_weights="float")
    assert ours == dequantised.generate([prompt], params)[0].outputs[0].token_ids


def test_gguf_weights_option_is_checked(stored_tiny):
    with pytest.raises(ValueError, match="gguf_weights"):
        LLM(stored_tiny, dtype="float32", num_kv_blocks=16, gguf_weights="int4")
    assert set(GGUF_INT4_TYPES) == {"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"}


def test_stored_refuses_a_type_without_kernel(stored_tiny):
    """gguf_weights="stored" asks for every quantised linear as stored: the tiny file's Q2_K q / k /
    v projections are an error naming the tensor, the type and the types that run as stored (the
    default "auto" loads them dequantised, test above)."""
    with pytest.raises(ValueError) as e:
        LLM(stored_tiny, dtype="float32", num_kv_blocks=16, gguf_weights="stored")
    msg = str(e.value)
    assert "model.layers.4.self_attn." in msg and "GGUF type Q2_K cannot run as stored (no kernel for the type)" in msg
    assert "Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0" in msg and "gguf_weights='auto'" in msg


@needs_smollm
def test_stored_loads_smollm2():
    """SmolLM2's only non-int4 tensor is its Q8_0 token embedding (lm_head is tied to it; float under
    every quantisation): "stored" loads it, with the same logits as the default."""
    ids = [1, 504, 3458, 282, 4649, 314, 253, 1345]
    strict = LLM(SMOLLM, dtype="float32", num_kv_blocks=8, gguf_weights="stored")
    assert describe_quantization(strict.model) == "int4-g32-sym"
    assert torch.equal(prefill_logits(strict.model, ids),
                       prefill_logits(LLM(SMOLLM, dtype="float32", num_kv_blocks=8).model, ids))


@pytest.mark.sim
def test_sim_stored_gguf(stored_tiny):
    """bf16 prefill on the emulated kernels (int4_gemm's CUDA source with group 32) within 2x the CPU
    bf16 stored path's distance from float32, the same bits for every schedule seed."""
    from conftest import SIM_SEEDS, raw_bits, require_sim, sim_seed

    from fastinfer.engine.checkpoints import load_checkpoint
    from fastinfer.ops import backend

    require_sim()
    ids = IDS[:17]
    ref = prefill_logits(LLM(stored_tiny, dtype="float32", num_kv_blocks=16, gguf_weights="float").model, ids)
    cpu = prefill_logits(LLM(stored_tiny, dtype="bfloat16", num_kv_blocks=16).model, ids)
    model = load_checkpoint(stored_tiny, torch.bfloat16, "cpu", None, backend("fastinfer_sim"))
    assert type(model.layers[1].gate_up_proj.method) is Int4LinearMethod
    assert model.layers[2].gate_up_proj.high_packed0 is not None  # Q8_0: two int4 GEMMs
    results = []
    for seed in SIM_SEEDS:
        with sim_seed(seed):
            results.append(prefill_logits(model, ids))
    err, err_cpu = rel_err(results[0], ref), rel_err(cpu, ref)
    print(f"sim stored GGUF bf16: rel err {err:.4f} (cpu bf16 stored: {err_cpu:.4f})")
    assert err <= 2 * err_cpu + 1e-3
    for other in results[1:]:
        assert torch.equal(raw_bits(results[0]), raw_bits(other))
