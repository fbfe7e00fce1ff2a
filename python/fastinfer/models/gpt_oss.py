"""gpt-oss (``GptOssForCausalLM``) on the mixture-of-experts decoder, as transformers' ``gpt_oss``
modeling file defines it::

    x = rms_norm(h);  q, k, v = x @ W_qkv^T + b          # q/k/v (and o) biased
    rotary_embedding(q, k)                               # YaRN (NeoX halves)
    attn = softmax([q k^T * D^-0.5, sinks[h]])[:-1] @ v  # a sink logit per head: no value row
    h += attn @ W_o^T + b_o
    x = rms_norm(h)
    logits = x @ W_router^T + b_router
    w, ids = topk(logits, k);  w = softmax(w)            # moe_topk(..., "topk_softmax")
    g, u = x @ W_gate_e^T + b, x @ W_up_e^T + b          # interleaved in the checkpoint
    a = (clamp(u, -limit, limit) + 1) * min(g, limit) * sigmoid(alpha * min(g, limit))
    h += sum_k w_k * (a @ W_down_e^T + b_down_e)          # fused_moe(..., "swiglu_oai", biases)

Sliding-window (``sliding_window`` keys) and full-attention layers alternate by ``layer_types``
(even layers slide by default); every layer routes its MLP.

Checkpoint names (transformers' modules, and the published checkpoints): ``self_attn.sinks [Hq]``,
``mlp.router.weight / bias``, ``mlp.experts.gate_up_proj [E, H, 2I]`` (the input dimension first;
columns interleave gate (even) and up (odd)), ``gate_up_proj_bias [E, 2I]`` (interleaved alike),
``down_proj [E, I, H]``, ``down_proj_bias [E, H]``. The published checkpoints store the two expert
weights in MXFP4 (``quantization_config {"quant_method": "mxfp4"}``): ``gate_up_proj_blocks uint8
[E, 2I, H / 32, 16]`` and ``gate_up_proj_scales uint8 [E, 2I, H / 32]``, ``down_proj_blocks [E, H,
I / 32, 16]`` and ``down_proj_scales``, each row one output feature (the transpose of the float
tensor; transformers' ``integrations/mxfp4.py`` converter). :class:`GptOssExpertsReader` shows
either form under the per-expert names :class:`~fastinfer.layers.FusedMoE` reads. MXFP4 experts run
as stored on ``fused_moe_fp4`` (:class:`~fastinfer.quant.Fp4FusedMoEMethod`: the reader shows each
expert's codes and scales as ``weight_packed`` / ``weight_scale``), the clamped SwiGLU and the
biases inside the op; where that kernel's tiles do not fit (H or a rank's I not a multiple of 64)
or with ``fp4_weights="float"`` they are dequantised by the reader (e2m1 times a power of two:
exact in float32 and bfloat16) and run as float experts in the model dtype.

Tensor parallelism as the other MoE models (each expert's intermediate rows split, the down bias
added by rank 0; attention heads split, each rank holding its heads' sinks).
"""

from __future__ import annotations

import logging
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch

from ..distributed import SINGLE, ParallelInfo  # noqa: F401
from ..distributed.pipeline import WHOLE_MODEL, PipelineStage
from ..layers import ExpertProjections, FusedMoE, QuantizationConfig, WeightReader
from ..ops import Backend
from .config import ModelConfig
from .moe import MoeDecoderLayer, MoeForCausalLM

__all__ = ["GptOssForCausalLM", "GptOssExpertsReader", "dequantize_mxfp4"]

Tensor = torch.Tensor
logger = logging.getLogger(__name__)

EXPERT_PROJECTIONS = ExpertProjections("gate_proj", "up_proj", "down_proj")
# the stacked tensors of one layer's experts, under "{layer}.mlp.experts."
_STACKED = ("gate_up_proj", "down_proj")


# e2m1 values of codes 0..15 (OCP MX: sign bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor) -> Tensor:
    """float32 ``W [..., K]`` of an MXFP4 weight in gpt-oss's layout: ``blocks uint8 [..., K / 32,
    16]`` (32 e2m1 codes per block, two a byte, the even element in the low nibble) and e8m0
    ``scales uint8 [..., K / 32]``: ``W = e2m1 * 2^(scale - 127)`` (transformers' converter's
    arithmetic): a power of two times an e2m1 value, exact in float32 for scales 0..252 (subnormals
    included); above, 6 * 2^126 and beyond overflow to inf as in the converter. e8m0 255, the MX
    NaN, is refused."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1] != 16 or \
            blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks uint8 [..., G, 16] and scales uint8 [..., G] expected, got "
                         f"{list(blocks.shape)} {blocks.dtype} and {list(scales.shape)} {scales.dtype}")
    if scales.numel() and int(scales.max()) == 255:
        raise ValueError("an MXFP4 scale of 255 (the e8m0 NaN)")
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    values = torch.tensor(_E2M1, dtype=torch.float32)[codes]
    w = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1).to(torch.float32))
    return w.flatten(-2)


class GptOssDecoderLayer(MoeDecoderLayer):
    """The MoE layer with gpt-oss's experts (its attention sinks: ``config.attention_sinks``)."""

    def init_mlp(self, c: ModelConfig, prefix: str, lin: dict) -> None:
        self.shared_expert = None
        self.tp = lin["tp"]
        self.moe = FusedMoE(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok, False,
                            f"{prefix}.mlp", EXPERT_PROJECTIONS, dtype=lin["dtype"], device=lin["device"],
                            ops=lin["ops"], tp=self.tp, quant_config=lin["quant_config"], router_name="router",
                            bias=c.moe_bias, scoring=c.moe_scoring, activation=c.moe_activation,
                            swiglu_alpha=c.swiglu_alpha, swiglu_limit=c.swiglu_limit)


