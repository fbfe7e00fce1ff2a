"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode-only step launches ~10 kernels per layer; at small batch the GPU idles between them while
Python and the dispatcher issue the next one. Capturing the whole forward once per bucket (1, 2, 4,
8, then multiples of 16 up to ``max_num_seqs``) and replaying it removes that. The graph reads its
inputs from static buffers, so a step copies its ids/positions/slots/lengths/table into them and
pads the rows up to the bucket: padding rows have slot -1 (``reshape_and_cache`` skips them), length
0 (attention returns zeros for them) and position 0; their logits are dropped.

The same class runs without graphs (``use_graphs=False``): the static-buffer and padding path then
runs eagerly, which is how it is tested on machines without a GPU.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..layers import ForwardBatch


def decode_buckets(max_batch: int) -> List[int]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, 16, 32, 48, ... up to ``max_batch``."""
    out = [b for b in (1, 2, 4, 8) if b < max_batch]
    out += list(range(16, max_batch, 16))
    return sorted(set(out + [max_batch]))


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_batch: int, max_blocks: int, device: torch.device,
                 use_graphs: bool):
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.use_graphs = use_graphs
        self.buckets = decode_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        n, w = self.max_batch, max(1, max_blocks)
        z = dict(device=device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, **z)
        self.positions = torch.zeros(n, dtype=torch.int64, **z)
        self.slots = torch.full((n,), -1, dtype=torch.int64, **z)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, **z)
        self.block_table = torch.zeros((n, w), dtype=torch.int32, **z)
        self.logits_indices = torch.arange(n, dtype=torch.int64, **z)
        self._graphs: Dict[int, "torch.cuda.CUDAGraph"] = {}
        self._outputs: Dict[int, torch.Tensor] = {}
        self._pool = None

    @property
    def max_blocks(self) -> int:
        return int(self.block_table.shape[1])

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch.decode_only(self.input_ids[:bs], self.positions[:bs], self.slots[:bs],
                                        self.seq_lens[:bs], self.block_table[:bs], self.logits_indices[:bs])

    @torch.inference_mode()
    def capture(self, progress: Optional[Callable[[int], None]] = None) -> None:
        """Capture one graph per bucket, largest first, all in one memory pool."""
        if not self.use_graphs:
            return
        self._reset_inputs(0)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.buckets):
                batch = self._batch(bs)
                self.model(batch, self.kv_caches)  # warm-up: lazy allocations happen outside the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                    out = self.model(batch, self.kv_caches)
                if self._pool is None:
                    self._pool = graph.pool()
                self._graphs[bs] = graph
                self._outputs[bs] = out
                if progress is not None:
                    progress(bs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def _reset_inputs(self, start: int, end: Optional[int] = None) -> None:
        """Rows [start, end) become padding (the bucket-``end`` graph reads no row past it)."""
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slots[start:end].fill_(-1)
        self.seq_lens[start:end].zero_()

    def fits(self, num_seqs: int, width: int) -> bool:
        return 0 < num_seqs <= self.max_batch and width <= self.max_blocks

    @torch.inference_mode()
    def run(self, input_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
            seq_lens: Sequence[int], tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """One decode step for ``n = len(input_ids)`` sequences (the decode rows of a
        :class:`~fastinfer.layers.BatchBuilder`); float32 logits ``[n, V]``."""
        n = len(input_ids)
        bs = next(b for b in self.buckets if b >= n)
        w = self.max_blocks
        host = torch.tensor([list(input_ids), list(positions), list(slots), list(seq_lens)], dtype=torch.int64)
        table = torch.tensor([list(r) + [0] * (w - len(r)) for r in tables], dtype=torch.int32)
        if self.device.type == "cuda":
            host, table = host.pin_memory(), table.pin_memory()
        host = host.to(self.device, non_blocking=True)
        self.input_ids[:n].copy_(host[0])
        self.positions[:n].copy_(host[1])
        self.slots[:n].copy_(host[2])
        self.seq_lens[:n].copy_(host[3])
        self.block_table[:n].copy_(table.to(self.device, non_blocking=True))
        self._reset_inputs(n, bs)  # padding rows of this bucket: slot -1, length 0
        if self.use_graphs:
            self._graphs[bs].replay()
            return self._outputs[bs][:n]
        return self.model(self._batch(bs), self.kv_caches)[:n]
