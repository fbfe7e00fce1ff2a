"""The model runner: what every tensor-parallel rank runs, the same on each (SPMD).

A :class:`ModelRunner` holds one rank's shard of the target model, its paged KV pool (the same
block count on every rank: the scheduler's view is rank 0's) and its decode CUDA graphs, and runs
a :class:`ForwardPlan`: a tensor-free description of one target forward (prefill chunks, decode
rows, speculative trees with their masks, by sequence id and block table) plus the KV slot moves
of the last verification, applied first. Rank 0's executor makes the plans; workers receive them
(:mod:`.workers`) and run them through their own runner, so every rank takes the same branch
(graph or eager) and meets the same collectives in the same order.

Under pipeline parallelism each stage's ranks hold that stage's layers and their KV caches
(:mod:`fastinfer.distributed.pipeline`): every rank still receives every plan and builds the same
batch; a stage after the first receives the hidden state and the residual stream from the one
before it, runs its layers and sends them on; the last stage computes the logits and its
tensor-parallel rank 0 sends them to rank 0. Decode steps run eagerly there (no CUDA graphs).

At world size 1 this is simply the executor's model half.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..distributed import SINGLE, ParallelInfo, model_parallel
from ..distributed.pipeline import WHOLE_MODEL, pipeline_stage
from ..layers import BatchBuilder, TensorDictReader
from ..layers.moe import expert_shard
from ..models import LlamaForCausalLM, ModelConfig, load_config, load_model
from ..models.llama import attention_shards
from ..quant import resolve_quantization
from .checkpoints import load_checkpoint
from .config import EngineConfig
from .cuda_graphs import DecodeGraphs
from .kv_sizing import KVSizing, MemoryPool, activation_bytes, size_kv_pools
from .speculative.drafter import move_slots

__all__ = ["ForwardPlan", "Chunk", "ModelRunner", "check_split", "load_checkpoint", "load_line", "nvtx_range"]

Tensor = torch.Tensor


def nvtx_range(name: str, enabled: bool):
    """``torch.cuda.nvtx.range`` on CUDA, a no-op elsewhere."""
    import contextlib

    return torch.cuda.nvtx.range(name) if enabled else contextlib.nullcontext()


def load_line(config: EngineConfig) -> str:
    """The line the runner prints when it starts loading a checkpoint with ``load_progress`` on
    (the commands do): what loads, on which device, in which dtype and why that dtype."""
    from .. import cpu_has_native_bf16

    dtype = str(config.model_dtype).replace("torch.", "")
    if config.dtype is not None:
        why = "dtype given"
    elif config.device.type == "cpu":
        why = "dtype auto: this CPU " + ("computes bfloat16 natively" if cpu_has_native_bf16()
                                         else "has no native bfloat16")
    else:
        why = "dtype auto"
    return f"fastinfer: loading {config.model} on {config.device.type}, {dtype} ({why})"


def check_split(model_config: ModelConfig, config: EngineConfig) -> None:
    """A ValueError for a model that does not split as ``config`` asks (heads over the tensor-parallel
    ranks, experts over the expert-parallel ones); rank 0 checks before it starts any process."""
    attention_shards(model_config, ParallelInfo(0, config.tensor_parallel_size))
    ep = config.expert_parallel_size
    if ep > 1:
        if model_config.num_experts == 0:
            raise ValueError(f"expert_parallel_size={ep} needs a mixture-of-experts model; "
                             f"{model_config.architecture} has no experts")
        expert_shard(model_config.num_experts, ParallelInfo(0, ep))


@dataclass
class Chunk:
    """New tokens of one sequence at cache positions ``start ..`` (a prompt chunk, or a speculative
    tree: rotary ``positions`` = start + depth and a bool ``mask [q, q]``); ``logits`` as in
    :meth:`~fastinfer.layers.BatchBuilder.prefill`."""

    seq_id: int
    tokens: List[int]
    start: int
    logits: str = "last"
    positions: Optional[List[int]] = None
    mask: Optional[Tensor] = None


@dataclass
class ForwardPlan:
    chunks: List[Chunk] = field(default_factory=list)
    decodes: List[Tuple[int, int, int]] = field(default_factory=list)  # (seq_id, token, position)
    trees: List[Chunk] = field(default_factory=list)  # speculative verification, every row with logits
    tables: Dict[int, List[int]] = field(default_factory=dict)  # seq_id -> block table
    want_hidden: object = False  # rank 0 also wants the final hidden states: of the logits rows, or "all" rows
    hidden_layers: Tuple[int, ...] = ()  # instead of the final ones: these layers' inputs, concatenated (EAGLE-3)
    moves: Tuple[List[int], List[int]] = ((), ())  # target KV slot moves (src, dst), applied first
    finished: List[int] = field(default_factory=list)  # seq ids no later plan mentions
    # seq_id -> state slot (hybrid models; every rank holds its heads' share of each slot)
    state_slots: Dict[int, int] = field(default_factory=dict)
    # hybrid models' prefix cache: (source, destination) state-slot copies, in order, applied first
    state_copies: List[Tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.decodes and not self.trees


class ModelRunner:
    """One rank's target model, KV pool and decode graphs (see the module docstring).

    ``tp``: this process's place among the engine's processes (every rank runs this runner); the
    model is built with :func:`~fastinfer.distributed.model_parallel` of it (tensor- and / or
    expert-parallel, as the config says); with ``pipeline_parallel_size > 1`` it is this rank's
    stage's group and ``tp.pipeline`` its pipeline group (``stage``: the stage it builds).

    After construction: ``model``, ``device``, ``model_max_len``, ``kv_cache_dtype`` (the pool's
    torch dtype: the ``kv_cache_dtype`` option resolved against the model's dtype); after
    :meth:`init_kv`: ``kv_caches``, ``num_kv_blocks``, ``max_model_len``.
    """

    def __init__(self, config: EngineConfig, tp: ParallelInfo = SINGLE):
        self.config = config
        self.tp = tp
        self.model_parallel = model_parallel(tp, config.tensor_parallel_size, config.expert_parallel_size)
        self.stage = WHOLE_MODEL if config.pipeline_parallel_size == 1 else pipeline_stage(
            load_config(config.model).num_hidden_layers, config.pipeline_parallel_size, config.pipeline_partition,
            tp.pipeline)
        self.is_driver = tp.rank == 0 and self.stage.is_first  # rank 0: the scheduler's process
        self._num_stage_forwards = 0
        self.stage_busy_s = 0.0  # seconds this stage computed (its layers, not waiting): bench/pp.py
        self.block_size = config.block_size
        self.model = self._load_target(config)
        self.device = self.model.device
        self.use_nvtx = self.device.type == "cuda"
        self.model_max_len = int(self.model.max_positions)
        self.kv_cache_dtype = config.kv_cache_torch_dtype(self.model.dtype)
        self.kv_caches: List = []
        self.num_kv_blocks = 0
        self.max_model_len = min(self.model_max_len, config.max_model_len or self.model_max_len)
        self.decode_graphs: Optional[DecodeGraphs] = None
        # a hybrid model's linear-attention state: its slots, as many as the sizing gives (init_kv)
        self.is_hybrid = bool(self.model.config.is_hybrid)
        self.num_state_slots = 0
        self._chains = None  # a hybrid model's last verification (see commit_chains)

    def _load_target(self, c: EngineConfig) -> LlamaForCausalLM:
        dev = c.device
        if dev.type == "cuda" and self.tp.world_size > 1:
            dev = torch.device("cuda", torch.cuda.current_device())
        if isinstance(c.model, str):
            if self.tp.world_size > 1:
                check_split(load_config(c.model), c)
            if c.load_progress and self.is_driver:
                print(load_line(c), file=sys.stderr, flush=True)
            model = load_checkpoint(c.model, c.model_dtype, dev, c.max_model_len, c.ops_backend(),
                                    c.quant_options, c.load_progress and self.is_driver, self.model_parallel,
                                    c.gguf_weights, self.stage, c.fp4_weights)
        else:
            model = c.model
            ops = c.ops_backend(model.op_namespace)
            if c.quant_options is not None or model.ops is not ops or model.dtype != c.model_dtype:
                # an already built float model, to quantise, of another mode or in another dtype:
                # rebuilt (the mode is fixed when a model is built), the given one left as it is
                qc = resolve_quantization(model.config, c.quant_options) if c.quant_options is not None else None
                model = load_model(TensorDictReader(dict(model.checkpoint_tensors()), "the given model"),
                                   config=model.config, dtype=c.model_dtype, device=model.device,
                                   max_positions=model.max_positions, quant_config=qc, ops=ops)
        model.pack_linears_for_cpu()  # CPU bf16 only: oneDNN-blocked weights
        return model

    # ---- KV pool ------------------------------------------------------------------------------
    def kv_pools(self) -> List[MemoryPool]:
        """What this rank's KV blocks cost (:mod:`.kv_sizing`): the target's K and V over its layers
        (and a hybrid model's linear-attention state, per sequence)."""
        pools = [MemoryPool("target KV", self.model.kv_cache_bytes_per_block(self.block_size, self.kv_cache_dtype))]
        if self.is_hybrid:
            pools.append(MemoryPool("linear-attention state", bytes_per_seq=self.model.state_bytes_per_seq()))
        return pools

    def local_kv_sizing(self, extra_pools: Sequence[MemoryPool] = ()) -> KVSizing:
        """The KV blocks this rank has room for (``extra_pools``: rank 0's draft pool, indexed by the
        same block ids, charged against the same budget)."""
        c, m = self.config, self.model
        device_memory, activation = None, 0
        # (a hybrid model's state slots are a share of the device's budget even with num_kv_blocks given)
        if self.device.type == "cuda" and c.kv_cache_bytes is None and (c.num_kv_blocks is None or self.is_hybrid):
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            device_memory = torch.cuda.mem_get_info(self.device)
            mc = m.config
            activation = activation_bytes(mc.hidden_size, mc.intermediate_size, mc.q_size, mc.kv_size,
                                          mc.vocab_size, torch.empty((), dtype=m.dtype).element_size(),
                                          c.max_num_batched_tokens, c.max_num_seqs)
        return size_kv_pools(self.kv_pools() + list(extra_pools), block_size=c.block_size,
                             max_num_seqs=c.max_num_seqs, max_model_len=self.max_model_len,
                             num_kv_blocks=c.num_kv_blocks, kv_cache_bytes=c.kv_cache_bytes,
                             gpu_memory_utilization=c.gpu_memory_utilization, device_memory=device_memory,
                             activation=activation, slots_per_seq=self.state_slots_per_seq)

    @property
    def state_slots_per_seq(self) -> int:
        """A hybrid model's state slots per ``max_num_seqs``: its own (and with speculation its state
        before a verification), and with prefix caching as many again for snapshots."""
        return (2 if self.config.speculative else 1) * (2 if self.config.enable_prefix_caching else 1)

    def local_num_kv_blocks(self, extra_pools: Sequence[MemoryPool] = ()) -> int:
        return self.local_kv_sizing(extra_pools).num_blocks

    def agreed_kv_sizing(self, extra_pools: Sequence[MemoryPool] = ()) -> KVSizing:
        """The sizing of the pool every rank uses (one rank: its own)."""
        return self.local_kv_sizing(extra_pools)

    def init_kv(self, num_blocks: int, num_state_slots: Optional[int] = None) -> None:
        """Allocate the pool of ``num_blocks`` blocks (every rank the same) and a hybrid model's state
        slots (None: ``max_num_seqs``); capture graphs (CUDA, unless ``enforce_eager`` or EP)."""
        c = self.config
        self.num_kv_blocks = int(num_blocks)
        if self.is_hybrid:
            self.num_state_slots = int(c.max_num_seqs if num_state_slots is None else num_state_slots)
        self.max_model_len = min(self.max_model_len, self.num_kv_blocks * self.block_size)
        state = dict(num_state_slots=self.num_state_slots) if self.num_state_slots else {}
        self.kv_caches = self.model.allocate_kv_cache(self.num_kv_blocks, self.block_size, self.kv_cache_dtype, **state)
        # expert parallelism reads its exchange sizes on the host, which a CUDA graph cannot replay;
        # a pipeline stage's forward is not the whole model's a graph captures
        # (a hybrid model's decode rows also name state slots, which the graphs do not take: eager)
        if (self.device.type == "cuda" and not c.enforce_eager and self.model_parallel.ep is None
                and self.stage.num_stages == 1 and not self.num_state_slots):
            self.enable_decode_graphs(min(c.max_num_seqs, c.max_cuda_graph_batch_size),
                                      -(-self.max_model_len // self.block_size), True)

    def enable_decode_graphs(self, max_batch: int, max_blocks: int, use_graphs: bool) -> DecodeGraphs:
        """Capture decode graphs for batch buckets up to ``max_batch`` (``use_graphs=False``: the
        same static-buffer path run eagerly, for tests without a GPU)."""
        graphs = DecodeGraphs(self.model, self.kv_caches, max_batch, max_blocks, self.device, use_graphs)
        with nvtx_range("capture decode graphs", self.use_nvtx):
            graphs.capture()
        self.decode_graphs = graphs
        return graphs

    def move_slots(self, src: List[int], dst: List[int]) -> None:
        move_slots(self.model.ops, self.kv_caches, list(src), list(dst), self.device)

    # ---- one forward --------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, plan: ForwardPlan) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """Run ``plan``: ``(float32 logits, hidden states or None)`` of its logits rows (chunk rows
        in chunk order, the decode rows, then the trees' rows). Under TP the logits are rank 0's;
        other ranks get None."""
        return self.collect(self.submit(plan))

    def collect(self, pending) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """The result of :meth:`submit`: under pipeline parallelism rank 0 waits for the logits here."""
        if callable(pending):  # a posted receive of the last stage's logits
            return pending(), None
        return pending

    @torch.inference_mode()
    def submit(self, plan: ForwardPlan):
        """Start ``plan``; :meth:`collect` gives its result. Under pipeline parallelism rank 0 returns
        once its stage has sent the hidden state on (the next plan can start while the later stages
        run this one); otherwise the forward is done here."""
        self.move_slots(*plan.moves)
        if plan.state_copies:
            self.model.copy_state_slots(self.kv_caches, plan.state_copies)
        if plan.is_empty:
            return None, None
        b = BatchBuilder(self.block_size, self.device)
        slots = plan.state_slots
        for c in plan.chunks:
            b.prefill(c.tokens, c.start, plan.tables[c.seq_id], positions=c.positions, mask=c.mask, logits=c.logits,
                      state_slot=slots.get(c.seq_id))
        for sid, tok, pos in plan.decodes:
            b.decode(tok, pos, plan.tables[sid], state_slot=slots.get(sid))
        for c in plan.trees:  # (a hybrid model's chain continues from its state slot)
            b.prefill(c.tokens, c.start, plan.tables[c.seq_id], positions=c.positions, mask=c.mask, logits=c.logits,
                      state_slot=slots.get(c.seq_id))
        g = self.decode_graphs
        logits, hidden = None, None
        if self.stage.num_stages > 1:
            if plan.want_hidden:  # (EngineConfig refuses the methods that read them)
                raise ValueError("the target's hidden states are not returned under pipeline parallelism")
            with nvtx_range(f"stage {self.stage.index}", self.use_nvtx):
                pending = self._stage_forward(b.build())
            return pending if self.is_driver else (None, None)
        if (not plan.chunks and not plan.trees and not plan.want_hidden and g is not None
                and g.fits(len(plan.decodes), max(len(plan.tables[s]) for s, _, _ in plan.decodes))):
            with nvtx_range(f"decode graph B={len(plan.decodes)}", self.use_nvtx):
                logits = g.run(*b.decode_rows())
        else:
            batch = b.build()
            if self.is_hybrid and plan.trees:  # (the chain rows follow the chunks' rows)
                self._chains = self.model.keep_chain_inputs(batch, sum(len(c.tokens) for c in plan.chunks),
                                                            [(c.seq_id, len(c.tokens)) for c in plan.trees])
            name = "decode" if not plan.chunks else ("prefill" if not plan.decodes else "mixed")
            if plan.trees:
                name = "verify" if not plan.chunks and not plan.decodes else "mixed+verify"
            with nvtx_range(f"{name} T={batch.num_tokens}", self.use_nvtx):
                if not plan.want_hidden:
                    logits = self.model(batch, self.kv_caches)
                else:
                    hidden, aux = self.model.aux_hidden_states(batch, self.kv_caches, plan.hidden_layers)
                    logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
                    if plan.hidden_layers:
                        hidden = aux
                    if plan.want_hidden != "all":
                        hidden = hidden.index_select(0, batch.logits_indices)
        if not self.is_driver:
            return None, None
        return logits, hidden

    def commit_chains(self, kept: Dict[int, Tuple[int, int, int]]) -> None:
        """After a hybrid model's verification (:meth:`~fastinfer.models.Qwen3_5ForCausalLM.commit_chains`)."""
        self.model.commit_chains(self.kv_caches, self._chains, kept)

    def _stage_forward(self, batch):
        """This pipeline stage's part of a forward (see the module docstring). Rank 0 posts the
        receive of the logits after the send of the hidden state (NCCL runs a pair's messages in
        posting order on one stream: the other order would deadlock) and returns the function that
        waits for them; other ranks None. A forward's messages carry its number as their tag."""
        st, comm, m = self.stage, self.stage.comm, self.model
        tag = self._num_stage_forwards % (1 << 30)
        self._num_stage_forwards += 1
        x = residual = None
        if not st.is_first:
            buf = torch.empty((2, batch.num_tokens, m.config.hidden_size), dtype=m.dtype, device=self.device)
            comm.recv(buf, st.index - 1, tag)
            x, residual = buf[0], buf[1]
        t0 = time.perf_counter()
        x, residual = m.stage_layers(batch, self.kv_caches, x, residual)
        if not st.is_last:
            self.stage_busy_s += time.perf_counter() - t0
            comm.post_send(torch.stack([x, residual]), st.index + 1, tag)  # (the next stage may be busy)
            if not self.is_driver:
                return None
            out = torch.empty((batch.logits_indices.numel(), m.config.vocab_size), dtype=torch.float32,
                              device=self.device)
            return comm.post_recv(out, st.num_stages - 1, tag)
        out = m.final_logits(batch, x, residual)  # (every rank of the stage: the gather under TP)
        self.stage_busy_s += time.perf_counter() - t0
        if self.tp.rank == 0:
            comm.send(out, 0, tag)
        return None