class GptOssForCausalLM(MoeForCausalLM):
    """gpt-oss causal LM (``GptOssForCausalLM``; arguments as :class:`~fastinfer.models.LlamaForCausalLM`).
    A quantisation config applies to the attention projections; the experts run in float, or as an
    MXFP4 checkpoint stores them (:class:`~fastinfer.quant.Mxfp4ExpertsQuantization`)."""

    decoder_layer = GptOssDecoderLayer

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device=None,
                 max_positions: Optional[int] = None, ops: Optional[Backend] = None,
                 quant_config: Optional[QuantizationConfig] = None, tp: ParallelInfo = SINGLE,
                 stage: PipelineStage = WHOLE_MODEL):
        if config.architecture != "GptOssForCausalLM":
            raise ValueError(f"GptOssForCausalLM runs GptOssForCausalLM, not {config.architecture}")
        super().__init__(config, dtype=dtype, device=device, max_positions=max_positions, ops=ops,
                         quant_config=quant_config, tp=tp, stage=stage)

    @torch.no_grad()
    def load_weights(self, reader: WeightReader, progress: bool = False) -> "GptOssForCausalLM":
        moe_layers = [layer.moe for layer in self.layers]
        mxfp4 = getattr(self.quant_config, "experts_mxfp4", False)
        gpt_oss = GptOssExpertsReader(reader, moe_layers, mxfp4=mxfp4)
        if gpt_oss.dequantized:
            why = "; ".join(sorted(getattr(self.quant_config, "dequantized_why", ()))) or "as asked"
            logger.warning("%s: %d layers' MXFP4 experts dequantised to %s while loading (%s): they run as float "
                           "experts", self.config.architecture, gpt_oss.dequantized,
                           str(self.dtype).replace("torch.", ""), why)
        return super(MoeForCausalLM, self).load_weights(gpt_oss, progress)


