"""The mixture-of-experts MLP: a router, top-k routing (``moe_topk``) and the experts' MLPs
(``fused_moe``, or ``fused_moe_fp8`` / ``fused_moe_int4`` / ``fused_moe_fp4`` for quantised experts), loading the
experts from a checkpoint's per-expert tensors.

Checkpoint layouts. Hub checkpoints (and transformers 5's ``save_pretrained``, which converts back to
them) hold one tensor per expert and projection: ``{prefix}.experts.{e}.{gate}.weight`` ``[I, H]``,
``{up}`` ``[I, H]``, ``{down}`` ``[H, I]`` (Mixtral: ``block_sparse_moe.experts.{e}.w1 / w3 / w2``;
Qwen-MoE: ``mlp.experts.{e}.gate_proj / up_proj / down_proj``) and the router
``{prefix}.gate.weight`` ``[E, H]``. Transformers 5's modules stack them instead
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``, Mixtral's
``block_sparse_moe`` renamed ``mlp``): :class:`StackedExpertsReader` shows such tensors under the
per-expert names, so a layer reads one layout.

Quantisation. How the experts are held and run is the layer's :class:`FusedMoEMethod`, chosen by the
model's :class:`~fastinfer.layers.QuantizationConfig` (``moe_method``) as a linear's method is:
:class:`UnquantizedFusedMoEMethod` (float ``w13`` / ``w2``, ``fused_moe``) here, fp8 experts
(e4m3 with per-channel or 128 x 128 block scales, ``fused_moe_fp8``), int4 experts (group-wise,
``fused_moe_int4``) and FP4 experts (NVFP4 / MXFP4 as checkpoints store them, ``fused_moe_fp4``) in
:mod:`fastinfer.quant` (``Fp8FusedMoEMethod``, ``Int4FusedMoEMethod``, ``Fp4FusedMoEMethod``, their
formats documented there). A method says which activations and whether biases its op runs
(``FusedMoEMethod.activations`` / ``biases``); a layer asking for more is refused when built. The
router is float whatever the config says (:class:`RouterMethod`: an fp8 router a checkpoint stored
anyway is dequantised).

Tensor parallelism: every rank holds all experts, each expert's intermediate dimension split over
the ranks (its gate and up rows sliced alike, its down columns; fp8 scales with them), so a rank's
``fused_moe`` output is a partial sum over the intermediate dimension, summed by one all-reduce (as
``RowParallelLinear``). The router is replicated.

Expert parallelism (``tp.ep``, N ranks): rank r holds experts ``[r E / N, (r + 1) E / N)`` whole
(:func:`expert_shard`). Every rank holds every token's hidden state (after attention's all-reduce,
or from attention run whole) and routes all of them (the router's GEMM on the batch one process
runs it on, so the same bits), and is the *home* of a contiguous share of the tokens
(``ceil(T / N)`` each). Per layer:

1. the home ranks' (token, slot) counts per owner rank, all-gathered (an ``[N, N]`` matrix: the
   split sizes of both exchanges, and each owner's load, :attr:`FusedMoE.routed_slots`);
2. dispatch (all-to-all): each of the home's slots goes to the rank owning its expert as the
   token's hidden row and the expert's local id (one packed row);
3. the owner runs its experts (``fused_moe``, or the method's op) on what it received, one slot
   per row with weight 1: the expert's output itself, unweighted;
4. combine (all-to-all back): the home sums its tokens' slot outputs times their weights in float32
   in slot order (``fused_moe``'s own order), rounds once, and the shares are all-gathered (with
   ``reduce_results=False`` under tensor parallelism over the same ranks, each rank returns its
   share in its rows and zeros elsewhere: the caller's all-reduce gathers them).

``fused_moe`` is batch invariant (a row's output depends on that row alone; ``fused_moe_fp8`` too:
a row's quantisation is its own), and a slot output in the activation dtype is what the op itself
sums (its contract rounds each slot's y to that dtype), so a token's output is bit for bit the
one-process op's on the CPU, whose sum has no fused multiply-add. gloo (CPU)
and NCCL both implement ``all_to_all_single`` with uneven splits. Four collectives per layer, the
sizes read on the host: not capturable in a CUDA graph (decode steps run eagerly,
:class:`~fastinfer.engine.model_runner.ModelRunner`).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from ..distributed import SINGLE, ParallelInfo
from .linear import QuantizationConfig, ReplicatedLinear, UnquantizedLinearMethod, WeightPart, param
from .weights import CheckpointModule, WeightReader

Tensor = torch.Tensor

__all__ = ["FusedMoE", "FusedMoEMethod", "UnquantizedFusedMoEMethod", "RouterMethod", "ExpertProjections",
           "StackedExpertsReader", "expert_shard", "expert_parallel_layers", "routed_slots_per_rank"]


def expert_shard(num_experts: int, ep: ParallelInfo) -> Tuple[int, int]:
    """``(first expert, experts)`` rank ``ep.rank`` holds: a contiguous ``1 / ep.world_size`` of them."""
    n = ep.world_size
    if num_experts % n:
        raise ValueError(f"{num_experts} experts do not split over expert_parallel_size={n} (each rank holds "
                         f"num_experts / {n} of them)")
    return ep.rank * (num_experts // n), num_experts // n


def expert_parallel_layers(model: nn.Module) -> List["FusedMoE"]:
    """The model's expert-parallel :class:`FusedMoE` layers (none without expert parallelism)."""
    return [m for m in model.modules() if isinstance(m, FusedMoE) and m.ep is not None]


