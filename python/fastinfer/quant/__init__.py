"""Weight quantisation for the runner: FP8 and INT8 W8A8 and INT4 W4A16, the fastinfer checkpoint format, and
the formats of other producers (AutoAWQ, AutoGPTQ, compressed-tensors, Hugging Face fine-grained FP8).

Ways to run a quantised model::

    fastinfer quantize --method fp8 IN_DIR OUT_DIR                  # write a quantised checkpoint
    fastinfer quantize --method int4 --group-size 128 [--symmetric] IN_DIR OUT_DIR
    fastinfer quantize --method int8 [--smoothquant 0.5 [--calibration FILE]] IN_DIR OUT_DIR
    LLM(OUT_DIR)                                                    # loads it (detected from config.json)
    LLM(IN_DIR, quantization="fp8" | "int4" | "int8")               # quantise a float checkpoint on load
    LLM(IN_DIR, quantization="nvfp4" | "mxfp4")                     # on load only (no checkpoint written)
    LLM(AWQ_OR_GPTQ_DIR)                                            # AutoAWQ / AutoGPTQ 4-bit checkpoints
    LLM(LLM_COMPRESSOR_DIR)                                         # compressed-tensors (llm-compressor)
    LLM(FP8_DIR)                                                    # fine-grained FP8 (Qwen3 / DeepSeek FP8)
    LLM(GPT_OSS_DIR)                                                # gpt-oss's MXFP4 experts (on fused_moe_fp4)

Which layers
------------
Every linear layer of every decoder layer (q, k, v, o, gate, up, down) is quantised; the embedding,
the norms, the biases and ``lm_head`` stay in floating point (``lm_head`` is tied to the embedding
in many small models and dominates the logits' accuracy; it is listed in
``modules_not_quantized``). The runner fuses q/k/v and gate/up after quantisation, exactly as it
fuses the float weights (rows of the fused weight are q, k, v resp. gate, up).

Mixture-of-experts models (:class:`~fastinfer.layers.FusedMoE`): with **fp8** every expert
projection (``experts.{e}.gate_proj / up_proj / down_proj``, Mixtral's ``w1 / w3 / w2``) is
quantised like a linear, per output channel, and stored under its own name; the experts then run
on ``fused_moe_fp8`` (:class:`Fp8FusedMoEMethod`), which quantises their activations dynamically
inside (per token). The routers (``mlp.gate`` / ``block_sparse_moe.gate``) and Qwen2-MoE's
``shared_expert_gate`` stay in float (they decide, resp. scale, which experts' outputs count); the
shared expert and the dense MLP layers are ordinary linears. int8 and int4 leave no expert
method: ``quantization="int8" | "int4"`` on a MoE model is refused naming the layer.
The hybrid (Gated DeltaNet) MoE models (Qwen3.5-MoE, Qwen3-Next) quantise their routed experts
only, with ``quantization="fp8"`` on load (:class:`~fastinfer.quant.resolve.ExpertsOnlyQuantization`:
every linear stays float); other methods, quantised checkpoints of hybrid models and ``fastinfer
quantize`` on them are refused.

Methods (round to nearest; calibration data only for int8 with SmoothQuant)
---------------------------------------------------------------------------
* **fp8** (W8A8): weights e4m3 with one float32 scale per output channel,
  ``scale[n] = max(amax(W[n, :]), 1e-12) / 448``, ``q = e4m3_rne(clamp(W / scale, -448, 448))``
  (the ``fp8_quantize`` op with ``mode='token'`` applied to ``W``, computed from the weight as
  stored, in float32). Activations are quantised dynamically per token at run time
  (``fp8_quantize(x, 'token')``) and multiplied by ``fp8_scaled_mm`` with the per-channel weight
  scales; the output has the activation dtype (float32 when the runner runs in float32 on CPU).
* **int8** (W8A8): weights symmetric int8 with one float32 scale per output channel,
  ``scale[n] = max(amax(W[n, :]), 1e-12) / 127``, ``q = round(clamp(W / scale, -127, 127))`` (the
  ``int8_quantize`` op with ``mode='token'`` applied to ``W`` in float32). Activations are quantised
  dynamically per token (``int8_quantize(x, 'token')``) and multiplied by ``int8_scaled_mm`` (exact
  int32 accumulation, scales in the epilogue). ``--smoothquant ALPHA`` first smooths the float
  weights (:mod:`fastinfer.quant.smoothquant`: ``s_j = max|X_j|^a / max|W_j|^(1 - a)`` from
  calibration text run through the float model, by default the shipped corpus' training split),
  folding ``1 / s`` into the RMSNorm weights (q/k/v, gate/up) and up_proj's rows (down_proj), and
  storing it as an explicit activation scale for o_proj. Quantising on load (``quantization="int8"``)
  does no smoothing.
* **int4** (W4A16): group-wise along the input features, ``group_size`` G (default 128) a
  multiple of 32; asymmetric by default (``s = (max - min) / 15``, ``z = clamp(round(-min / s),
  0, 15)``; ``min <= 0 <= max`` is enforced), ``--symmetric`` gives ``s = amax / 7`` and ``z = 8``
  (:func:`fastinfer.quant.quantize_int4_weight`). Scales are rounded to the weight's stored dtype
  before the codes are computed, so the stored (q, s, z) reproduce the dequantised weight
  ``W = (q - z) * s`` exactly. The runner multiplies with ``int4_gemm``.
  A layer whose input size K the group size G does not divide is zero-padded to the next multiple
  of G (``pad_groups``, on by default; ``--no-pad-groups`` makes it an error instead; e.g. the shipped
  tiny model's MLP width 704 with G = 128): the padded columns get the code ``z``, so they
  dequantise to exactly 0, and the runner zero-pads the activations of that layer.
* **nvfp4** / **mxfp4** (W4A16, on load only): e2m1 codes along the input features; NVFP4 an e4m3
  scale per 16 and a float32 global divisor, compressed-tensors' arithmetic
  (:func:`fastinfer.quant.math.quantize_nvfp4_weight`: global ``448 * 6 / amax``, scale
  ``amax_group / 6 * global`` rounded to e4m3); MXFP4 an e8m0 scale per 32, the OCP MX rule
  (:func:`fastinfer.quant.math.quantize_mxfp4_weight`: ``2^(floor(log2(amax_group)) - 2)``); codes
  the nearest e2m1 value (halfway: the smaller magnitude). The runner multiplies with ``fp4_gemm``
  (:class:`Fp4LinearMethod`); every decoder linear must be whole 64 x 16 tiles on each rank (K a
  multiple of 64, each projection's rows of 16), else loading fails naming the layer. Mixture-of-experts
  experts are refused (FP4 experts run as checkpoints store them, below), and ``fastinfer quantize``
  writes no FP4 checkpoint.

Where an RMSNorm feeds an fp8 or int8 linear alone (a Llama decoder layer's ``input_layernorm`` ->
``qkv_proj`` and ``post_attention_layernorm`` -> ``gate_up_proj``, unless a router reads the MLP's
input), and that linear quantises its activations per token or with a static per-tensor scale (not
per tensor dynamically, not with SmoothQuant's explicit activation scale, not a row-parallel shard),
the norm and the quantisation run as one op (``rms_norm_quant`` / ``fused_add_rms_norm_quant``) and
the linear takes the codes (:class:`fastinfer.layers.QuantizedInput`): bit for bit the unfused pair,
one read of the activations fewer. ``RMSNorm.fuse_quant = False`` keeps them apart.

gpt-oss checkpoints (``quantization_config {"quant_method": "mxfp4"}``, transformers' ``Mxfp4Config``)
store their experts in MXFP4 (``mlp.experts.gate_up_proj_blocks`` / ``_scales``, ``down_proj_blocks``
/ ``_scales``; :mod:`fastinfer.models.gpt_oss`) and everything else in float
(:class:`Mxfp4ExpertsQuantization`): the experts run as stored on ``fused_moe_fp4``
(:class:`Fp4FusedMoEMethod`, gpt-oss's clamped SwiGLU and biases in the op). Where H or each rank's
expert width is not a multiple of 64 (gpt-oss-20b's 2880 over 2 ranks), or with
``fp4_weights="float"``, they are dequantised while loading into the model dtype (exact in float32
and bfloat16; a warning says why) and run as float experts. Quantising on load has no method for
gpt-oss's experts (clamped SwiGLU with biases): ``quantization="fp8" | "int4"`` refuses them, as
``"int8" | "nvfp4" | "mxfp4"`` refuse every model's experts.

On-disk format (``quantization_config.quant_method == "fastinfer"``, ``format_version`` 1)
------------------------------------------------------------------------------------------
A Hugging Face checkpoint directory: ``config.json`` (the source's, plus ``quantization_config``),
safetensors weights (``model.safetensors``, or shards + ``model.safetensors.index.json``), the
source's tokenizer files and ``generation_config.json``. Never pickle. Tensor names are the source's
(unfused) names. Non-linear tensors (embedding, norms, biases, ``lm_head``) are copied unchanged.
For each quantised linear ``P`` (e.g. ``model.layers.0.self_attn.q_proj``) with ``W [N, K]``:

``method = "fp8"``::

    P.weight         float8_e4m3fn [N, K]     codes
    P.weight_scale   float32       [N]        per output channel;  W ~= weight * weight_scale[:, None]

  Mixture-of-experts models: the same two tensors for every expert projection ``P``
  (``model.layers.{i}.mlp.experts.{e}.down_proj``, ...).

``method = "int8"``::

    P.weight         int8    [N, K]           codes
    P.weight_scale   float32 [N]              per output channel;  W ~= weight * weight_scale[:, None]
    P.smooth_scale   float32 [K]              SmoothQuant, o_proj only: the layer computes
                                              int8(x / smooth_scale) @ W^T (W is the smoothed weight)

  With SmoothQuant the RMSNorm weights (and up_proj's bias, if any) are stored smoothed in float32.

``method = "int4"`` (``Kq`` = K, or K rounded up to a multiple of G with ``pad_groups``)::

    P.weight_packed      uint8   [N, Kq / 2]  codes 0..15, two per byte: byte j of row n holds
                                              q[n, 2j] in bits 0-3 and q[n, 2j + 1] in bits 4-7
    P.weight_scale       <dtype> [Kq / G, N]  the source weight's dtype (bf16 / fp16 / fp32)
    P.weight_zero_point  uint8   [Kq / G, N]  0..15; absent when symmetric (z = 8)

    W[n, k] = (q[n, k] - z[k // G, n]) * s[k // G, n]     for k < K (columns >= K are padding)

``quantization_config`` (all keys written; readers check ``quant_method``, ``method``,
``format_version``)::

    {"quant_method": "fastinfer", "format_version": 1, "method": "fp8" | "int4" | "int8",
     "weight": "e4m3, per output channel" | "int4, group-wise",
     "activation": "e4m3, dynamic per token" | "unquantised",       # informational
     "group_size": G, "symmetric": bool, "pad_groups": bool,         # int4 only
     "smoothquant": null | {"alpha": a, "calibration_tokens": n, ...},  # int8 only
     "modules_not_quantized": ["lm_head"]}

AutoAWQ / AutoGPTQ checkpoints
------------------------------
``quantization_config.quant_method`` ``"awq"`` (``version`` "gemm", ``bits`` 4, ``zero_point``) or
``"gptq"`` (``bits`` 4, v1 ``checkpoint_format`` "gptq", optional ``desc_act`` with per-layer
``g_idx``); per linear ``qweight``, ``qzeros``, ``scales`` (and ``g_idx``) as documented in
:func:`fastinfer.ops.int4_repack`, which converts them to the kernel layout at load (AutoAWQ's
packer writes column ``8 j + [0, 2, 4, 6, 1, 3, 5, 7][i]`` into nibble ``i``; its unpacker's
``[0, 4, 1, 5, 2, 6, 3, 7]`` is the inverse). The group size
is read from each layer's ``qzeros`` (``group_size`` -1, per channel, works too). Fusion: q/k/v
(and gate/up) are repacked one by one and concatenated along N (the packed layout is a row of
64 x 16 tiles per 64 input features, so a concatenation of packed weights along N is the packed
weight of the concatenation, given each N is a multiple of 16); their scales and zero points are
concatenated along N. With act-order (``g_idx`` not the trivial ``k // G``) each projection has its
own input permutation: projections whose permutations are equal are fused, otherwise the fused
layer runs one ``int4_gemm`` per projection and concatenates the outputs (documented cost: 2-3
GEMM launches instead of one). An all-zero ``bias`` tensor on a projection of a model without
biases (AutoGPTQ writes them) is ignored; a non-zero one is an error. Modules that such a
checkpoint leaves in float (e.g. AWQ ``modules_to_not_convert``) load as float linears.

compressed-tensors checkpoints (llm-compressor, vLLM)
-----------------------------------------------------
``quantization_config.quant_method == "compressed-tensors"``: ``config_groups`` of schemes with
``targets``, an ``ignore`` list, a ``format`` per group or for all (parsed by
:class:`CompressedTensorsConfig`: a module's scheme is the first group whose targets name it (exact,
or ``re:`` regex with ``re.match``), else the first that names its class ``Linear``; ``ignore``
entries match the same way and leave the module in float; ``lm_head`` is quantised only if the
checkpoint did). The projections fused into one layer must share a scheme. Supported:

* ``pack-quantized`` int4, no activation quantisation (W4A16 / W4A16_ASYM presets), ``strategy``
  ``group`` (``group_size`` a multiple of 32 dividing K) or ``channel``; per linear ``P`` with
  ``W [N, K]``::

      P.weight_packed      int32 [N, K / 8]   nibble i (bits 4i..4i+3) of word j = q[n, 8 j + i] + 8
      P.weight_scale       float [N, K / G]   (channel: [N, 1])
      P.weight_zero_point  int32 [N / 8, K / G]  asymmetric only: zero point + 8, packed along N the
                                              same way (also read unpacked: int8 [N, K / G], signed)
      P.weight_shape       int   [2]          (N, K)
      P.weight_g_idx       int32 [K]          actorder "group" only: the group of input feature k

      W[n, k] = (q[n, k] - zp[n, g]) * s[n, g],  g = g_idx[k] (default k // G); q, zp signed -8..7

  The codes plus 8 are fastinfer's 0..15 codes and the zero points plus 8 its ``zeros`` (8 when
  symmetric), so the reader unpacks the words, packs them with ``int4_pack`` and transposes the
  scales; ``actorder "group"`` sorts the input features by group (stable, ``int4_repack``'s rule) and
  multiplies with ``perm``. ``actorder "weight"`` changes only the calibration, not the format.
* ``float-quantized`` FP8 (``P.weight`` float8_e4m3fn ``[N, K]``, symmetric):
  FP8_DYNAMIC (``weight_scale [N, 1]`` per channel, activations dynamic per token) and the FP8 preset
  (``weight_scale [1]`` per tensor, static ``input_scale [1]``), also per-tensor weights with dynamic
  per-token or per-tensor activations and per-channel weights with a static scale. Per-tensor weight
  scales are repeated over the projection's rows (exactly the same product), so fused projections
  keep their own scales; the fused layer's static input scale is the largest of its projections'
  (vLLM's rule; equal after calibration, as the projections see the same input). Activations:
  ``fp8_quantize(x, 'token' | 'tensor', scale=input_scale)``, then ``fp8_scaled_mm``.
* FP8_BLOCK: ``weight_scale [ceil(N / 128), ceil(K / 128)]`` per 128 x 128 block, activations
  dynamic per 1 x 128 group: ``fp8_quantize(x, 'group', 128)`` and the blockwise ``fp8_scaled_mm``
  (:class:`Fp8BlockLinearMethod`).
* ``int-quantized`` W8A8 int8 (the W8A8 preset; llm-compressor usually runs SmoothQuant + GPTQ
  first, which changes only the values): ``P.weight`` int8 ``[N, K]`` symmetric, ``weight_scale``
  float ``[N, 1]`` per channel (or ``[1]`` per tensor, repeated over the rows), no weight zero
  point; activations dynamic per token, symmetric (``int8_quantize(x, 'token')``) or asymmetric
  (``symmetric: false``: ``int8_quantize(x, 'token', symmetric=False)`` gives per-token zero points
  ``azp``, and ``int8_scaled_mm`` subtracts ``azp[m] * sum_k W[n, k]`` (``azp_adj``, computed at
  load)), or static per tensor and symmetric (``input_scale [1]``) (:class:`Int8LinearMethod`).

* ``nvfp4-pack-quantized`` NVFP4A16 (``P.weight_packed`` uint8 ``[N, K / 2]``, two e2m1 codes a
  byte, ``weight_scale`` e4m3 ``[N, K / 16]``, ``weight_global_scale`` float32 ``[1]``): dense
  layers run on ``fp4_gemm`` (:class:`Fp4LinearMethod`: ``fp4_repack`` at load, one GEMM per
  projection since each has its own global scale); a layer whose shard is not whole 64 x 16 tiles
  (K a multiple of 64, each projection's rows of 16), and every layer with ``fp4_weights="float"``,
  is dequantised at load (in float32, as compressed-tensors computes it) to a float linear
  (:class:`Nvfp4DequantizedLinearMethod`). Experts: below.

Any other scheme (int8 weight-only W8A16 or with asymmetric weights, W4A8, NVFP4 W4A4 / MXFP4, FP8 weight-only, output activations, other
block shapes, 2:4 sparsity) raises one ``ValueError`` line naming the scheme and the first module
that has it, e.g. ``model.layers.0.self_attn.q_proj: compressed-tensors scheme W8A16 int8 (weights
int8 channel, input activations none, ...) of config group 'group_0' is not supported (supported:
...)``; a ``transform_config`` is refused when the config is read. A ``kv_cache_scheme`` (fp8 e4m3,
symmetric, static, per tensor or per attention head) comes with ``self_attn.k_scale`` / ``v_scale``
per layer, which the attention layers load for ``LLM(..., kv_cache_dtype="fp8")``; another KV-cache
scheme is refused when the config is read.

Hugging Face fine-grained FP8 (transformers' ``FineGrainedFP8Config``)
----------------------------------------------------------------------
``quantization_config.quant_method == "fp8"`` with ``weight_block_size [128, 128]``,
``activation_scheme "dynamic"`` (the official Qwen3 / DeepSeek-V3 FP8 releases): per quantised
linear ``P.weight`` float8_e4m3fn ``[N, K]`` and ``P.weight_scale_inv`` float32
``[ceil(N / 128), ceil(K / 128)]``, which despite its name multiplies:
``W = weight * weight_scale_inv`` per block (``weight_scale_inv = amax(block) / 448``). Run like
FP8_BLOCK. A linear stored in float (``modules_to_not_convert``, ``lm_head``) loads in float. Other
block sizes, static activations, ue8m0 scales and fp8 embeddings are refused, naming the field.

Mixture-of-experts checkpoints
------------------------------
The experts are stored per expert and projection, as hub checkpoints hold them
(``...experts.{e}.gate_proj``, ...), each in its format's tensors for a linear ``P`` above; a
:class:`~fastinfer.layers.FusedMoE` reads them through :class:`Fp8FusedMoEMethod` (each projection
read as a linear's part is, then stacked: ``w13 [E, 2I, H]`` e4m3, gate rows then up rows, ``w2
[E, H, I]``) and runs ``fused_moe_fp8``:

* per output channel (``w13_scale [E, 2I]``, ``w2_scale [E, H]``; activations quantised per token
  inside the op): fastinfer fp8, quantisation on load, compressed-tensors FP8_DYNAMIC (``weight_scale``
  ``[N, 1]``, or one per tensor repeated over the projection's rows, the same product);
* per 128 x 128 block (``[E, 2I / 128, H / 128]``, ``[E, H / 128, I / 128]``; activations per 1 x 128
  group): compressed-tensors FP8_BLOCK and fine-grained FP8 (``weight_scale_inv``).

int4 experts (:class:`Int4FusedMoEMethod`, ``fused_moe_int4``, the activations not quantised): each
projection read as an int4 linear's part is (AutoAWQ, AutoGPTQ, compressed-tensors ``pack-quantized``,
fastinfer int4, quantisation on load), packed by ``int4_pack``; ``w13 [E, H / 64, 8 * 2I]`` (gate
then up along N), ``w2 [E, I / 64, 8 * H]``, group scales and zero points beside them. One group
size per layer (larger groups, such as a channel-wise projection's single group, repeated over the
smallest); act-order (a permuting ``g_idx``) and padded groups are refused naming the projection.

FP4 experts (:class:`Fp4FusedMoEMethod`, ``fused_moe_fp4``, the activations not quantised):
compressed-tensors NVFP4A16 (each projection's ``weight_packed``, e4m3 ``weight_scale`` per 16 and
its own ``weight_global_scale``: ``w13_global_scale [E, 2]`` for gate and up, ``w2_global_scale
[E]``) and gpt-oss's MXFP4 (e8m0 per 32, no global scale), each expert ``fp4_repack``'d: ``w13 [E,
H / 64, 8 * 2I]`` (gate then up along N), ``w2 [E, I / 64, 8 * H]``, scale bits beside them. H and
each rank's I must be multiples of 64 (:func:`~fastinfer.quant.methods.fp4_experts_fit`); where
they are not, and with ``fp4_weights="float"``, the experts load dequantised into float experts
(:class:`Nvfp4DequantizedFusedMoEMethod`; gpt-oss: its reader). Tensor parallelism cuts whole
tiles and scale groups: one rank's numbers up to the all-reduce's order.

Every expert projection of a layer must share one scheme (compressed-tensors: one config group, or
all ignored: float experts); experts stored in float (``modules_to_not_convert``) load as float
experts. Refused, naming the layer or the first expert projection: compressed-tensors fp8 with
static or per-tensor dynamic activations (the op quantises per token), int8 experts of any format
(compressed-tensors W8A8, fastinfer int8, int8 on load). ``fused_moe_fp8`` needs H and each rank's I
to be multiples of 16 (per channel) or 128 (blocks); ``fused_moe_int4`` of 64 and the group size. The router is never quantised: listed or not in a
config, it loads in float; one a checkpoint stored in e4m3 anyway (with ``weight_scale`` or
``weight_scale_inv``) is dequantised once (:class:`~fastinfer.layers.moe.RouterMethod`). Tensor
parallelism cuts each expert's intermediate dimension: its gate and up rows with their scales
(blocks), its down columns with every row's whole-row scale (blocks cut with them); a 128-block may
not straddle the cut. Each rank then quantises its own slice of the activation between the two
GEMMs: with blocks, the one-rank codes; per channel, a per-slice scale, so tensor parallelism
changes the numbers by a rounding of the activations (expert parallelism, whole experts per rank,
does not).

Code map
--------
``config.py`` (QuantOptions, the stored ``quantization_config``), ``compressed_tensors.py`` (the
compressed-tensors config: schemes, targets, ignore), ``resolve.py`` (which linear method each layer
gets), ``stored.py`` (reading each format a part is stored in, and a rank's slice of it), ``methods.py`` (the
fp8 / fp8-block / int4 / int8 / fp4 linear methods and the fp8, int4 and fp4 experts' methods),
``math.py`` (the quantisers' arithmetic), ``smoothquant.py`` (calibration and smoothing for int8),
``checkpoint.py`` (``fastinfer quantize``).
"""