class GptOssExpertsReader(WeightReader):
    """A gpt-oss checkpoint's stacked experts (module docstring: float, or MXFP4 when ``mxfp4``)
    seen under the per-expert names :class:`~fastinfer.layers.FusedMoE` reads:
    ``experts.{e}.gate_proj.weight [I, H]`` (the even columns of ``gate_up_proj[e]``, transposed),
    ``up_proj`` (the odd ones), ``down_proj.weight [H, I]`` and the three ``.bias`` alike. A layer
    whose method runs MXFP4 as stored (``method.format == "mxfp4"``) sees its experts' codes and
    scales instead, one row per output feature: ``experts.{e}.gate_proj.weight_packed uint8 [I, H /
    2]`` (the even rows of ``gate_up_proj_blocks[e]``, each row's blocks joined) and
    ``weight_scale uint8 [I, H / 32]`` (e8m0), ``up_proj`` the odd rows, ``down_proj`` all of
    ``down_proj_blocks[e]`` / ``_scales[e]``. Every other tensor, and layers stored per expert, keep
    their names. Only the expert asked for is read from a stacked tensor (and decoded), and kept
    until another is asked for: loading holds one expert's float weight at a time.
    ``dequantized``: the layers whose MXFP4 experts were decoded into float."""

    def __init__(self, base: WeightReader, layers: Sequence[FusedMoE], mxfp4: bool = False):
        super().__init__(base.description)
        self.base = base
        self.dequantized = 0
        # our name -> (base name, expert or None, "gate" | "up" | "whole")
        self._where: Dict[str, Tuple[str, Optional[int], str]] = {name: (name, None, "whole") for name in base.names()}
        self._shapes: Dict[str, Tuple[int, ...]] = {}
        for m in layers:
            if m is None:
                continue
            head = f"{m.prefix}.experts."
            E, H, I = m.num_experts, m.hidden_size, m.intermediate_size
            quantized = [base.has(head + s + "_blocks") for s in _STACKED]
            if any(quantized) and not mxfp4:
                raise ValueError(f"checkpoint {base.description} stores {head}*_blocks (MXFP4 experts) but its "
                                 "config.json has no quantization_config {\"quant_method\": \"mxfp4\"}")
            if not any(quantized) and not base.has(head + "gate_up_proj"):
                continue  # stored per expert (or missing: FusedMoE names what it lacks)
            whole = {"gate_up_proj": (E, H, 2 * I), "down_proj": (E, I, H)}
            stored = any(quantized) and getattr(m.method, "format", None) == "mxfp4"  # run by fused_moe_fp4
            for s in _STACKED:
                if base.has(head + s + "_blocks"):
                    self._check_mxfp4(head + s, whole[s])
                    for suffix in ("_blocks", "_scales"):
                        del self._where[head + s + suffix]
                    if not stored:
                        self._where[head + s] = (head + s, None, "whole")
                        self._shapes[head + s] = whole[s]
                elif any(quantized):
                    raise ValueError(f"checkpoint {base.description}: {head}{s} is not MXFP4 but the layer's other "
                                     "expert weight is")
            self.dequantized += any(quantized) and not stored
            p = m.projections
            for e in range(E):
                for proj, src, part in ((p.gate, "gate_up_proj", "gate"), (p.up, "gate_up_proj", "up"),
                                        (p.down, "down_proj", "whole")):
                    name = m.expert_name(e, proj)
                    module = name[: -len(".weight")]
                    if stored:
                        self._where[module + ".weight_packed"] = (head + src + "_blocks", e, part)
                        self._where[module + ".weight_scale"] = (head + src + "_scales", e, part)
                    else:
                        self._where[name] = (head + src, e, part)
                    self._where[module + ".bias"] = (head + src + "_bias", e, part)
            for s in _STACKED:
                for name in (head + s, head + s + "_bias"):
                    self._where.pop(name, None)
        self._cached: Tuple[Optional[Tuple[str, int]], Optional[Tensor]] = (None, None)

    def _check_mxfp4(self, name: str, whole: Tuple[int, ...]) -> None:
        """``name``'s ``_blocks`` / ``_scales`` have the shapes of the float tensor ``whole``."""
        E, rows, cols = whole[0], whole[2], whole[1]  # stored one row per output feature
        if cols % 32:
            raise ValueError(f"{name}: MXFP4 needs the input dimension ({cols}) to be a multiple of 32")
        for suffix, shape in (("_blocks", (E, rows, cols // 32, 16)), ("_scales", (E, rows, cols // 32))):
            got = tuple(self.base.shape(name + suffix))
            if got != shape:
                raise ValueError(f"tensor {name + suffix!r} has shape {list(got)}, expected {list(shape)}")

    def names(self) -> Iterable[str]:
        return self._where.keys()

    def has(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> Tuple[int, ...]:
        base_name, expert, part = self._where[name]
        shape = self._shapes.get(base_name) or tuple(self.base.shape(base_name))
        if expert is None:
            return shape
        if len(shape) == 2:  # a bias [E, 2I] / [E, H]
            return (shape[1] // 2,) if part != "whole" else (shape[1],)
        if base_name.endswith(("_blocks", "_scales")):  # stored MXFP4, one row per output feature
            rows = shape[1] // 2 if part != "whole" else shape[1]
            return (rows, shape[2] * 16) if base_name.endswith("_blocks") else (rows, shape[2])
        rows, cols = shape[2], shape[1]  # transposed
        return (rows // 2, cols) if part != "whole" else (rows, cols)

    def _expert(self, base_name: str, expert: int) -> Tensor:
        """Expert ``expert``'s slice of stacked tensor ``base_name`` as float ``[in, out]`` (MXFP4:
        that expert's blocks and scales decoded; only that expert is read)."""
        if self._cached[0] != (base_name, expert):
            self._cached = (None, None)  # the previous one freed first
            if base_name in self._shapes:  # MXFP4: [out, in] (exact in float32)
                coded = []
                for suffix in ("_blocks", "_scales"):
                    t = self.base._read_slice(base_name + suffix, (expert, 1), None)[0]
                    if t.dtype != torch.uint8:
                        raise ValueError(f"tensor {base_name + suffix!r} has dtype {t.dtype}, expected torch.uint8")
                    coded.append(t)
                t = dequantize_mxfp4(*coded).t()
            else:
                t = self.base._read_slice(base_name, (expert, 1), None)[0]
                if not t.is_floating_point():
                    raise ValueError(f"tensor {base_name!r} has dtype {t.dtype}, a float tensor was expected")
            self._cached = ((base_name, expert), t)
        return self._cached[1]

    def _read(self, name: str) -> Tensor:
        base_name, expert, part = self._where[name]
        if expert is None:
            return self.base._read(base_name)
        if base_name.endswith(("_blocks", "_scales")):  # stored MXFP4: this expert's rows, as uint8 [N, K / 2 | K / 32]
            t = self.base._read_slice(base_name, (expert, 1), None)[0]
            t = t[0::2] if part == "gate" else t[1::2] if part == "up" else t
            return t.reshape(t.shape[0], -1)
        if base_name.endswith("_bias"):
            t = self.base._read_slice(base_name, (expert, 1), None)[0]
            return t[0::2] if part == "gate" else t[1::2] if part == "up" else t
        t = self._expert(base_name, expert)  # [in, out]
        t = t[:, 0::2] if part == "gate" else t[:, 1::2] if part == "up" else t
        return t.t()
