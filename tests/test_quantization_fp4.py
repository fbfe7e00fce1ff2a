"""quantization="nvfp4" | "mxfp4" on load: every decoder linear quantised to FP4 and run on
fp4_gemm (fastinfer.quant.Fp4LinearMethod).

Oracles: the weight a layer multiplies (read back by multiplying the identity, float32) is the fp64
dequantisation (fastinfer.reference.fp4) of what the quantiser wrote, within fp32 rounding; the
quantiser's codes are the nearest e2m1 values of the scaled weight (checked against every
candidate); the logits follow the float model within the FP4 error.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import fastinfer  # noqa: F401  (loads the ops)
from fastinfer import reference as ref
from fastinfer.engine.llm import LLM
from fastinfer.entrypoints.cli import main as cli_main
from fastinfer.quant import Fp4LinearMethod, describe_quantization
from fastinfer.quant.math import quantize_mxfp4_weight, quantize_nvfp4_weight
from model_helpers import prefill_logits

ASSETS = os.path.join(os.path.dirname(fastinfer.__file__), "assets", "tiny-llama")
PROMPT = [5, 17, 42, 99, 123, 7, 8, 250, 1000, 3, 77, 2048, 4000, 12, 13, 14, 15]


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory):
    """A random tiny Llama (hidden 64, MLP 128, q 128 / kv 64: whole 64 x 16 tiles) written by
    transformers."""
    transformers = pytest.importorskip("transformers")
    path = str(tmp_path_factory.mktemp("float"))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, vocab_size=4096, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name:
                p.normal_(0.0, 0.08)
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copyfile(os.path.join(ASSETS, f), os.path.join(path, f))
    return path


def _dequantised(fmt, w):
    if fmt == "nvfp4":
        packed, scale, gs = quantize_nvfp4_weight(w)
        return ref.fp4.nvfp4_dequantize(packed, scale, gs)
    packed, scale = quantize_mxfp4_weight(w)
    n, k = w.shape
    return ref.fp4.mxfp4_dequantize(packed.reshape(n, k // 32, 16), scale)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantizer_picks_the_nearest_e2m1(fmt):
    """Each code is the e2m1 value nearest to the scaled weight (|.| clamped to 6); the scales
    follow the formats' rules (NVFP4: the group's amax maps to at most 6 * its e4m3 scale; MXFP4:
    amax / 2^e in [4, 8))."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(32, 128, generator=gen) * 0.05
    w[0, :16] = 0.0  # an all-zero group
    deq = _dequantised(fmt, w)
    if fmt == "nvfp4":
        _, scale, gs = quantize_nvfp4_weight(w)
        step = (scale.double() / gs.double()).repeat_interleave(16, dim=1)
    else:
        _, scale = quantize_mxfp4_weight(w)
        step = torch.pow(2.0, scale.double() - 127).repeat_interleave(32, dim=1)
        amax = w.reshape(32, 4, 32).abs().amax(-1).double()
        ratio = amax / torch.pow(2.0, scale.double() - 127)
        assert bool(((ratio >= 4) & (ratio < 8))[amax > 0].all())
    x = (w.double() / torch.where(step > 0, step, torch.ones_like(step))).clamp(-6, 6)
    cands = torch.tensor(ref.fp4.E2M1_VALUES, dtype=torch.float64)
    cands = torch.cat([cands, -cands])
    best = (x.unsqueeze(-1) - cands).abs().amin(-1)
    got = (deq / torch.where(step > 0, step, torch.ones_like(step)) - x).abs()
    assert bool((got <= best + 1e-12).all()), "a code is not the nearest e2m1 value"
    assert bool((deq[0, :16] == 0).all())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantization_on_load(float_ckpt, tmp_path, fmt):
    """Every decoder linear on fp4_gemm; the layer's weight is the oracle's dequantisation of the
    quantiser's output; the logits equal (float32 rounding) those of the float model whose decoder
    linears hold that dequantised weight, and follow the float original within the FP4 error."""
    from safetensors.torch import load_file, save_file

    float_llm = LLM(float_ckpt, num_kv_blocks=8, dtype="float32")
    llm = LLM(float_ckpt, num_kv_blocks=8, dtype="float32", quantization=fmt)
    linears = [m for m in llm.model.linear_layers() if m is not llm.model.lm_head]
    assert linears and all(type(m.method) is Fp4LinearMethod and m.method.name == fmt for m in linears)
    assert describe_quantization(llm.model) == fmt
    layer = llm.model.layers[1].down_proj
    w_float = float_llm.model.layers[1].down_proj.weight.detach()
    with torch.no_grad():
        w = layer.method.apply(layer, torch.eye(layer.in_features), None).t()
    oracle = _dequantised(fmt, w_float)
    assert (w.double() - oracle).abs().max() <= 2 ** -22 * oracle.abs().max()
    assert 0 < rel_norm(w, w_float) < 0.2

    deq = str(tmp_path / "dequantised")
    shutil.copytree(float_ckpt, deq)
    tensors = load_file(os.path.join(deq, "model.safetensors"))
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            tensors[name] = _dequantised(fmt, t).to(t.dtype)
    save_file(tensors, os.path.join(deq, "model.safetensors"), metadata={"format": "pt"})
    ours = prefill_logits(llm.model, PROMPT)
    same = prefill_logits(LLM(deq, num_kv_blocks=8, dtype="float32").model, PROMPT)
    original = prefill_logits(float_llm.model, PROMPT)
    err, fp4_err = rel_norm(ours, same), rel_norm(ours, original)
    print(f"quantization={fmt!r}: logits rel err {err:.2e} against the dequantised float model, "
          f"{fp4_err:.3f} against the float original")
    assert err < 1e-5
    assert 0 < fp4_err < 0.5


