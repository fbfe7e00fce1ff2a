"""Linear layers that load their own weights, through a pluggable :class:`LinearMethod`.

A :class:`Linear` computes ``y = x W^T + b``. Its weight may be the concatenation of several
checkpoint projections along the output dimension (``parts``: q/k/v, gate/up), so one GEMM runs
where the checkpoint has three. How ``W`` is stored and multiplied is the layer's ``method``:
:class:`UnquantizedLinearMethod` here (float weights), fp8 and int4 ones in :mod:`fastinfer.quant`,
chosen per layer by a :class:`QuantizationConfig` when the model is built.

Tensor parallelism: :class:`ColumnParallelLinear` (output rows split over ranks, every part
separately; a part may be split into fewer slices than ranks, then replicated: K/V heads when the
group is larger than ``num_key_value_heads``) and :class:`RowParallelLinear` (input columns split,
outputs summed over ranks by one all-reduce, the bias added by rank 0 only). The rank layout is
:class:`~fastinfer.distributed.ParallelInfo`; at world size 1 both are plain linears. A method loads
its shard through :meth:`Linear.row_shard` / :meth:`Linear.col_shard` (ranges of the checkpoint
tensor, in rows and input features).
"""

from __future__ import annotations

from typing import Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from ..distributed import SINGLE, ParallelInfo
from .weights import CheckpointModule, WeightReader

Tensor = torch.Tensor

__all__ = ["WeightPart", "ParallelInfo", "QuantizedInput", "LinearMethod", "UnquantizedLinearMethod", "QuantizationConfig",
           "Linear", "ReplicatedLinear", "ColumnParallelLinear", "RowParallelLinear", "param"]


