"""The mixture-of-experts MLP: a router, top-k routing (``moe_topk``) and the experts' MLPs
(``fused_moe``), loading the experts from a checkpoint's per-expert tensors.

Checkpoint layouts. Hub checkpoints (and transformers 5's ``save_pretrained``, which converts back to
them) hold one tensor per expert and projection: ``{prefix}.experts.{e}.{gate}.weight`` ``[I, H]``,
``{up}`` ``[I, H]``, ``{down}`` ``[H, I]`` (Mixtral: ``block_sparse_moe.experts.{e}.w1 / w3 / w2``;
Qwen-MoE: ``mlp.experts.{e}.gate_proj / up_proj / down_proj``) and the router
``{prefix}.gate.weight`` ``[E, H]``. Transformers 5's modules stack them instead
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``, Mixtral's
``block_sparse_moe`` renamed ``mlp``): :class:`StackedExpertsReader` shows such tensors under the
per-expert names, so a layer reads one layout.

Tensor parallelism: every rank holds all experts, each expert's intermediate dimension split over
the ranks (its gate and up rows sliced alike, its down columns), so a rank's ``fused_moe`` output is
a partial sum over the intermediate dimension, summed by one all-reduce (as ``RowParallelLinear``).
The router is replicated.
"""

from __future__ import annotations

from typing import Dict, Iterable, NamedTuple, Optional, Sequence, Tuple

import torch

from ..distributed import SINGLE, ParallelInfo
from .linear import ReplicatedLinear, UnquantizedLinearMethod, WeightPart, param
from .weights import CheckpointModule, WeightReader

Tensor = torch.Tensor

__all__ = ["FusedMoE", "ExpertProjections", "StackedExpertsReader"]


class ExpertProjections(NamedTuple):
    """The names of one expert's three projections in a checkpoint (``experts.{e}.<name>.weight``)."""

    gate: str
    up: str
    down: str


