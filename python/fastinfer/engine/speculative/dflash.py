"""DFlash block drafting (z-lab, "DFlash: Block Diffusion for Flash Speculative Decoding",
https://arxiv.org/abs/2602.06036): a small drafter proposes a whole block of tokens in ONE forward,
conditioned on hidden states of several target layers; the target verifies the block.

With committed tokens ``t_0 .. t_{n-1}`` (the target has computed ``t_0 .. t_{n-2}``; ``t_{n-1}``,
the root, is the anchor), block size ``B`` and the drafter's layers (Qwen3 decoder layers: q/k
per-head norms, RMSNorm, SwiGLU)::

    context  c_p = hidden_norm(fc([s_{i_1}(p); ..; s_{i_m}(p)]))   p = 0 .. n - 2
             s_i(p): the output of target layer i at position p (ids ``target_layer_ids``)
    block    x_j = embed(t_{n-1}) for j = 0, embed(mask_token_id) for j = 1 .. B - 1,
             at rotary positions n - 1 + j
    per drafter layer (pre-norm, residual):
             q   from input_layernorm(x) of the block rows only
             k/v from [c_0 .. c_{n-2}] (no input norm) and from input_layernorm(x) of the block;
             q_norm / k_norm per head, RoPE by position; the block sees every context position and
             the whole block (bidirectional inside it)
    logits   lm_head(norm(x_j)) for j = 1 .. B - 1: the drafter's distribution of the token at
             position n - 1 + j (the embedding and the LM head are the target's)

This follows z-lab/dflash ``dflash/model.py`` (``DFlashDraftModel.forward``,
``Qwen3DFlashAttention``, ``dflash_generate``: the block ``[last token, mask, ...]`` at positions
``start .. start + B - 1``, context = target features of every position before ``start``,
``extract_context_feature`` reading ``hidden_states[layer_id + 1]``, draft tokens from rows
``1 .. B - 1``), SGLang's serving of it (``python/sglang/srt/models/dflash.py``: the context K/V written
to the draft's paged KV cache by projecting the context through each layer's k/v, then the block as
a non-causal query chunk; ``python/sglang/srt/speculative/dflash_utils.py`` for the config fields)
and SpecForge's training wrapper (``specforge/core/dflash.py``: a block sees context strictly before
its anchor and itself bidirectionally; block position k predicts token ``anchor + k``).

Here: the context K/V of position p is a function of the target's features at p alone, so it lives
in the drafter's paged KV pool (the target's block ids, one ``(k, v)`` per drafter layer), computed
once per position from a pool of projected context features ``c_p`` kept by KV slot (the executor
hands every target row's layer outputs over, as for EAGLE-3). A drafting step writes the context K/V
of the positions verified since the last step (catch-up: linears, RoPE and ``reshape_and_cache``,
no attention), then runs the B block rows of every sequence as one batch of prefill chunks with an
all-true mask through the drafter's layers. The block's own K/V lands in the slots of positions
``n - 1 .. n + B - 2`` (the scheduler reserves B slots) and is overwritten by the next catch-up.

Candidates: per position the drafter's top-k tokens, arranged by a static tree of top-k rank paths
(:mod:`.trees`, as Medusa's heads: block position d plays head d): in ``chain`` mode the argmax of
positions ``1 .. k`` (default ``k = B - 1``, the whole block), in ``tree`` mode ``spec_tree`` or the
default tree cut at depth ``B - 1``. Candidates are deterministic given the drafter, so
``tree_verify`` runs without draft probabilities (exact for sampling requests too).

Layout (z-lab's published drafters, e.g. ``z-lab/Qwen3-8B-DFlash-b16``): ``config.json`` a Qwen3
config of the drafter (``num_hidden_layers`` its layers) with ``block_size``, ``dflash_config``
``{mask_token_id, target_layer_ids}`` and ``num_target_layers`` (:mod:`.dflash_config`);
``model.safetensors`` with ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
``layers.{i}.{input,post_attention}_layernorm.weight``, ``fc.weight [H, m H]``, ``hidden_norm.weight``,
``norm.weight`` (the same names under ``model.`` are accepted, as SGLang's loader does). No
embedding or LM head: the target's. Anything missing, mis-shaped or left over is an error naming the
checkpoint's tensor; sliding-window drafter layers are refused.
"""

from __future__ import annotations

from typing import List, Optional, Sequence as Seq, Tuple

import torch

