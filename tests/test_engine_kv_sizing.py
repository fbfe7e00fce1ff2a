"""The KV pool's size (fastinfer.engine.kv_sizing): the rule of each option, every pool charged against
one budget (the target's K/V, a draft's, a per-sequence pool), and the line LLM(load_progress=True)
prints. The rule is arithmetic on what the runner measures, so the CUDA branch is checked with the
device's (free, total) given."""

from __future__ import annotations

import os

import pytest

from fastinfer import LLM
from fastinfer.engine.config import default_model_path
from fastinfer.engine.kv_sizing import (CPU_POOL_CAP_BYTES, STATE_MEMORY_SHARE, MemoryPool, activation_bytes,
                                        size_kv_pools)

GiB = 1 << 30
TARGET = MemoryPool("target KV", bytes_per_block=40960)
DRAFT = MemoryPool("draft KV", bytes_per_block=8192)
DRAFT_DIR = os.path.join(os.path.dirname(default_model_path()), "tiny-llama-draft")


def _size(pools, **kw):
    args = dict(block_size=16, max_num_seqs=8, max_model_len=1000)
    args.update(kw)
    return size_kv_pools(pools, **args)


def test_num_kv_blocks_wins():
    s = _size([TARGET, DRAFT], num_kv_blocks=7, kv_cache_bytes=GiB, device_memory=(GiB, 2 * GiB))
    assert (s.num_blocks, s.source, s.bytes_per_block) == (7, "num_kv_blocks", 40960 + 8192)


def test_kv_cache_bytes_holds_every_pool():
    budget = 100 * 40960 + 123
    assert _size([TARGET], kv_cache_bytes=budget).num_blocks == 100
    assert _size([TARGET, DRAFT], kv_cache_bytes=budget).num_blocks == budget // (40960 + 8192) == 83
    assert _size([TARGET], kv_cache_bytes=10).num_blocks == 1  # too small: still one block


def test_per_sequence_pools_come_off_the_budget_first():
    """A pool with a slot per sequence (a hybrid model's state) is charged max_num_seqs times, then the
    blocks share the rest: the same budget holds fewer blocks, and the report names both kinds."""
    state = MemoryPool("state", bytes_per_seq=3 * 40960)
    s = _size([TARGET, state], kv_cache_bytes=100 * 40960, max_num_seqs=8)
    assert s.num_blocks == 100 - 8 * 3 and s.bytes_per_seq == 3 * 40960
    assert s.total_bytes == 100 * 40960
    line = s.report(1000)
    assert "120.0 KiB per slot x 8 slots (state 120.0 KiB)" in line and "(target KV 40.0 KiB)" in line
    assert "wanted" not in line  # every max_num_seqs sequence has its slot
    free, total = 40 * GiB, 80 * GiB
    without = _size([TARGET], device_memory=(free, total), activation=GiB)
    with_state = _size([TARGET, state], device_memory=(free, total), activation=GiB)
    assert without.num_blocks - with_state.num_blocks == 8 * 3


