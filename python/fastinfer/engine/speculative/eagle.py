"""EAGLE draft heads (Li et al. 2024, https://arxiv.org/abs/2401.15077; EAGLE-2's dynamic tree,
https://arxiv.org/abs/2406.16858): one Llama decoder layer that predicts the target's next feature.

Row ``p`` of the draft pairs the target's final-normed hidden state ``f_p`` (the feature that
predicted token ``t_{p+1}``) with that token: input ``fc([embed(t_{p+1}); f_p])`` (``fc``: 2H -> H),
one decoder layer (no input norm in the EAGLE-1 layout; residual added), output ``g_{p+1}``, a guess
of ``f_{p+1}``; the target's ``lm_head(g_{p+1})`` is the draft distribution of ``t_{p+2}``. The
embedding and ``lm_head`` are the target's. Rows are at cache position (and rotary position) p in
the draft's own paged KV pool (the target's block ids), so with committed ``t_0 .. t_{n-1}`` the
catch-up computes rows up to ``n - 2`` (the root's); a drafted token at depth i then sits at row
``n - 2 + i`` with the parent's output as its feature. Drafting (chain, EAGLE-2 tree) is the draft
model's (:class:`.drafter.DraftModelDrafter`), one row earlier; draft rows built on guessed features
are never kept: after a verification the catch-up recomputes the accepted tokens' rows from the
target's true features.

The target's features of every computed token live in a feature pool indexed by KV slot (the
executor hands every row's hidden state over; verification compacts the pool like the KV), so a
prefix-cache hit or a preempted sequence finds its features again.

Layout (directory with ``config.json``: a Llama config of the draft layer, and ``model.safetensors``;
the EAGLE repository, SafeAILab/EAGLE ``model/cnets.py``, for Llama targets): ``fc.weight [H, 2H]``
(``fc.bias`` optional), ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``,
optionally ``layers.0.input_layernorm.weight`` and ``embed_tokens.weight`` (ignored: the target's);
the same names under ``model.`` (vLLM / SGLang). Anything else is an error naming the tensor.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ...layers import BatchBuilder, TensorDictReader, host_to_device, slot_of
from ...layers.attention import FP8_KV_CACHE_DTYPE, report_fp8_kv_cache_scales
from ...layers.weights import CheckpointModule
from ...models.config import ModelConfig
from ...models.llama import LlamaDecoderLayer
from ..sequence import Sequence
from .drafter import Draft, DraftModelDrafter, _Chunk, read_head_weights
from .verifier import commit_moves

Tensor = torch.Tensor

__all__ = ["EagleDraftModel", "EagleDrafter", "load_eagle"]


class EagleDraftModel(torch.nn.Module):
    """``fc`` + one decoder layer, on the target's embedding and lm_head."""

    def __init__(self, target, layer: LlamaDecoderLayer, fc_weight: Tensor, fc_bias: Optional[Tensor]):
        super().__init__()
        self.__dict__["target"] = target  # not a submodule: the target is not the draft's to own
        self.layer = layer
        self.fc_weight, self.fc_bias = fc_weight, fc_bias
        self.dtype, self.device, self.ops = target.dtype, target.device, target.ops
        self.hidden_size = int(target.config.hidden_size)

    def kv_cache_bytes_per_block(self, block_size: int, dtype: Optional[torch.dtype] = None) -> int:
        """The layer's K and V (in ``dtype``, default the model's) plus the feature pool's rows (in
        the model's dtype), both indexed by the target's blocks."""
        kv_el = torch.empty((), dtype=self.dtype if dtype is None else dtype).element_size()
        el = torch.empty((), dtype=self.dtype).element_size()
        return block_size * (2 * self.layer.num_kv_heads * self.layer.head_dim * kv_el + self.hidden_size * el)

    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          dtype: Optional[torch.dtype] = None) -> List[Tuple[Tensor, Tensor]]:
        """The layer's ``(k_cache, v_cache)`` (``dtype``: as for the target's
        :meth:`~fastinfer.models.LlamaForCausalLM.allocate_kv_cache`)."""
        dt = self.dtype if dtype is None else dtype
        if dt == FP8_KV_CACHE_DTYPE:
            report_fp8_kv_cache_scales([self.layer.attn], type(self).__name__)
        shape = (int(num_blocks), int(block_size), self.layer.num_kv_heads, self.layer.head_dim)
        return [(torch.zeros(shape, dtype=dt, device=self.device), torch.zeros(shape, dtype=dt, device=self.device))]

    def forward(self, batch, kv_caches, features: Tensor) -> Tuple[Tensor, Tensor]:
        """float32 logits and output features ``g`` of the batch's logits rows; ``features [T, H]``."""
        e = self.target.embed_tokens(batch.input_ids)
        x = F.linear(torch.cat([e, features.to(e.dtype)], dim=-1), self.fc_weight, self.fc_bias)
        y, res = self.layer(x, None, batch, kv_caches[0], self.target.cos_sin_cache)
        g = (y + res).index_select(0, batch.logits_indices)
        return self.target.compute_logits(g), g


