"""The flattened ragged batch one model forward runs on (the contract between the engine and the
model). Built by the engine's model runner, consumed by every layer's attention.

Row layout of the T tokens: all prefill-chunk tokens first (sequence by sequence), then one token
per decoding sequence. A prefill chunk is any run of new tokens of one sequence whose earlier
tokens (if any) are already in the KV cache: a fresh prompt, the next chunk of a long prompt, a
prompt continuing a prefix-cache hit, or (speculative decoding) a tree of draft tokens.

Per layer the model (1) writes the new K/V rows to the paged cache at `slot_mapping` (slot = block
* block_size + offset, -1 = padding, skipped), then (2) runs `paged_prefill_attention` over the
prefill rows (their queries are the LAST q_len tokens of each sequence, already in the cache) and
`paged_decode_attention` over the decode rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

Tensor = torch.Tensor


@dataclass
class ForwardBatch:
    input_ids: Tensor  # [T] int64
    positions: Tensor  # [T] int64 (rotary positions; depth-based for tree tokens)
    slot_mapping: Tensor  # [T] int64, -1 for padding rows
    # prefill part: rows [0, num_prefill_tokens)
    num_prefill_tokens: int
    prefill_cu_seqlens_q: Optional[Tensor]  # [Bp + 1] int32
    prefill_seq_lens_k: Optional[Tensor]  # [Bp] int32: tokens in the cache after this step
    prefill_block_table: Optional[Tensor]  # [Bp, W] int32
    prefill_max_seqlen_q: int
    # decode part: rows [num_prefill_tokens, T)
    decode_seq_lens: Optional[Tensor]  # [Bd] int32 (including the new token)
    decode_block_table: Optional[Tensor]  # [Bd, W] int32
    # rows whose logits are needed (last token of each prefill chunk that completes its prompt,
    # every decode row, tree nodes for verification)
    logits_indices: Tensor  # [N] int64
    # speculative tree verification: bool mask per prefill sequence (see paged_prefill_attention)
    custom_mask: Optional[Tensor] = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        return self.num_tokens - self.num_prefill_tokens