def test_fp4_on_load_refusals(float_ckpt, tmp_path, capsys):
    with pytest.raises(ValueError, match="group_size / symmetric / pad_groups are int4 options"):
        LLM(float_ckpt, num_kv_blocks=8, quantization="nvfp4", quantization_config={"group_size": 32})
    assert cli_main(["quantize", "--method", "mxfp4", float_ckpt, str(tmp_path / "x")]) == 2
    assert "method 'mxfp4' quantises on load only" in capsys.readouterr().err


def _nvfp4_layer(n, k, method):
    from fastinfer.layers import Linear, WeightPart
    from fastinfer.ops import backend

    return Linear(k, [WeightPart("p", n)], False, dtype=torch.float32, device="cpu", ops=backend("fastinfer"),
                  method=method)


def test_nvfp4_layer_not_whole_tiles_loads_dequantised():
    """A compressed-tensors NVFP4 layer that is not whole 64 x 16 tiles (here 40 rows, K = 96)
    cannot run on fp4_gemm: it loads dequantised to a float linear holding the oracle's weight
    (within fp32 rounding); quantising such a layer on load is an error naming it."""
    from fastinfer.layers import TensorDictReader
    from fastinfer.quant import Nvfp4DequantizedLinearMethod

    gen = torch.Generator().manual_seed(8)
    n, k = 40, 96
    w = torch.randn(n, k, generator=gen) * 0.05
    packed, scale, gs = quantize_nvfp4_weight(w)
    reader = TensorDictReader({"p.weight_packed": packed, "p.weight_scale": scale, "p.weight_global_scale": gs,
                               "p.weight": w})
    layer = _nvfp4_layer(n, k, Fp4LinearMethod())
    layer.load_from(reader)
    assert type(layer.method) is Nvfp4DequantizedLinearMethod
    oracle = ref.fp4.nvfp4_dequantize(packed, scale, gs)
    assert (layer.weight.double() - oracle).abs().max() <= 2 ** -22 * oracle.abs().max()
    with pytest.raises(ValueError, match=r"p: quantization='mxfp4' needs whole 64 x 16 tiles"):
        _nvfp4_layer(n, k, Fp4LinearMethod(source="float", fmt="mxfp4")).load_from(reader)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_shards_must_be_whole_tiles(tmp_path, fmt):
    """Under tensor parallelism each rank quantises (or keeps) its own slice of the whole weight's
    codes and scales: a row-parallel shard must hold whole 64-feature tiles, so no MXFP4 / NVFP4 group
    straddles two ranks. MLP width 192 over 2 ranks (down_proj's shard: 96 input features) is refused
    naming the layer; width 256 (shards of 128) loads on each rank, and the two ranks' codes are the
    two halves of one rank's."""
    from fastinfer.distributed import ParallelInfo
    from fastinfer.engine.checkpoints import load_checkpoint
    from fastinfer.quant import QuantOptions

    transformers = pytest.importorskip("transformers")

    def ckpt(width):
        path = str(tmp_path / f"mlp{width}")
        torch.manual_seed(1)
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=width, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2, head_dim=64, vocab_size=256,
                                       max_position_embeddings=64, tie_word_embeddings=False)
        transformers.LlamaForCausalLM(cfg).save_pretrained(path)
        return path

    def load(path, rank, world):
        return load_checkpoint(path, torch.float32, "cpu", None, fastinfer.ops.backend(),
                               quantization=QuantOptions(fmt), tp=ParallelInfo(rank=rank, world_size=world))

    bad = ckpt(192)
    with pytest.raises(ValueError, match=rf"model\.layers\.0\.mlp\.down_proj: quantization='{fmt}' needs whole "
                                         r"64 x 16 tiles of fp4_gemm on each rank \(input features 96"):
        load(bad, 0, 2)
    assert type(load(bad, 0, 1).layers[0].down_proj.method) is Fp4LinearMethod  # one rank: whole tiles
    good = ckpt(256)
    whole = load(good, 0, 1).layers[0].down_proj
    halves = [load(good, r, 2).layers[0].down_proj for r in (0, 1)]
    assert [h.in_features for h in halves] == [128, 128]
    eye = torch.eye(256)
    with torch.no_grad():
        w = whole.method.apply(whole, eye, None)
        w2 = torch.cat([h.method.apply(h, eye[:128, :128], None) for h in halves])
    assert torch.equal(w, w2)