class FusedMoE(CheckpointModule):
    """``sum over the top_k experts e of token x: weight_e * down_e(silu(gate_e(x)) * up_e(x))``, the
    experts chosen by the softmax of ``router(x)``.

    Args:
        hidden_size, intermediate_size: H and each expert's (unsharded) I.
        num_experts, top_k: E and the experts per token.
        renormalize: divide the top-k weights by their sum (Mixtral; Qwen's ``norm_topk_prob``).
        prefix: the checkpoint module holding ``gate`` (the router) and ``experts``.
        projections: the per-expert projection names.
        stacked_prefix: where transformers 5's modules keep the same layer (see
            :class:`StackedExpertsReader`); default ``prefix``.
        reduce_results: sum the output over the tensor-parallel ranks (one all-reduce); False:
            return this rank's partial sum, for a caller that adds its own partial sums before
            reducing them all at once (Qwen2-MoE's shared expert).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool,
                 prefix: str, projections: ExpertProjections, *, dtype: torch.dtype, device, ops,
                 tp: ParallelInfo = SINGLE, stacked_prefix: Optional[str] = None, reduce_results: bool = True):
        super().__init__()
        n = tp.world_size
        if intermediate_size % n:
            raise ValueError(f"{prefix}: the experts' intermediate size {intermediate_size} does not split over "
                             f"{n} ranks (tensor_parallel_size={n})")
        local = intermediate_size // n
        if hidden_size % 8 or local % 8:  # fused_moe's contract
            raise ValueError(f"{prefix}: fused_moe needs the hidden size ({hidden_size}) and each rank's expert "
                             f"intermediate size ({local}) to be multiples of 8")
        self.prefix = prefix
        self.stacked_prefix = prefix if stacked_prefix is None else stacked_prefix
        self.projections = projections
        self.hidden_size, self.intermediate_size, self.local_intermediate_size = hidden_size, intermediate_size, local
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp = tp
        self.reduce_results = reduce_results
        self.ops = ops
        # routing decides which experts run: never quantised
        self.router = ReplicatedLinear(hidden_size, [WeightPart(f"{prefix}.gate", num_experts)], False, dtype=dtype,
                                       device=device, ops=ops, method=UnquantizedLinearMethod())
        self.w13 = param((num_experts, 2 * local, hidden_size), dtype, device)  # gate rows, then up rows
        self.w2 = param((num_experts, hidden_size, local), dtype, device)

    def expert_name(self, expert: int, projection: str) -> str:
        return f"{self.prefix}.experts.{expert}.{projection}.weight"

    def load_from(self, reader: WeightReader) -> None:
        """The experts (the router loads itself): this rank's slice of each expert's intermediate rows."""
        H, I, local = self.hidden_size, self.intermediate_size, self.local_intermediate_size
        shard = None if self.tp.world_size == 1 else (self.tp.rank * local, local)
        p = self.projections
        with torch.no_grad():
            for e in range(self.num_experts):
                gate = reader.get_float(self.expert_name(e, p.gate), (I, H), rows=shard)
                up = reader.get_float(self.expert_name(e, p.up), (I, H), rows=shard)
                down = reader.get_float(self.expert_name(e, p.down), (H, I), cols=shard)
                self.w13[e].copy_(torch.cat([gate, up]).to(self.w13.dtype))
                self.w2[e].copy_(down.to(self.w2.dtype))

    def checkpoint_tensors(self) -> Iterable[Tuple[str, Tensor]]:
        local, p = self.local_intermediate_size, self.projections
        for e in range(self.num_experts):
            yield self.expert_name(e, p.gate), self.w13.detach()[e, :local]
            yield self.expert_name(e, p.up), self.w13.detach()[e, local:]
            yield self.expert_name(e, p.down), self.w2.detach()[e]

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = self.ops.moe_topk(self.router(x), self.top_k, self.renormalize, "softmax")
        out = self.ops.fused_moe(x, self.w13, self.w2, weights, ids, "silu")
        if self.reduce_results and self.tp.world_size > 1:
            self.tp.comm.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.local_intermediate_size} of {self.intermediate_size}, "
                f"renormalize={self.renormalize}")


class StackedExpertsReader(WeightReader):
    """A checkpoint whose experts are stacked (``{stacked}.experts.gate_up_proj [E, 2I, H]``, gate rows
    then up rows, and ``{stacked}.experts.down_proj [E, H, I]``, as transformers 5's modules hold them)
    seen under the per-expert names :class:`FusedMoE` reads; the router ``{stacked}.gate.weight`` is
    renamed to ``{prefix}.gate.weight`` alike. Layers stored per expert, and every other tensor, keep
    their names. Reading an expert reads its stacked tensor once per layer (the last one is kept)."""

    def __init__(self, base: WeightReader, layers: Sequence[FusedMoE]):
        super().__init__(base.description)
        self.base = base
        # our name -> (base name, expert or None, (first row, rows) or None)
        self._where: Dict[str, Tuple[str, Optional[int], Optional[Tuple[int, int]]]] = {
            name: (name, None, None) for name in base.names()}
        for m in layers:
            gate_up, down = f"{m.stacked_prefix}.experts.gate_up_proj", f"{m.stacked_prefix}.experts.down_proj"
            if not base.has(gate_up):
                continue
            I, p = m.intermediate_size, m.projections
            for e in range(m.num_experts):
                self._where[m.expert_name(e, p.gate)] = (gate_up, e, (0, I))
                self._where[m.expert_name(e, p.up)] = (gate_up, e, (I, I))
                self._where[m.expert_name(e, p.down)] = (down, e, None)
            for name in (gate_up, down):
                del self._where[name]
            router = f"{m.stacked_prefix}.gate.weight"
            if router != m.router.prefix + ".weight" and base.has(router):
                self._where[m.router.prefix + ".weight"] = self._where.pop(router)
        self._cached: Tuple[Optional[str], Optional[Tensor]] = (None, None)

    def names(self) -> Iterable[str]:
        return self._where.keys()

    def has(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> Tuple[int, ...]:
        base_name, expert, rows = self._where[name]
        shape = tuple(self.base.shape(base_name))
        if expert is None:
            return shape
        return shape[1:] if rows is None else (rows[1],) + shape[2:]

    def _read(self, name: str) -> Tensor:
        base_name, expert, rows = self._where[name]
        if expert is None:
            return self.base._read(base_name)
        if self._cached[0] != base_name:
            self._cached = (base_name, self.base._read(base_name))
        t = self._cached[1][expert]
        return t if rows is None else t.narrow(0, *rows)