def load_eagle(path: str, target) -> EagleDraftModel:
    """The EAGLE head in directory ``path`` for ``target`` (see the module docstring)."""
    if target.config.is_mla:  # the head's layer rotates with the target's table: 64 rotary dims there
        raise ValueError(f"EAGLE heads are not supported for {target.config.architecture}: the head rotates q and k "
                         "with the target's RoPE table, which covers a multi-head latent attention target's "
                         "rotary dims only (use spec_method='draft')")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"EAGLE directory {path!r} has no config.json")
    with open(cfg_file, "r", encoding="utf-8") as f:
        d = json.load(f)
    d = dict(d, num_hidden_layers=1, architectures=["LlamaForCausalLM"])
    cfg = ModelConfig.from_dict(d)
    tc = target.config
    for key in ("hidden_size", "vocab_size"):
        if getattr(cfg, key) != getattr(tc, key):
            raise ValueError(f"{path}: the EAGLE head has {key}={getattr(cfg, key)}, the target {getattr(tc, key)}")
    wfile, raw = read_head_weights(path)
    tensors = {n if n.startswith("model.") else "model." + n: t for n, t in raw.items()}
    reader = TensorDictReader(tensors, repr(wfile))
    layer = LlamaDecoderLayer(cfg, 0, dtype=target.dtype, device=target.device, ops=target.ops, quant_config=None)
    has_norm = reader.has("model.layers.0.input_layernorm.weight")
    if not has_norm:  # EAGLE-1 / EAGLE-2: the first layer takes fc's output as it is
        layer.input_layernorm = torch.nn.Identity()
    for m in layer.modules():
        if isinstance(m, CheckpointModule):
            m.load_from(reader)
    H = int(tc.hidden_size)
    fc_w = reader.get_float("model.fc.weight", (H, 2 * H)).to(target.device, target.dtype).contiguous()
    fc_b = None
    if reader.has("model.fc.bias"):
        fc_b = reader.get_float("model.fc.bias", (H,)).to(target.device, target.dtype).contiguous()
    if reader.has("model.embed_tokens.weight"):
        reader.get("model.embed_tokens.weight", (int(tc.vocab_size), H))
    unused = reader.unused()
    if unused:
        raise ValueError(f"unexpected tensors in EAGLE checkpoint {wfile!r}: {', '.join(sorted(unused)[:5])}")
    return EagleDraftModel(target, layer, fc_w, fc_b)