@pytest.mark.sim
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_sim_fp4_model(float_ckpt, fmt):
    """bf16 prefill of a model quantised on load through ``torch.ops.fastinfer_sim`` (the fp4_gemm
    kernel source), bit-identical across emulator schedule seeds; error rule of conftest: against
    the same quantised model in float32 on the CPU ops, at most 2x as wrong as the CPU ops in bf16."""
    from conftest import SIM_SEEDS, raw_bits, require_sim, sim_seed
    from fastinfer.engine.checkpoints import load_checkpoint
    from fastinfer.quant import QuantOptions
    from model_helpers import make_forward_batch

    require_sim()
    ref32 = prefill_logits(LLM(float_ckpt, num_kv_blocks=8, dtype="float32", quantization=fmt).model, PROMPT)
    naive = prefill_logits(LLM(float_ckpt, num_kv_blocks=8, dtype="bfloat16", quantization=fmt).model, PROMPT)
    model = load_checkpoint(float_ckpt, torch.bfloat16, "cpu", None, fastinfer.ops.backend("fastinfer_sim"),
                            quantization=QuantOptions(fmt))
    assert type(model.layers[0].qkv_proj.method) is Fp4LinearMethod
    results = []
    for seed in SIM_SEEDS:
        with sim_seed(seed):
            caches = model.allocate_kv_cache(2, 16)
            results.append(model(make_forward_batch(prefill=[(PROMPT, 0, [1, 0])], all_logits=True), caches))
    err, err_naive = rel_norm(results[0], ref32), rel_norm(naive, ref32)
    print(f"sim {fmt}: rel err {err:.4f} (cpu bf16: {err_naive:.4f})")
    assert 0 < err_naive < 0.1 and err <= 2 * err_naive, (err, err_naive)
    for other in results[1:]:
        assert torch.equal(raw_bits(results[0]), raw_bits(other)), "sim result depends on the schedule seed"