def routed_slots_per_rank(layers: Sequence["FusedMoE"]) -> Optional[List[int]]:
    """The (token, expert) slots each expert-parallel rank's experts processed, summed over
    ``layers`` (:func:`expert_parallel_layers`) since they were built: every layer counts every
    rank's slots, from the exchange sizes. None without such layers."""
    return [sum(c) for c in zip(*(m.routed_slots for m in layers))] if layers else None


class ExpertProjections(NamedTuple):
    """The names of one expert's three projections in a checkpoint (``experts.{e}.<name>.weight``)."""

    gate: str
    up: str
    down: str


class RouterMethod(UnquantizedLinearMethod):
    """The router's weight in the model dtype: routing decides which experts run, so it is never
    quantised. A checkpoint whose quantisation config named the router anyway stores it in
    float8_e4m3fn with a ``weight_scale`` (per row ``[E, 1]`` / ``[E]``, per tensor ``[1]``) or a
    ``weight_scale_inv`` (per 128 x 128 block): it is dequantised, ``codes * scale`` in float64 and
    rounded once (a static ``input_scale`` beside it is not used: the router's input stays float). A
    column-parallel layer keeps its rank's rows of the dequantised weight."""

    def load_weights(self, layer: ReplicatedLinear, reader: WeightReader) -> None:
        prefix = layer.parts[0].prefix
        name = prefix + ".weight"
        if not reader.has(name) or reader.get(name).dtype != torch.float8_e4m3fn:
            return super().load_weights(layer, reader)
        n, k = layer.parts[0].rows, layer.in_features
        codes = reader.get(name, (n, k)).double()
        blocks = (-(-n // 128), -(-k // 128))
        scale = None
        for suffix, shapes in (("weight_scale", [(n, 1), (n,), (1,), (), (1, 1)]), ("weight_scale_inv", [blocks])):
            if reader.has(f"{prefix}.{suffix}"):
                shape = tuple(reader.shape(f"{prefix}.{suffix}"))
                if shape not in shapes:
                    raise ValueError(f"tensor '{prefix}.{suffix}' has shape {list(shape)}, expected "
                                     f"{' or '.join(str(list(x)) for x in shapes)}")
                scale = reader.get(f"{prefix}.{suffix}").double()
                if suffix == "weight_scale_inv":  # [n, k]
                    scale = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
                else:  # [n, 1] or [1, 1]
                    scale = scale.reshape(-1, 1)
                break
        if scale is None:
            raise ValueError(f"tensor {name!r} is float8_e4m3fn but {prefix!r} has no weight_scale or "
                             "weight_scale_inv to dequantise it with")
        if reader.has(prefix + ".input_scale"):
            reader.skip(prefix + ".input_scale")
        w = codes * scale
        if layer.row_shard(0) is not None:
            w = w.narrow(0, *layer.row_shard(0))
        with torch.no_grad():
            layer.weight.copy_(w.to(layer.dtype))


class FusedMoEMethod:
    """How a :class:`FusedMoE` holds its experts and runs them (the experts' counterpart of a
    :class:`~fastinfer.layers.LinearMethod`, chosen by the :class:`QuantizationConfig`).

    ``create_weights`` registers this rank's expert tensors (before loading), ``load_weights``
    fills them from a reader (this rank's experts, each its :attr:`FusedMoE.intermediate_shard`),
    ``apply`` runs the experts on rows ``x [T, H]`` routed by ``topk_weights`` / ``topk_ids``
    (local expert ids) and returns the weighted sum ``[T, H]`` in x's dtype.
    """

    name = "float"
    tensor_names: Tuple[str, ...] = ()  # what create_weights sets on the layer
    # what the method's op runs: fused_moe's activations, and the experts' biases
    activations: Tuple[str, ...] = ("silu",)
    biases = False

    def create_weights(self, layer: "FusedMoE") -> None:
        raise NotImplementedError

    def remove_weights(self, layer: "FusedMoE") -> None:
        for name in self.tensor_names:
            if hasattr(layer, name):
                delattr(layer, name)

    def load_weights(self, layer: "FusedMoE", reader: WeightReader) -> None:
        raise NotImplementedError

    def apply(self, layer: "FusedMoE", x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        raise NotImplementedError

    def checkpoint_tensors(self, layer: "FusedMoE") -> Iterable[Tuple[str, Tensor]]:
        raise ValueError(f"{layer.prefix}: {self.name} experts cannot be exported as float checkpoint tensors")

    def describe(self, layer: "FusedMoE") -> str:
        return self.name


class UnquantizedFusedMoEMethod(FusedMoEMethod):
    """Float experts in the model dtype, ``w13 [E, 2I, H]`` (each expert's gate rows, then its up
    rows) and ``w2 [E, H, I]`` (and, on a layer with ``bias``, ``w13_bias [E, 2I]`` / ``w2_bias
    [E, H]`` from each projection's ``.bias``), run by ``fused_moe`` with the layer's activation.
    Under tensor parallelism the down projection's bias is held by rank 0 only (zeros elsewhere):
    the ranks' partial sums are added by the all-reduce."""

    tensor_names = ("w13", "w2", "w13_bias", "w2_bias")
    activations = ("silu", "swiglu_oai")
    biases = True

    def create_weights(self, layer: "FusedMoE") -> None:
        E, H, local = layer.num_local_experts, layer.hidden_size, layer.local_intermediate_size
        layer.w13 = param((E, 2 * local, H), layer.dtype, layer.device)
        layer.w2 = param((E, H, local), layer.dtype, layer.device)
        layer.w13_bias = param((E, 2 * local), layer.dtype, layer.device) if layer.bias else None
        layer.w2_bias = param((E, H), layer.dtype, layer.device) if layer.bias else None

    def load_weights(self, layer: "FusedMoE", reader: WeightReader) -> None:
        shard = layer.intermediate_shard
        for i, e in enumerate(layer.local_experts()):
            gate, up, down = layer.expert_projections(e)
            g = self.read_weight(reader, gate, layer.hidden_size, rows=shard)
            u = self.read_weight(reader, up, layer.hidden_size, rows=shard)
            d = self.read_weight(reader, down, layer.intermediate_size, cols=shard)
            layer.w13[i].copy_(torch.cat([g, u]).to(layer.w13.dtype))
            layer.w2[i].copy_(d.to(layer.w2.dtype))
            if layer.bias:
                gb = reader.get_float(gate.prefix + ".bias", (gate.rows,), rows=shard)
                ub = reader.get_float(up.prefix + ".bias", (up.rows,), rows=shard)
                db = reader.get_float(down.prefix + ".bias", (down.rows,))
                layer.w13_bias[i].copy_(torch.cat([gb, ub]).to(layer.w13_bias.dtype))
                if shard is not None and layer.tp.rank != 0:  # added once, by rank 0's partial sum
                    db = torch.zeros_like(db)
                layer.w2_bias[i].copy_(db.to(layer.w2_bias.dtype))

    def read_weight(self, reader: WeightReader, part: WeightPart, in_features: int, rows=None, cols=None) -> Tensor:
        """Float weight ``[part.rows, in_features]`` of one expert projection, cut to ``rows`` /
        ``cols`` (a subclass reads a quantised checkpoint's tensors and dequantises them)."""
        return reader.get_float(part.prefix + ".weight", (part.rows, in_features), rows=rows, cols=cols)

    def apply(self, layer: "FusedMoE", x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        return layer.ops.fused_moe(x, layer.w13, layer.w2, topk_weights, topk_ids, layer.activation,
                                   layer.swiglu_alpha, layer.swiglu_limit, layer.w13_bias, layer.w2_bias)

    def checkpoint_tensors(self, layer: "FusedMoE") -> Iterable[Tuple[str, Tensor]]:
        local, p = layer.local_intermediate_size, layer.projections
        for i, e in enumerate(layer.local_experts()):
            yield layer.expert_name(e, p.gate), layer.w13.detach()[i, :local]
            yield layer.expert_name(e, p.up), layer.w13.detach()[i, local:]
            yield layer.expert_name(e, p.down), layer.w2.detach()[i]
            if layer.bias:
                for proj, t in ((p.gate, layer.w13_bias[i, :local]), (p.up, layer.w13_bias[i, local:]),
                                (p.down, layer.w2_bias[i])):
                    yield layer.expert_name(e, proj)[: -len(".weight")] + ".bias", t.detach()


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
        tp: the tensor-parallel group; with ``tp.ep`` the experts split over that group instead
            (see the module docstring).
        reduce_results: sum the output over the tensor-parallel ranks (one all-reduce); False:
            return this rank's partial sum, for a caller that adds its own partial sums before
            reducing them all at once (Qwen2-MoE's shared expert).
        quant_config: chooses the experts' method (:meth:`QuantizationConfig.moe_method`).
        router_name: the router's module under ``prefix`` (``gate``; gpt-oss: ``router``); None: the
            layer has no router, its caller routes and calls :meth:`run_experts` (DeepSeek's
            grouped sigmoid routing).
        bias: the router and every expert projection carry a bias (gpt-oss).
        scoring: :func:`~fastinfer.ops.moe_topk`'s scoring (``"softmax"``; gpt-oss: ``"topk_softmax"``).
        activation, swiglu_alpha, swiglu_limit: :func:`~fastinfer.ops.fused_moe`'s activation
            (``"silu"``; gpt-oss: ``"swiglu_oai"`` with its alpha and limit).

    ``method`` (a :class:`FusedMoEMethod`, from ``quant_config``: float experts without one) holds
    this rank's experts (float: ``w13`` / ``w2``) and runs them; ``first_expert`` is the global id
    of the first. The router is float whatever ``quant_config`` says.
    ``routed_slots``: per expert-parallel rank, the slots its experts processed in this layer
    (empty without expert parallelism).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool,
                 prefix: str, projections: ExpertProjections, *, dtype: torch.dtype, device, ops,
                 tp: ParallelInfo = SINGLE, stacked_prefix: Optional[str] = None, reduce_results: bool = True,
                 quant_config: Optional[QuantizationConfig] = None, router_name: str = "gate", bias: bool = False,
                 scoring: str = "softmax", activation: str = "silu", swiglu_alpha: Optional[float] = None,
                 swiglu_limit: Optional[float] = None):
        super().__init__()
        self.ep = tp.ep if tp.ep is not None and tp.ep.world_size > 1 else None
        self.routed_slots: List[int] = []
        if self.ep is not None and tp.world_size not in (1, self.ep.world_size):
            raise ValueError(f"{prefix}: expert parallelism over {self.ep.world_size} ranks with tensor parallelism "
                             f"over {tp.world_size}: the experts split over the tensor-parallel ranks or without them")
        if self.ep is not None:  # whole experts, a share of them
            try:
                self.first_expert, self.num_local_experts = expert_shard(num_experts, self.ep)
            except ValueError as e:
                raise ValueError(f"{prefix}: {e}") from None
            local = intermediate_size
            self.routed_slots = [0] * self.ep.world_size
        else:  # every expert, a slice of each
            n = tp.world_size
            if intermediate_size % n:
                raise ValueError(f"{prefix}: the experts' intermediate size {intermediate_size} does not split over "
                                 f"{n} ranks (tensor_parallel_size={n})")
            local = intermediate_size // n
            self.first_expert, self.num_local_experts = 0, num_experts
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
        self.dtype, self.device = dtype, torch.device(device)
        self.bias, self.scoring, self.activation = bool(bias), scoring, activation
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        # routing decides which experts run: never quantised, whatever a quantisation config lists
        self.router = None if router_name is None else ReplicatedLinear(
            hidden_size, [WeightPart(f"{prefix}.{router_name}", num_experts)], self.bias, dtype=dtype, device=device,
            ops=ops, method=RouterMethod())
        method = quant_config.moe_method(self) if quant_config is not None else None
        self.method = UnquantizedFusedMoEMethod() if method is None else method
        if (self.bias and not self.method.biases) or activation not in self.method.activations:
            raise ValueError(f"{prefix}: {self.method.name} experts run SiLU experts without biases; these experts "
                             f"({activation}{', with biases' if self.bias else ''}) run in float or as FP4 "
                             "experts only")
        self.method.create_weights(self)

    def expert_name(self, expert: int, projection: str) -> str:
        return f"{self.prefix}.experts.{expert}.{projection}.weight"

    def expert_projections(self, expert: int) -> List[WeightPart]:
        """Expert ``expert``'s gate, up and down projections (checkpoint module, rows), unsharded."""
        p, H, I = self.projections, self.hidden_size, self.intermediate_size
        return [WeightPart(self.expert_name(expert, name)[: -len(".weight")], rows)
                for name, rows in ((p.gate, I), (p.up, I), (p.down, H))]

    @property
    def intermediate_shard(self) -> Optional[Tuple[int, int]]:
        """``(start, length)`` of this rank's slice of each expert's intermediate dimension (gate and
        up rows, down columns); None: all of it (one rank, or expert parallelism)."""
        if self.ep is not None or self.tp.world_size == 1:
            return None
        return (self.tp.rank * self.local_intermediate_size, self.local_intermediate_size)

    def replace_method(self, method: "FusedMoEMethod") -> None:
        """Switch to another method before loading (experts a quantised checkpoint left in float)."""
        self.method.remove_weights(self)
        self.method = method
        method.create_weights(self)

    def local_experts(self) -> range:
        """The global ids of this rank's experts."""
        return range(self.first_expert, self.first_expert + self.num_local_experts)

    def load_from(self, reader: WeightReader) -> None:
        """The experts (the router loads itself): this rank's experts, each whole (expert
        parallelism) or this rank's slice of its intermediate rows, read by the method; the other
        ranks' experts' tensors are skipped (their rank reads them)."""
        if self.ep is not None:
            head = f"{self.prefix}.experts."
            mine = self.local_experts()
            for name in list(reader.names()):
                if name.startswith(head):
                    expert = name[len(head):].split(".", 1)[0]
                    if expert.isdigit() and int(expert) not in mine:
                        reader.skip(name)
        with torch.no_grad():
            self.method.load_weights(self, reader)

    def checkpoint_tensors(self) -> Iterable[Tuple[str, Tensor]]:
        yield from self.method.checkpoint_tensors(self)

    def forward(self, x: Tensor) -> Tensor:
        # every token is routed on every rank, expert parallel or not: the router's GEMM runs on the
        # batch one process runs it on, so the routing has the same bits
        weights, ids = self.ops.moe_topk(self.router(x), self.top_k, self.renormalize, self.scoring)
        return self.run_experts(x, weights, ids)

    def run_experts(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """The experts' weighted sum for a routing already made: ``weights [T, top_k]`` float32 and
        ``ids [T, top_k]`` int32, as :func:`~fastinfer.ops.moe_topk` returns them."""
        if self.ep is not None:
            return self._expert_parallel(x, weights, ids)
        out = self.method.apply(self, x, weights, ids)
        if self.reduce_results and self.tp.world_size > 1:
            self.tp.comm.all_reduce(out)
        return out

    def _expert_parallel(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """Dispatch this rank's share of the tokens to the experts' owners, run the slots sent here,
        combine the share, all-gather the shares (the module docstring's steps 1-4)."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("expert parallelism reads the exchange sizes on the host: it cannot run inside a "
                               "CUDA graph (use enforce_eager=True)")
        comm, n, rank = self.ep.comm, self.ep.world_size, self.ep.rank
        T, H, k = x.shape[0], self.hidden_size, self.top_k
        share = -(-T // n)
        lo, hi = min(rank * share, T), min((rank + 1) * share, T)
        # this rank's slots s = (token - lo) * k + j, grouped by owner rank, in slot order within each
        slot_ids = ids[lo:hi].reshape(-1).long()
        owner = torch.div(slot_ids, self.num_local_experts, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        # 1. counts[home][owner]: each exchange's sizes on every rank, and every owner's load
        counts = comm.all_gather(torch.bincount(owner, minlength=n).view(1, n)).tolist()
        send = counts[rank]
        recv = [counts[home][rank] for home in range(n)]
        for r in range(n):
            self.routed_slots[r] += sum(counts[home][r] for home in range(n))
        # 2. dispatch: a slot travels as its token's row and its expert's local id, packed into one
        #    byte row so that one all-to-all carries both
        rows = x[lo:hi].index_select(0, torch.div(order, k, rounding_mode="floor"))
        local_ids = (slot_ids - owner * self.num_local_experts).index_select(0, order).to(torch.int32)
        row_bytes = H * x.element_size()
        packed = torch.cat([rows.contiguous().view(torch.uint8), local_ids.view(-1, 1).view(torch.uint8)], dim=1)
        got = comm.all_to_all(packed, send, recv)
        got_rows = got[:, :row_bytes].contiguous().view(x.dtype)
        got_ids = got[:, row_bytes:].contiguous().view(torch.int32)
        # 3. one slot per row, weight 1: the expert's output itself (exact in float32), so that the
        #    home can weight and sum a token's slots in fused_moe's order. Owners returning weighted
        #    partial sums instead would add the slots of a token split over ranks in another order
        #    (k >= 3: (s0 + s2) + s1 is not s0 + s1 + s2 in float32).
        unit = torch.ones(got_ids.shape, dtype=torch.float32, device=x.device)
        y = self.method.apply(self, got_rows, unit, got_ids)
        # 4. combine: back to the homes, into slot order, weighted and summed over j = 0 .. k-1 in
        #    order in float32 from zero, rounded once: fused_moe's sum, so the same bits. Separate
        #    multiply and add, each rounded, as fused_moe's (a fused multiply-add rounds once: other bits).
        back = comm.all_to_all(y, recv, send)
        slot_out = torch.empty_like(back).index_copy_(0, order, back).view(hi - lo, k, H)
        w = weights[lo:hi]
        acc = torch.zeros(hi - lo, H, dtype=torch.float32, device=x.device)
        for j in range(k):
            acc = acc + w[:, j:j + 1] * slot_out[:, j].float()
        if not self.reduce_results and self.tp.world_size > 1:
            # the caller all-reduces over these same ranks: this rank's share in its rows, zeros
            # elsewhere, is its partial sum (adding zeros is exact), and no all-gather is needed
            out = x.new_zeros(T, H)
            out[lo:hi] = acc.to(x.dtype)
            return out
        mine = x.new_zeros(share, H)
        mine[: hi - lo] = acc.to(x.dtype)
        return comm.all_gather(mine)[:T]

    def extra_repr(self) -> str:
        experts = (f"experts={self.num_local_experts} of {self.num_experts} (from {self.first_expert})"
                   if self.ep is not None else f"experts={self.num_experts}")
        return (f"{experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.local_intermediate_size} of {self.intermediate_size}, "
                f"renormalize={self.renormalize}, scoring={self.scoring}, activation={self.activation}, "
                f"bias={self.bias}, method={self.method.describe(self)}")


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
            if m.router is not None and router != m.router.prefix + ".weight" and base.has(router):
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