from ...layers import BatchBuilder, ColumnParallelLinear, RMSNorm, WeightPart, host_to_device
from ...layers.attention import FP8_KV_CACHE_DTYPE, report_fp8_kv_cache_scales
from ...layers.weights import CheckpointModule
from ...models.config import ModelConfig
from ...models.llama import IGNORED_SUFFIXES, LlamaDecoderLayer
from ...models.rope import build_cos_sin_cache
from ..sequence import Sequence
from .dflash_config import DFlashConfig, read_dflash_config
from .drafter import Draft, Drafter, read_head_weights
from .eagle3 import _LayoutReader
from .trees import Path, tree_for_heads, tree_mask, tree_structure
from .verifier import commit_moves

Tensor = torch.Tensor

__all__ = ["DFlashDraftModel", "DFlashDrafter", "load_dflash", "build_dflash_drafter"]


class DFlashDraftModel(torch.nn.Module):
    """The drafter's layers, ``fc`` + ``hidden_norm`` (the context projection) and final ``norm``,
    on the target's embedding and LM head (module docstring)."""

    def __init__(self, target, config: ModelConfig, layers: Seq[LlamaDecoderLayer], fc: ColumnParallelLinear,
                 hidden_norm: RMSNorm, norm: RMSNorm, dflash: DFlashConfig, target_layer_ids: Seq[int]):
        super().__init__()
        self.__dict__["target"] = target  # not a submodule: the target is not the drafter's to own
        self.config = config
        self.layers = torch.nn.ModuleList(layers)
        self.fc, self.hidden_norm, self.norm = fc, hidden_norm, norm
        self.block_size = int(dflash.block_size)
        self.mask_token_id = int(dflash.mask_token_id)
        #: z-lab's ids: the OUTPUT of target layer i
        self.target_layer_ids = tuple(int(i) for i in target_layer_ids)
        #: the runner's ids of the same states (the residual stream entering layer i + 1)
        self.aux_layers = tuple(i + 1 for i in self.target_layer_ids)
        self.dtype, self.device, self.ops = target.dtype, target.device, target.ops
        self.hidden_size = int(target.config.hidden_size)
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(config, int(target.max_positions),
                                                                  dtype=torch.float32, device=target.device),
                             persistent=False)

    # ---- KV pool ----------------------------------------------------------------------------------
    def kv_cache_bytes_per_block(self, block_size: int, dtype: Optional[torch.dtype] = None) -> int:
        """Every layer's K and V (in ``dtype``, default the model's) plus the context-feature pool's
        rows (in the model's dtype), all indexed by the target's blocks."""
        kv_el = torch.empty((), dtype=self.dtype if dtype is None else dtype).element_size()
        el = torch.empty((), dtype=self.dtype).element_size()
        kv = sum(2 * layer.num_kv_heads * layer.head_dim for layer in self.layers)
        return block_size * (kv * kv_el + self.hidden_size * el)

    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          dtype: Optional[torch.dtype] = None) -> List[Tuple[Tensor, Tensor]]:
        """One ``(k_cache, v_cache)`` per layer (``dtype``: as for the target's)."""
        dt = self.dtype if dtype is None else dtype
        if dt == FP8_KV_CACHE_DTYPE:
            report_fp8_kv_cache_scales([layer.attn for layer in self.layers], type(self).__name__)
        out = []
        for layer in self.layers:
            shape = (int(num_blocks), int(block_size), layer.num_kv_heads, layer.head_dim)
            out.append((torch.zeros(shape, dtype=dt, device=self.device),
                        torch.zeros(shape, dtype=dt, device=self.device)))
        return out

    # ---- forwards ---------------------------------------------------------------------------------
    def project(self, aux: Tensor) -> Tensor:
        """The context features ``hidden_norm(fc(a))`` of the target's concatenated layer outputs
        ``a [T, m H]``."""
        return self.hidden_norm(self.fc(aux.to(self.dtype)))

    def write_context(self, context: Tensor, positions: Tensor, slots: Tensor, kv_caches) -> None:
        """Every layer's K/V of the context features ``context [T, H]`` at rotary ``positions``,
        written to KV ``slots`` (k/v projections, k norm, RoPE; the queries are not used)."""
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            q, k, v = layer.qkv(context)
            self.ops.rotary_embedding(positions, q, k, self.cos_sin_cache, True)
            scales = (dict(k_scale=layer.attn.k_scale, v_scale=layer.attn.v_scale)
                      if k_cache.dtype == FP8_KV_CACHE_DTYPE else {})
            self.ops.reshape_and_cache(k, v, k_cache, v_cache, slots, **scales)

    def forward(self, batch, kv_caches) -> Tensor:
        """float32 logits of the batch's logits rows: the block rows as prefill chunks (their mask
        all true), attending to the context K/V already in ``kv_caches``."""
        h, residual = self.target.embed_tokens(batch.input_ids), None
        for layer, cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, batch, cache, self.cos_sin_cache)
        g, _ = self.norm.add_norm(h, residual)
        return self.target.compute_logits(g.index_select(0, batch.logits_indices))