def test_sequence_slots_are_capped_by_their_share_of_the_budget():
    """The slots take at most STATE_MEMORY_SHARE of the budget (SGLang's state : KV = 0.9 : 1):
    fewer than max_num_seqs when a slot is large, the report says so; with num_kv_blocks the budget
    is the device's (on CPU the pool cap); slots_per_seq asks for more per sequence."""
    state = MemoryPool("state", bytes_per_seq=10 * 40960)
    budget = 100 * 40960
    s = _size([TARGET, state], kv_cache_bytes=budget, max_num_seqs=8)
    assert s.num_seq_slots == int(budget * STATE_MEMORY_SHARE // (10 * 40960)) == 4
    assert s.num_blocks == 100 - 4 * 10 and s.total_bytes == budget
    assert "x 4 slots" in s.report(1000) and "(8 wanted for max_num_seqs=8: capped by the slots' 47%" in s.report(1000)
    assert _size([TARGET, state], kv_cache_bytes=budget, max_num_seqs=3).num_seq_slots == 3
    assert _size([TARGET, state], kv_cache_bytes=budget, max_num_seqs=1, slots_per_seq=2).num_seq_slots == 2
    big = MemoryPool("state", bytes_per_seq=100 << 20)
    cap_slots = int(CPU_POOL_CAP_BYTES * STATE_MEMORY_SHARE // (100 << 20))
    s = _size([TARGET, big], max_num_seqs=256)  # CPU default: the slots count against the 1 GiB cap
    assert s.num_seq_slots == cap_slots == 4 and s.total_bytes <= CPU_POOL_CAP_BYTES
    assert _size([TARGET, big], max_num_seqs=256, num_kv_blocks=5).num_seq_slots == cap_slots
    free, total = 40 * GiB, 80 * GiB
    s = _size([TARGET, big], max_num_seqs=256, device_memory=(free, total), activation=GiB)
    gpu_budget = total * 0.9 - (total - free) - GiB
    assert s.num_seq_slots == int(gpu_budget * STATE_MEMORY_SHARE // (100 << 20))
    assert s.num_blocks == int((gpu_budget - s.num_seq_slots * (100 << 20)) // 40960)
    assert _size([TARGET], kv_cache_bytes=budget).num_seq_slots == 0  # no per-sequence pool


def test_not_even_one_sequence_slot_is_an_error():
    state = MemoryPool("linear-attention state", bytes_per_seq=3 << 20)
    with pytest.raises(RuntimeError, match=r"not enough memory for one sequence's state \(max_num_seqs=8\): a slot "
                       r"takes 3.0 MiB \(linear-attention state\), the slots may take 47% of the budget of "
                       r"4.0 MiB \(kv_cache_bytes\)"):
        _size([TARGET, state], kv_cache_bytes=4 << 20)
    with pytest.raises(RuntimeError, match=r"max_num_seqs=8.*3.0 MiB.*gpu_memory_utilization=0.5"):
        _size([TARGET, state], device_memory=(1 * GiB, 2 * GiB), activation=0, gpu_memory_utilization=0.5)
    huge = MemoryPool("state", bytes_per_seq=CPU_POOL_CAP_BYTES)
    with pytest.raises(RuntimeError, match=r"max_num_seqs=8.*1.0 GiB.*the CPU pool cap"):
        _size([TARGET, huge], num_kv_blocks=4)


def test_gpu_budget_is_utilisation_minus_used_minus_activations():
    free, total, act = 60 * GiB, 80 * GiB, 3 * GiB
    s = _size([TARGET, DRAFT], device_memory=(free, total), activation=act, gpu_memory_utilization=0.9)
    budget = total * 0.9 - (total - free) - act
    assert s.num_blocks == int(budget // (40960 + 8192)) and s.source == "gpu_memory_utilization=0.9"
    with pytest.raises(RuntimeError, match=r"not enough GPU memory for the KV cache: 10.0 GiB free of 80.0 GiB"):
        _size([TARGET], device_memory=(10 * GiB, total), activation=act, gpu_memory_utilization=0.5)


def test_cpu_default_is_sequences_of_max_model_len_capped():
    s = _size([TARGET, DRAFT], max_num_seqs=256, max_model_len=1000)
    assert s.num_blocks == 63 * 16  # ceil(1000 / 16) blocks for min(256, 16) sequences
    big = MemoryPool("target KV", bytes_per_block=GiB // 100)
    assert _size([big], max_num_seqs=256, max_model_len=1000).num_blocks == CPU_POOL_CAP_BYTES // (GiB // 100)
    huge = MemoryPool("target KV", bytes_per_block=GiB)
    assert _size([huge], max_model_len=1000).num_blocks == 64  # at least one sequence's blocks + 1


def test_activation_estimate():
    # 2 tokens x (6 H + 4 I + 2 (q + 2 kv)) x 2 bytes + 3 rows x V x 16 bytes + 512 MiB
    assert activation_bytes(8, 16, 8, 4, 10, 2, 2, 3) == 2 * (48 + 64 + 2 * 16) * 2 + 3 * 10 * 16 + (512 << 20)


def test_the_engine_reports_its_kv_cache(capsys):
    llm = LLM(device="cpu", dtype="bfloat16", kv_cache_bytes=16 * 40960 + 100, draft_model=DRAFT_DIR,
              load_progress=True)
    s = llm.executor.kv_sizing
    per_block = llm.model.kv_cache_bytes_per_block(16) + llm.draft_model.kv_cache_bytes_per_block(16)
    assert [p.name for p in s.pools] == ["target KV", "draft KV"] and s.bytes_per_block == per_block
    assert s.num_blocks == llm.stats()["num_kv_blocks"] == (16 * 40960 + 100) // per_block
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("fastinfer: KV cache:")]
    assert line == [s.report(llm.max_model_len)], err
    assert f"{s.num_blocks} blocks of 16 tokens" in line[0] and "sized by kv_cache_bytes" in line[0]
    LLM(device="cpu", num_kv_blocks=8)
    assert "KV cache" not in capsys.readouterr().err  # quiet unless asked


def test_cuda_graph_batch_cap_is_an_option():
    from fastinfer.engine.config import EngineConfig

    assert EngineConfig(device="cpu").max_cuda_graph_batch_size == 256
    with pytest.raises(ValueError, match="max_cuda_graph_batch_size must be an int >= 1"):
        EngineConfig(device="cpu", max_cuda_graph_batch_size=0)