class EagleDrafter(DraftModelDrafter):
    """:class:`.drafter.DraftModelDrafter`'s chain / tree drafting, with EAGLE's rows (module docstring).

    A row's input feature is found by tensor ops, batched over the forward's rows: the catch-up's
    rows read the target's feature pool at their own KV slots; a drafted row reads the output of
    its parent row (the ancestor one level up in its chunk's tree mask, else the root's row), kept
    for one :meth:`propose` in ``_outputs`` and found by KV slot through ``_output_row``."""

    wants_hidden_states = "all"
    position_shift = -1  # a token's draft row is one before its position

    def __init__(self, model: EagleDraftModel, kv_caches, block_size: int, device, mode: str, num_tokens: int,
                 tree_topk: int, max_num_batched_tokens: int, ops, num_blocks: int):
        super().__init__(model, kv_caches, block_size, device, mode, num_tokens, tree_topk, max_num_batched_tokens,
                         ops)
        self.features = torch.zeros(num_blocks * block_size, model.hidden_size, dtype=model.dtype, device=device)
        # this propose()'s output features, and the row in them of the latest output at each KV slot
        self._outputs = torch.zeros(0, model.hidden_size, dtype=model.dtype, device=device)
        self._output_row = torch.full((num_blocks * block_size,), -1, dtype=torch.int64, device=device)
        self._written: List[Tensor] = []  # the slots given an output row this propose()

    # ---- the target's features --------------------------------------------------------------------
    def observe_slot_hidden_states(self, slots: List[int], hidden: Tensor) -> None:
        self.features[host_to_device(slots, torch.int64, self.features.device)] = hidden.to(self.features.dtype)

    def on_verified(self, drafts: List[Draft]) -> None:
        src, dst = commit_moves(drafts, self.block_size)[:2]  # the accepted nodes' features go where their K/V goes
        if src:
            dev = self.features.device
            s, d = host_to_device(src, torch.int64, dev), host_to_device(dst, torch.int64, dev)
            self.features[d] = self.features[s].clone()

    # ---- forwards ---------------------------------------------------------------------------------
    def _forward(self, chunks: List[_Chunk], decodes: List[Tuple[Sequence, int, int]],
                 from_pool: bool = False) -> Tensor:
        """A draft forward; each row's feature is the target's at its own slot (``from_pool``: the
        catch-up, whose rows sit at their positions) or its parent row's output."""
        b = BatchBuilder(self.block_size, self.device)
        parent: List[int] = []  # per input row: the batch row of its parent, or -1 (the fallback slot)
        fallback: List[int] = []  # per input row: the slot of the output it reads when it has no parent row
        for seq, toks, rpos, spos, mask, rows in chunks:
            base = len(parent)
            b.prefill(toks, spos[0], seq.block_table, positions=rpos, slot_positions=spos, mask=mask, logits=rows)
            if from_pool:
                continue
            q = len(toks)
            rp = torch.tensor(rpos)
            allowed = mask if mask is not None else torch.ones(q, q, dtype=torch.bool).tril_()
            up = allowed & (rp[None, :] == rp[:, None] - 1)  # the ancestor one level up
            has = up.any(1)
            parent += torch.where(has, up.to(torch.uint8).argmax(1) + base, -1).tolist()
            fallback += [slot_of(seq.block_table, seq.num_tokens - 2, self.block_size)] * q  # the root's row
        for seq, tok, p in decodes:
            b.decode(tok, p, seq.block_table)
            parent.append(-1)
            fallback.append(slot_of(seq.block_table, p - 1, self.block_size))
        batch = b.build()
        if from_pool:
            feats = self.features[batch.slot_mapping]
        else:
            par = host_to_device(parent, torch.int64, self.device)
            src = torch.where(par >= 0, batch.slot_mapping[par.clamp(min=0)],
                              host_to_device(fallback, torch.int64, self.device))
            rows = self._output_row[src]
            if bool((rows < 0).any()):
                raise RuntimeError("EAGLE drafting: a draft row's parent has no output in this step")
            feats = self._outputs[rows]
        self.num_draft_forwards += 1
        logits, g = self.model(batch, self.kv_caches, feats)
        out_slots = batch.slot_mapping.index_select(0, batch.logits_indices)
        self._written.append(out_slots)
        self._output_row[out_slots] = torch.arange(self._outputs.shape[0], self._outputs.shape[0] + g.shape[0],
                                                   device=self.device)
        self._outputs = torch.cat([self._outputs, g])
        return logits

    def _catch_up(self, seqs: List[Sequence], computed: List[int]) -> Tensor:
        """Rows ``computed .. n - 2`` of every sequence from the target's features; logits at n - 2."""
        self._outputs = self._outputs[:0]
        if self._written:
            self._output_row[torch.cat(self._written)] = -1
            self._written = []
        computed = list(computed)
        root: Dict[int, Tensor] = {}
        pending = list(range(len(seqs)))
        while pending:
            chunks, budget, with_logits = [], self.max_chunk, []
            for i in pending:
                s, c = seqs[i], computed[i]
                if s.num_tokens - 1 - c <= 0:
                    raise RuntimeError(f"EAGLE catch-up: sequence {s.seq_id} has draft rows for {c} of "
                                       f"{s.num_tokens - 1} tokens (at most n - 2 may be computed before a step)")
                take = min(s.num_tokens - 1 - c, budget)
                if take <= 0:
                    break
                last = c + take == s.num_tokens - 1
                pos = list(range(c, c + take))
                chunks.append((s, s.token_ids[c + 1:c + 1 + take], pos, pos, None, [take - 1] if last else []))
                computed[i] += take
                budget -= take
                if last:
                    with_logits.append(i)
            logits = self._forward(chunks, [], from_pool=True)
            for r, i in enumerate(with_logits):
                root[i] = logits[r]
            pending = [i for i in pending if i not in root]
        return torch.stack([root[i] for i in range(len(seqs))])

    def propose(self, items, gens) -> List[Draft]:
        drafts = super().propose(items, gens)
        for d in drafts:  # rows on guessed features are scratch: the catch-up redoes accepted ones
            d.fed = [-1] * d.num_nodes
            d.draft_computed = d.seq.num_tokens - 1
        return drafts