def load_dflash(path: str, target) -> DFlashDraftModel:
    """The DFlash drafter in directory ``path`` for ``target`` (module docstring); weights of any
    float dtype, computed in the target's."""
    d, dfc = read_dflash_config(path)
    where = f"{path}/config.json"
    cfg = ModelConfig.from_dict(dict(d, architectures=["Qwen3ForCausalLM"]))  # z-lab's layers are Qwen3's
    tc = target.config
    H, V = int(tc.hidden_size), int(tc.vocab_size)
    if cfg.hidden_size != H:
        raise ValueError(f"{where}: the DFlash drafter has hidden_size={cfg.hidden_size}, the target {H} (the drafter "
                         "reads the target's embedding and LM head)")
    sliding = [i for i in range(cfg.num_hidden_layers) if cfg.is_sliding(i)]
    if sliding:
        raise ValueError(f"{where}: sliding-window drafter layers {sliding} are not supported (DFlash blocks attend "
                         "to the whole context here)")
    if dfc.mask_token_id >= V:
        raise ValueError(f"{where}: dflash_config.mask_token_id={dfc.mask_token_id} is outside the target's "
                         f"vocabulary of {V} tokens")
    layer_ids = dfc.layer_ids(int(tc.num_hidden_layers), where)
    wfile, raw = read_head_weights(path)
    pre = "model." if any(n.startswith("model.") for n in raw) else ""

    def to_file(name: str) -> str:  # our names are model.*; the file's have no prefix, or model.
        return pre + name[len("model."):] if name.startswith("model.") else name

    reader = _LayoutReader(raw, repr(wfile), to_file)
    kw = dict(dtype=target.dtype, device=target.device, ops=target.ops)
    layers = [LlamaDecoderLayer(cfg, i, quant_config=None, **kw) for i in range(cfg.num_hidden_layers)]
    fc = ColumnParallelLinear(len(layer_ids) * H, [WeightPart("model.fc", H)], False, **kw)
    hidden_norm = RMSNorm(H, cfg.rms_norm_eps, "model.hidden_norm", **kw)
    norm = RMSNorm(H, cfg.rms_norm_eps, "model.norm", **kw)
    for mod in layers + [fc, hidden_norm, norm]:
        for m in mod.modules():
            if isinstance(m, CheckpointModule):
                m.load_from(reader)
    unused = [n for n in reader.unused() if not n.endswith(IGNORED_SUFFIXES)]
    if unused:
        raise ValueError(f"unexpected tensors in DFlash checkpoint {reader.description}: "
                         f"{', '.join(sorted(unused)[:5])}")
    return DFlashDraftModel(target, cfg, layers, fc, hidden_norm, norm, dfc, layer_ids)