from .checkpoint import quantize_checkpoint  # noqa: F401
from .config import FORMAT_VERSION, METHODS, QuantOptions, StoredQuantization, stored_quantization  # noqa: F401
from .resolve import (  # noqa: F401
    CheckpointQuantization,
    CompressedTensorsQuantization,
    GgufQuantization,
    FP4_WEIGHTS,
    Mxfp4ExpertsQuantization,
    OnLoadQuantization,
    resolve_quantization,
)
from .math import pack_nibbles, quantize_fp8_weight, quantize_int4_weight, quantize_int8_weight, unpack_nibbles  # noqa: F401
from .compressed_tensors import CompressedTensorsConfig, CtScheme  # noqa: F401
from .methods import (  # noqa: F401
    Fp8BlockLinearMethod,
    Fp8FusedMoEMethod,
    Fp8LinearMethod,
    Int4FusedMoEMethod,
    Int4LinearMethod,
    Int4Part,
    Int8LinearMethod,
    Nvfp4DequantizedLinearMethod,
    Fp4LinearMethod,
    Fp4FusedMoEMethod,
    Nvfp4DequantizedFusedMoEMethod,
    describe_quantization,
)
from .smoothquant import apply_smoothing, calibrate, smoothing_plan  # noqa: F401

__all__ = [
    "FORMAT_VERSION",
    "METHODS",
    "QuantOptions",
    "StoredQuantization",
    "stored_quantization",
    "resolve_quantization",
    "OnLoadQuantization",
    "Mxfp4ExpertsQuantization",
    "CheckpointQuantization",
    "CompressedTensorsQuantization",
    "GgufQuantization",
    "CompressedTensorsConfig",
    "CtScheme",
    "Fp8LinearMethod",
    "Fp8BlockLinearMethod",
    "Fp8FusedMoEMethod",
    "Int4FusedMoEMethod",
    "Int4LinearMethod",
    "Int4Part",
    "Int8LinearMethod",
    "Nvfp4DequantizedLinearMethod",
    "Fp4LinearMethod",
    "Fp4FusedMoEMethod",
    "Nvfp4DequantizedFusedMoEMethod",
    "FP4_WEIGHTS",
    "describe_quantization",
    "calibrate",
    "smoothing_plan",
    "apply_smoothing",
    "quantize_checkpoint",
    "quantize_fp8_weight",
    "quantize_int4_weight",
    "quantize_int8_weight",
    "pack_nibbles",
    "unpack_nibbles",
]