def param(shape, dtype, device) -> nn.Parameter:
    """An uninitialised, frozen parameter (filled by the loader)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class WeightPart(NamedTuple):
    """One checkpoint projection of a (possibly fused) linear: its module name and output size."""

    prefix: str  # e.g. "model.layers.0.self_attn.q_proj"
    rows: int


class QuantizedInput(NamedTuple):
    """A linear's input already quantised as its method would quantise it (by the norm before it,
    fused: ``rms_norm_quant``): ``codes [..., K]`` (e4m3 or int8), their float32 ``scale`` (``[M]``
    per token or the static ``[1]``) and ``dtype``, the activation dtype the output takes."""

    codes: Tensor
    scale: Tensor
    dtype: torch.dtype


class LinearMethod:
    """How a :class:`Linear` holds its weight and multiplies by it.

    ``create_weights`` registers what exists before loading (may be nothing); ``load_weights``
    reads ``layer.parts`` from a reader and sets the layer's tensors; ``apply`` is the forward.
    """

    name = "float"

    def input_quantization(self, layer: "Linear") -> Optional[Tuple[torch.dtype, Optional[Tensor]]]:
        """``(code dtype, static scale or None for per-token scales)`` when ``apply`` takes a
        :class:`QuantizedInput` quantised so (the norm before the layer may then quantise); None:
        it takes float activations only."""
        return None

    def create_weights(self, layer: "Linear") -> None:
        pass

    def load_weights(self, layer: "Linear", reader: WeightReader) -> None:
        raise NotImplementedError

    def apply(self, layer: "Linear", x: Tensor, bias: Optional[Tensor]) -> Tensor:
        raise NotImplementedError

    def checkpoint_tensors(self, layer: "Linear") -> Iterable[Tuple[str, Tensor]]:
        raise ValueError(f"{layer.prefix}: {self.name} weights cannot be exported as float checkpoint tensors")

    def describe(self, layer: "Linear") -> str:
        return self.name


class UnquantizedLinearMethod(LinearMethod):
    """Float weights ``[N, K]`` in the model dtype; on CPU bf16 optionally a oneDNN-blocked copy."""

    def create_weights(self, layer: "Linear") -> None:
        layer.weight = param((layer.out_features, layer.in_features), layer.dtype, layer.device)
        layer.packed = None  # oneDNN-blocked copy of the weight (CPU bf16), see pack_for_cpu

    def load_weights(self, layer: "Linear", reader: WeightReader) -> None:
        with torch.no_grad():
            off = 0
            for i, (part, rows) in enumerate(zip(layer.parts, layer.part_rows)):
                w = reader.get_float(part.prefix + ".weight", layer.full_shape(part),
                                     rows=layer.row_shard(i), cols=layer.col_shard())
                layer.weight.narrow(0, off, rows).copy_(w.to(device=layer.device, dtype=layer.dtype))
                off += rows

    def pack_for_cpu(self, layer: "Linear", batch_hint: int = 16) -> None:
        """Keep a oneDNN-blocked copy of the weight for CPU bf16 (AMX / AVX-512 BF16): it skips the
        per-call weight reorder, ~1.5-2x faster at decode batch sizes (CPU). ``weight`` stays."""
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), batch_hint)

    def apply(self, layer: "Linear", x: Tensor, bias: Optional[Tensor]) -> Tensor:
        if layer.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, layer.packed, bias, "none", [], "")
        if layer.ops is not None:  # F.linear, or dense_mm in the deterministic mode (batch invariant)
            return layer.ops.linear(x, layer.weight, bias)
        return torch.nn.functional.linear(x, layer.weight, bias)

    def checkpoint_tensors(self, layer: "Linear") -> Iterable[Tuple[str, Tensor]]:
        off = 0
        for part, rows in zip(layer.parts, layer.part_rows):
            yield part.prefix + ".weight", layer.weight.detach().narrow(0, off, rows)
            off += rows


class QuantizationConfig:
    """Chooses the :class:`LinearMethod` of every linear layer of a model, and the experts' method of
    every mixture-of-experts layer (see :mod:`fastinfer.quant`)."""

    name = "none"

    def linear_method(self, layer: "Linear") -> LinearMethod:
        return UnquantizedLinearMethod()

    def moe_method(self, layer):
        """The :class:`~fastinfer.layers.moe.FusedMoEMethod` of ``layer`` (a FusedMoE); None: float
        experts."""
        return None


class Linear(CheckpointModule):
    """``y = x W^T + b`` with ``W`` = the ``parts`` concatenated along the output dimension.

    Args:
        in_features: the input width (of the whole, unsharded layer).
        parts: the checkpoint projections fused into this layer, in row order.
        bias: whether the checkpoint projections have a bias.
        prefix: the layer's own name (a fused layer's first part by default), for errors and
            the quantisation config's ignore lists.
        quant_config: picks the linear method (None: float); ``method`` overrides it.
        ops: the op backend (:func:`fastinfer.ops.backend`), used by quantised methods.
        tp: tensor-parallel rank layout.
        part_shards: column-parallel only: per part ``(index, count)``: the part's rows are split
            into ``count`` slices and this rank holds slice ``index`` (default ``(rank, world_size)``;
            fewer slices than ranks replicate them, K/V heads under GQA).
    """

    parallel = "replicated"  # "column" | "row" in the subclasses

    def __init__(self, in_features: int, parts: Sequence[WeightPart], bias: bool, *, dtype: torch.dtype,
                 device, ops, prefix: Optional[str] = None, quant_config: Optional[QuantizationConfig] = None,
                 method: Optional[LinearMethod] = None, tp: ParallelInfo = SINGLE,
                 part_shards: Optional[Sequence[Tuple[int, int]]] = None):
        super().__init__()
        self.parts: List[WeightPart] = list(parts)
        self.prefix = prefix or self.parts[0].prefix
        self.tp = tp
        self.full_in_features = int(in_features)
        self.dtype = dtype
        self.device = torch.device(device)
        self.ops = ops
        ws = tp.world_size
        self.part_shards: List[Tuple[int, int]] = [(0, 1)] * len(self.parts)
        if self.parallel == "column":
            self.part_shards = [tuple(x) for x in part_shards] if part_shards else [(tp.rank, ws)] * len(self.parts)
            for p, (_, n) in zip(self.parts, self.part_shards):
                if p.rows % n:
                    raise ValueError(f"{p.prefix}: {p.rows} output features do not split over {n} ranks "
                                     f"(tensor_parallel_size={ws})")
            self.part_rows = [p.rows // n for p, (_, n) in zip(self.parts, self.part_shards)]
            self.in_features = self.full_in_features
        else:
            if self.parallel == "row" and self.full_in_features % ws:
                raise ValueError(f"{self.prefix}: {in_features} input features do not split over {ws} ranks "
                                 f"(tensor_parallel_size={ws})")
            self.part_rows = [p.rows for p in self.parts]
            self.in_features = self.full_in_features // ws if self.parallel == "row" else self.full_in_features
        self.out_features = sum(self.part_rows)
        self.bias = param((self.out_features,), dtype, device) if bias else None
        if method is None:
            method = quant_config.linear_method(self) if quant_config is not None else UnquantizedLinearMethod()
        self.method = method
        self.method.create_weights(self)

    # ---- sharding -------------------------------------------------------------------------------
    def full_shape(self, part: WeightPart) -> Tuple[int, int]:
        """Shape of ``part``'s weight in the checkpoint (unsharded)."""
        return (part.rows, self.full_in_features)

    def row_shard(self, i: int) -> Optional[Tuple[int, int]]:
        """``(start, length)`` of this rank's rows of part ``i`` (None: all of them)."""
        index, count = self.part_shards[i]
        if count == 1:
            return None
        n = self.parts[i].rows // count
        return (index * n, n)

    def col_shard(self) -> Optional[Tuple[int, int]]:
        """``(start, length)`` of this rank's input features (None: all of them)."""
        if self.parallel != "row" or self.tp.world_size == 1:
            return None
        return (self.tp.rank * self.in_features, self.in_features)

    @property
    def is_sharded(self) -> bool:
        return self.col_shard() is not None or any(n > 1 for _, n in self.part_shards)

    def replace_method(self, method: LinearMethod) -> None:
        """Switch to another method before loading (a layer a quantised checkpoint left in float)."""
        for name in ("weight", "packed"):
            if hasattr(self, name):
                delattr(self, name)
        self.method = method
        method.create_weights(self)

    # ---- loading --------------------------------------------------------------------------------
    def load_from(self, reader: WeightReader) -> None:
        self.method.load_weights(self, reader)
        if self.bias is None:
            for part in self.parts:  # AutoGPTQ writes all-zero biases for layers that have none
                name = part.prefix + ".bias"
                if reader.has(name) and bool(torch.count_nonzero(reader.get(name))):
                    raise ValueError(f"tensor {name!r} is a non-zero bias but the model has no bias there")
        else:
            with torch.no_grad():
                off = 0
                for i, (part, rows) in enumerate(zip(self.parts, self.part_rows)):
                    b = reader.get_float(part.prefix + ".bias", (part.rows,))
                    if self.row_shard(i) is not None:
                        b = b.narrow(0, *self.row_shard(i))
                    elif self.parallel == "row" and self.tp.rank != 0:
                        b = torch.zeros_like(b)  # row-parallel: the bias is added once, by rank 0
                    self.bias.narrow(0, off, rows).copy_(b.to(device=self.device, dtype=self.dtype))
                    off += rows

    def checkpoint_tensors(self) -> Iterable[Tuple[str, Tensor]]:
        yield from self.method.checkpoint_tensors(self)
        if self.bias is not None:
            off = 0
            for part, rows in zip(self.parts, self.part_rows):
                yield part.prefix + ".bias", self.bias.detach().narrow(0, off, rows)
                off += rows

    def forward(self, x: Tensor) -> Tensor:
        return self.method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, method={self.method.describe(self)}, parallel={self.parallel}")


class ReplicatedLinear(Linear):
    """The whole weight on every rank (lm_head without vocab parallelism, small layers)."""

    parallel = "replicated"


class ColumnParallelLinear(Linear):
    """Output rows split over ranks, each part separately (q/k/v, gate/up): no communication."""

    parallel = "column"


class RowParallelLinear(Linear):
    """Input columns split over ranks (o_proj, down_proj): the partial outputs are summed over ranks
    (one all-reduce; none at world size 1)."""

    parallel = "row"

    def forward(self, x: Tensor) -> Tensor:
        y = self.method.apply(self, x, self.bias)
        if self.tp.world_size > 1:
            self.tp.comm.all_reduce(y)
        return y