class DFlashDrafter(Drafter):
    """One drafter forward per step for all sequences: the context catch-up, then the blocks
    (module docstring). ``paths``: the static tree of top-k rank paths (depth d: block position d)."""

    wants_hidden_states = "all"

    def __init__(self, model: DFlashDraftModel, kv_caches, paths: Seq[Path], block_size: int,
                 device: torch.device, num_blocks: int, max_num_batched_tokens: int):
        self.model = model
        self.kv_caches = kv_caches
        self.paths = list(paths)
        self.hidden_layers = model.aux_layers
        self.block_size = block_size  # of the KV pool
        self.device = device
        self.max_chunk = max(1, int(max_num_batched_tokens))
        self.num_draft_forwards = 0
        # the projected context feature of every computed target row, by KV slot
        self.context = torch.zeros(num_blocks * block_size, model.hidden_size, dtype=model.dtype, device=device)
        B = model.block_size
        self._block_mask = torch.ones(B, B, dtype=torch.bool)  # bidirectional inside the block

    # ---- the target's features --------------------------------------------------------------------
    def observe_slot_hidden_states(self, slots: List[int], hidden: Tensor) -> None:
        with torch.inference_mode():
            self.context[host_to_device(slots, torch.int64, self.context.device)] = self.model.project(hidden)

    def on_verified(self, drafts: List[Draft]) -> None:
        src, dst = commit_moves(drafts, self.block_size)[:2]  # the accepted nodes' features go where their K/V goes
        if src:
            dev = self.context.device
            s, d = host_to_device(src, torch.int64, dev), host_to_device(dst, torch.int64, dev)
            self.context[d] = self.context[s].clone()

    # ---- drafting ---------------------------------------------------------------------------------
    def _slots(self, seq: Sequence, start: int, end: int) -> Tuple[Tensor, Tensor]:
        """``(positions, KV slots)`` of positions ``start .. end - 1`` of ``seq``."""
        pos = torch.arange(start, end, dtype=torch.int64)
        table = torch.tensor(seq.block_table, dtype=torch.int64)
        return pos, table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _catch_up(self, items: Seq[Tuple[Sequence, int, int]]) -> None:
        """The context K/V of every position from the proposer's ``draft_computed`` to ``n - 2``."""
        pos, slots = [], []
        for s, _, computed in items:
            n = s.num_tokens
            if computed > n - 1:
                raise RuntimeError(f"DFlash catch-up: sequence {s.seq_id} has context K/V for {computed} of its "
                                   f"{n - 1} computed tokens")
            if computed < n - 1:
                p, sl = self._slots(s, computed, n - 1)
                pos.append(p)
                slots.append(sl)
        if not pos:
            return
        pos_all, slots_all = torch.cat(pos).to(self.device), torch.cat(slots).to(self.device)
        for i in range(0, pos_all.numel(), self.max_chunk):  # long catch-ups (after a prompt) in pieces
            p, sl = pos_all[i:i + self.max_chunk], slots_all[i:i + self.max_chunk]
            self.model.write_context(self.context[sl], p, sl, self.kv_caches)

    def propose(self, items: Seq[Tuple[Sequence, int, int]], gens: Seq[torch.Generator]) -> List[Draft]:
        """Draft for every ``(sequence, depth, draft_computed)``: the static tree cut at ``depth``."""
        B = self.model.block_size
        mask_id = self.model.mask_token_id
        trees = [[p for p in self.paths if len(p) <= size] for _, size, _ in items]
        with torch.inference_mode():
            self._catch_up(items)
            b = BatchBuilder(self.block_size, self.device)
            for (s, _, _), paths in zip(items, trees):
                depth = max(len(p) for p in paths)
                b.prefill([s.token_ids[-1]] + [mask_id] * (B - 1), s.num_tokens - 1, s.block_table,
                          mask=self._block_mask, logits=list(range(1, depth + 1)))
            logits = self.model(b.build(), self.kv_caches)
            self.num_draft_forwards += 1
            k = 1 + max(max(p) for p in self.paths)
            top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices.tolist()
        out, row = [], 0
        for (s, _, _), paths in zip(items, trees):
            parents, depths = tree_structure(paths)
            tokens = [s.token_ids[-1]] + [top[row + len(p) - 1][p[-1]] for p in paths]
            row += max(len(p) for p in paths)
            # block rows are scratch: the next catch-up rewrites the accepted positions' context K/V
            out.append(Draft(s, tokens, parents, depths, torch.tensor(tree_mask(parents)), None, [-1] * len(tokens),
                             s.num_tokens - 1))
        return out

    def move_slots(self, src: List[int], dst: List[int]) -> None:
        """Nothing to move: no accepted node has drafter K/V (the catch-up recomputes them)."""


def build_dflash_drafter(spec, draft: DFlashDraftModel, num_kv_blocks: int, block_size: int, device: torch.device,
                         max_num_batched_tokens: int, kv_cache_dtype: torch.dtype) -> DFlashDrafter:
    """The drafter of a ``spec_method="dflash"`` config: the tree of ``spec`` on the block's
    ``block_size - 1`` drafted positions, the KV pool on the target's ``num_kv_blocks``."""
    positions = draft.block_size - 1
    if spec.tree is None and spec.mode == "chain" and spec.num_tokens is not None and spec.num_tokens > positions:
        raise ValueError(f"num_spec_tokens={spec.num_tokens} exceeds the {positions} positions a block of the DFlash "
                         f"drafter (block_size={draft.block_size}) drafts")
    paths = tree_for_heads(spec.tree, spec.mode, spec.num_tokens, positions)
    kv = draft.allocate_kv_cache(num_kv_blocks, block_size, kv_cache_dtype)
    return DFlashDrafter(draft, kv, paths, block_size, device, num_kv_blocks, max_num_batched_tokens)
