#!/usr/bin/env python
"""Pipeline parallelism: the bubble measured on this CPU, the communication of a decode step
counted by the engine, and TP=8 x PP=2 against TP=16 on two H200 nodes (model).

1. CPU (labelled CPU): a random Llama-shaped model (``--cpu-preset``) split over P stages (spawned
   gloo processes, one intra-op thread each); ``--batch`` greedy requests decode ``--out-len``
   tokens with 1 and with P batches in flight (``pipeline_batches_in_flight``). Each stage's busy
   fraction is the seconds it computed its layers (the engine's own counter, not the waits for the
   stage before it) over the wall time of the ``generate`` call; the bubble is 1 - the mean busy
   fraction. Also tokens/s and whether the greedy tokens are the same.
2. Counted by the engine (gloo, one decode step of B rows on a skinny 4-layer model with the
   hidden size of Llama-3-70B): rank 0's tensor-group collectives and bytes under TP=2 and under
   PP=2 x TP=2 (stage 0: half the layers), the hidden state + residual it sends to stage 1 and
   the logits it receives back. From the two counts: the all-reduces per layer and the fixed ones
   (the embedding's), the activations an all-reduce and a stage boundary carry per row and hidden
   unit, the logits bytes per row and vocabulary entry. Each is also checked against the formula
   (2 all-reduces per layer + 1 for the embedding; a boundary 2 x B x hidden; logits B x vocab
   float32 to rank 0).
3. MODEL (not a measurement) of one decode step of B sequences, bf16 weights and activations, on
   two H200 nodes (8 GPUs each; NVLink 900 GB/s per GPU inside a node; 400 Gb/s = 50 GB/s per GPU
   between nodes, one NIC per GPU; ASSUMED per-collective latencies ``--nvlink-latency-us`` 10 and
   ``--net-latency-us`` 25), Llama-3-70B and Llama-3.1-405B shapes, the collective counts and
   bytes scaled from the counts of 2 to the shape's layers, hidden size and vocabulary:

   * TP=16 across the nodes: weights / 16 read at 4.3 TB/s, and every all-reduce a ring bounded
     by the network, ``2 (N-1)/N x bytes / 50 GB/s`` + the network latency.
   * TP=8 x PP=2: each node holds half the layers; a stage reads its weights / 8 and all-reduces
     over NVLink; the hidden state + residual cross the network once per step and the logits come
     back to rank 0. With 2 batches of B/2 in flight both stages work at once: tokens/s =
     (B/2) / (stage time + the larger transfer); a token's latency = both stages + both transfers.

    python bench/pp.py [--batch 8] [--out-len 24] [--cpu-preset pp-small] [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tp import HBM_BPS, NVLINK_BPS, SHAPES, _decode_plan, _write_checkpoint, weight_params  # noqa: E402

MODEL_SHAPES = {
    "llama3-70b": SHAPES["llama3-70b"],
    "llama3.1-405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                          num_key_value_heads=8, head_dim=128, vocab_size=128256),
}
CPU_PRESETS = {  # random models for the CPU bubble measurement
    "pp-small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
                     num_key_value_heads=4, head_dim=128, vocab_size=4096),
    "pp-tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, vocab_size=2048),
}
NET_BPS = 400e9 / 8  # 400 Gb/s per GPU between the nodes
GPUS_PER_NODE = 8


# ------------------------------------------------------------------------------------------------
# 1. the bubble, CPU
# ------------------------------------------------------------------------------------------------
def cpu_bubble(path: str, stages: int, in_flight: int, batch: int, out_len: int) -> Dict[str, object]:
    from fastinfer import LLM, SamplingParams

    llm = LLM(path, num_kv_blocks=batch * 8, max_num_seqs=batch, dtype="float32", pipeline_parallel_size=stages,
              pipeline_batches_in_flight=in_flight)
    try:
        prompts = [[3 + i + j for j in range(16)] for i in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
        runner = llm.executor.runner
        before = runner.stage_busy_seconds()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True))
        wall = time.perf_counter() - t0
        busy = [b - a for a, b in zip(before, runner.stage_busy_seconds())]
        steps = llm.stats()["num_steps"]
    finally:
        llm.shutdown()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    fractions = [b / wall for b in busy]
    return dict(label="CPU", stages=stages, batches_in_flight=in_flight, batch=batch, seconds=wall,
                tokens_per_s=n / wall, busy_fraction_per_rank=fractions,
                bubble=1.0 - sum(fractions) / len(fractions), engine_steps=steps,
                tokens=[o.outputs[0].token_ids for o in outs])


# ------------------------------------------------------------------------------------------------
# 2. communication of one decode step, counted by the engine
# ------------------------------------------------------------------------------------------------
def formula(s: Dict[str, int], tp: int, pp: int, batch: int, act_bytes: int) -> Dict[str, int]:
    """Rank 0 (stage 0, tensor rank 0) per decode step of ``batch`` rows; and per boundary."""
    layers0 = s["num_hidden_layers"] // pp  # (an even split)
    n_ar = (2 * layers0 + 1) if tp > 1 else 0
    return dict(all_reduces=n_ar, all_reduce_bytes=n_ar * batch * s["hidden_size"] * act_bytes,
                boundary_bytes=2 * batch * s["hidden_size"] * act_bytes if pp > 1 else 0,
                logits_bytes=batch * s["vocab_size"] * 4 if pp > 1 else 0)


COUNTED_SHAPE = dict(SHAPES["llama3-70b"], num_hidden_layers=4, intermediate_size=512, num_attention_heads=8,
                     num_key_value_heads=8, head_dim=64, vocab_size=4096)


def _count_step(path: str, batch: int, tp: int, pp: int) -> Dict[str, int]:
    """Rank 0's counters over one decode step of ``batch`` rows (float32)."""
    from fastinfer import LLM

    ctx, bs = 32, 16
    llm = LLM(path, num_kv_blocks=batch * (-(-(ctx + 1) // bs)) + 1, max_num_seqs=batch, dtype="float32",
              tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        runner = llm.executor.runner
        runner.forward(_decode_plan(batch, bs, ctx))  # warm-up (and the tables reach the workers)
        comm, pipe = runner.tp.comm, runner.tp.pipeline
        sent = (lambda: pipe.bytes_sent) if pipe is not None else (lambda: 0)
        received = (lambda: pipe.bytes_received) if pipe is not None else (lambda: 0)
        before = (comm.num_collectives, comm.bytes_all_reduced, sent(), received())
        runner.forward(_decode_plan(batch, bs, ctx))
        return dict(all_reduces=comm.num_collectives - before[0] - (1 if pp == 1 else 0),  # (TP: the logits gather)
                    all_reduce_bytes=comm.bytes_all_reduced - before[1],
                    boundary_bytes=sent() - before[2], logits_bytes=received() - before[3])
    finally:
        llm.shutdown()


def counted(root: str, batch: int, s: Dict[str, int] = COUNTED_SHAPE) -> Dict[str, object]:
    """Rank 0's counts of one decode step under TP=2 and PP=2 x TP=2 on a random model of shape
    ``s`` (an even number of layers), the rates the model scales (per layer, per row and hidden unit
    / vocabulary entry), and the formula check."""
    path = os.path.join(root, f"counted-{s['hidden_size']}-{s['num_hidden_layers']}")
    if not os.path.exists(os.path.join(path, "config.json")):
        _write_checkpoint(s, path)
    L, h, v, act = s["num_hidden_layers"], s["hidden_size"], s["vocab_size"], 4  # float32
    tp2 = _count_step(path, batch, 2, 1)
    pp2 = _count_step(path, batch, 2, 2)
    per_layer = (tp2["all_reduces"] - pp2["all_reduces"]) / (L - L // 2)
    rates = dict(all_reduces_per_layer=per_layer, fixed_all_reduces=tp2["all_reduces"] - per_layer * L,
                 all_reduce_values_per_row_hidden=tp2["all_reduce_bytes"] / (tp2["all_reduces"] * batch * h * act),
                 boundary_values_per_row_hidden=pp2["boundary_bytes"] / (batch * h * act),
                 logits_bytes_per_row_vocab=pp2["logits_bytes"] / (batch * v))
    measured = {"TP=2": tp2, "PP=2 x TP=2": pp2}
    want = {"TP=2": formula(s, 2, 1, batch, act), "PP=2 x TP=2": formula(s, 2, 2, batch, act)}
    return dict(shape=f"hidden {h}, {L} layers, vocab {v} (llama3-70b skinny: its hidden size), float32", batch=batch,
                measured=measured, formula=want, rates=rates, matches=measured == want)


# ------------------------------------------------------------------------------------------------
# 3. the model
# ------------------------------------------------------------------------------------------------
def _all_reduce_s(nbytes: float, n: int, bw: float, latency_s: float) -> float:
    return 2 * (n - 1) / n * nbytes / bw + latency_s


def model_step(s: Dict[str, int], batch: int, nvlink_lat_s: float, net_lat_s: float,
               rates: Dict[str, float]) -> List[Dict[str, object]]:
    """MODEL: TP=16 over two nodes against TP=8 x PP=2 (see the module docstring); the collective
    counts and bytes from ``rates`` (counted by the engine, :func:`counted`)."""
    h, layers, v = s["hidden_size"], s["num_hidden_layers"], s["vocab_size"]
    weights = weight_params(s) * 2
    ar_values = rates["all_reduce_values_per_row_hidden"] * h * 2  # bf16 bytes per row
    hop_values = rates["boundary_values_per_row_hidden"] * h * 2
    logit_row = rates["logits_bytes_per_row_vocab"] * v

    def n_all_reduces(num_layers: int, fixed: bool) -> float:
        return rates["all_reduces_per_layer"] * num_layers + (rates["fixed_all_reduces"] if fixed else 0)

    # TP=16: every all-reduce crosses the network
    n_ar16 = n_all_reduces(layers, True)
    act = batch * ar_values
    comm16 = n_ar16 * _all_reduce_s(act, 16, NET_BPS, net_lat_s) + batch * logit_row / 16 / NET_BPS + net_lat_s
    t16 = weights / 16 / HBM_BPS + comm16
    rows = [dict(label="model", config="TP=16 (2 nodes)", batch=batch,
                 tokens_per_s=batch / t16, token_latency_ms=t16 * 1e3, collectives=n_ar16 + 1,
                 network_bytes_per_gpu=n_ar16 * 2 * 15 / 16 * act + batch * logit_row / 16)]

    # TP=8 x PP=2: per stage layers / 2, NVLink all-reduces; one boundary and the logits cross the network
    def stage_s(b: int, first: bool) -> float:
        n = n_all_reduces(layers // 2, first)
        return weights / 2 / 8 / HBM_BPS + n * _all_reduce_s(b * ar_values, 8, NVLINK_BPS, nvlink_lat_s)

    def transfers_s(b: int):
        return b * hop_values / NET_BPS + net_lat_s, b * logit_row / NET_BPS + net_lat_s

    hop, logits = transfers_s(batch)
    latency = stage_s(batch, True) + stage_s(batch, False) + hop + logits
    n_pp = n_all_reduces(layers // 2, True) + 2
    net_pp = batch * (hop_values + logit_row)
    rows.append(dict(label="model", config="TP=8 x PP=2, 1 batch in flight", batch=batch,
                     tokens_per_s=batch / latency, token_latency_ms=latency * 1e3, collectives=n_pp,
                     network_bytes_per_gpu=net_pp))
    if batch >= 2:  # two batches of B/2, one in each stage; a step of each per cycle
        half = batch // 2
        hop2, logits2 = transfers_s(half)
        cycle = max(stage_s(half, True), stage_s(half, False)) + max(hop2, logits2)
        rows.append(dict(label="model", config="TP=8 x PP=2, 2 batches in flight", batch=batch,
                         tokens_per_s=half / cycle,
                         token_latency_ms=(stage_s(half, True) + stage_s(half, False) + hop2 + logits2) * 1e3,
                         collectives=n_pp, network_bytes_per_gpu=net_pp))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8, help="requests (CPU) / decode rows (counted) (default: 8)")
    ap.add_argument("--out-len", type=int, default=24, help="generated tokens per request, CPU (default: 24)")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages on this CPU (default: 2)")
    ap.add_argument("--cpu-preset", default="pp-small", choices=sorted(CPU_PRESETS),
                    help="random model shape for the CPU measurement (default: pp-small)")
    ap.add_argument("--nvlink-latency-us", type=float, default=10.0, help="ASSUMED, model (default: 10)")
    ap.add_argument("--net-latency-us", type=float, default=25.0, help="ASSUMED, model (default: 25)")
    ap.add_argument("--model-batches", default="1,8,64", help="decode rows in the model (default: 1,8,64)")
    ap.add_argument("--quick", action="store_true", help="tiny CPU model, 8 tokens")
    ap.add_argument("--json", default=None, help="write the results here (default: print only)")
    args = ap.parse_args(argv)
    if args.quick:
        args.cpu_preset, args.out_len = "pp-tiny", 8
    os.environ.setdefault("FASTINFER_TP_THREADS", "1")
    torch.set_num_threads(1)
    res: Dict[str, object] = {"cpu_bubble": [], "counted": None, "model_h200_two_nodes": []}
    same = ok = True
    with tempfile.TemporaryDirectory(prefix="fastinfer-pp-bench-") as root:
        path = os.path.join(root, args.cpu_preset)
        _write_checkpoint(CPU_PRESETS[args.cpu_preset], path)
        print(f"CPU: random '{args.cpu_preset}' model, {args.stages} stages (one process, one thread each), "
              f"{args.batch} requests x {args.out_len} tokens, greedy")
        for k in (1, args.stages):
            r = cpu_bubble(path, args.stages, k, args.batch, args.out_len)
            res["cpu_bubble"].append(r)
            busy = ", ".join(f"stage {i} {f:.0%}" for i, f in enumerate(r["busy_fraction_per_rank"]))
            print(f"  {k} batch(es) in flight: busy {busy}; bubble {r['bubble']:.0%}; "
                  f"{r['tokens_per_s']:.1f} tokens/s (CPU); {r['engine_steps']} engine steps")
        same = all(r["tokens"] == res["cpu_bubble"][0]["tokens"] for r in res["cpu_bubble"])
        print(f"  greedy tokens the same with 1 and {args.stages} batches in flight: {same}")
        for r in res["cpu_bubble"]:
            r.pop("tokens")
        c = counted(root, args.batch)
        res["counted"] = c
        ok = c["matches"]
        print(f"\ncounted by the engine, one decode step of {args.batch} rows ({c['shape']}), rank 0:")
        for config, got in c["measured"].items():
            print(f"  {config}: " + ", ".join(f"{k} {n} (formula {c['formula'][config][k]})" for k, n in got.items()))
        print("  rates the model scales: " + ", ".join(f"{k} {r:g}" for k, r in c["rates"].items()))
    nv, net = args.nvlink_latency_us * 1e-6, args.net_latency_us * 1e-6
    print(f"\nMODEL (not measured): decode step on two H200 nodes, bf16; HBM {HBM_BPS / 1e12:.1f} TB/s, NVLink "
          f"{NVLINK_BPS / 1e9:.0f} GB/s + {args.nvlink_latency_us:.0f} us, network {NET_BPS / 1e9:.0f} GB/s per GPU + "
          f"{args.net_latency_us:.0f} us (ASSUMED latencies)")
    print(f"{'shape':<14} {'B':>3} {'config':<33} {'tokens/s':>9} {'token ms':>8} {'net MiB/GPU/step':>16}")
    for name, s in MODEL_SHAPES.items():
        for b in [int(x) for x in args.model_batches.split(",") if x]:
            for r in model_step(s, b, nv, net, c["rates"]):
                res["model_h200_two_nodes"].append(dict(shape=name, **r))
                print(f"{name:<14} {b:>3} {r['config']:<33} {r['tokens_per_s']:>9.0f} "
                      f"{r['token_latency_ms']:>8.2f} {r['network_bytes_per_gpu'] / 2**20:>16.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if same and ok else 1


if __name__ == "__main__":
    sys.exit(main())
