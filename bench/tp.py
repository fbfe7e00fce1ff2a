#!/usr/bin/env python
"""Tensor parallelism: what a decode step communicates, what that costs on NVLink (model), and
tokens/s of TP=2 against TP=1 on this CPU.

1. Computed, per decode step of B sequences, per rank, for the Llama-3-8B / 70B shapes at TP 1, 2,
   4, 8: the all-reduces (embedding: 1; per layer: o_proj and down_proj, 2; each ``B x hidden``
   activations; fp8 W8A8 adds per row-parallel layer one ``B x 4``-byte amax all-reduce, see
   ``fastinfer.quant.methods``), the logits gather (``B x Vp / N`` float32 per rank, Vp the
   vocabulary padded to a multiple of 64 N), and rank 0's control message.
2. Measured with gloo here (the engine's own counters on rank 0, one decode step of B rows) on
   models with the hidden size of those shapes but 4 layers, 8 query heads, small MLPs and a
   4096-token vocabulary (the communicated bytes depend on hidden size, layers, B and the
   vocabulary only, and every layer does the same); each is compared with the formula of 1 for the
   same config. The control message (rank 0 -> workers, a gloo broadcast) is reported apart.
3. MODEL (not a measurement) of the NVLink share of a decode step on H200: ring all-reduce time
   ``2 (N-1)/N x bytes / 900 GB/s`` plus an ASSUMED per-collective latency (``--latency-us``,
   default 10 us), against the step's weight-read time ``weight bytes / N / 4.3 TB/s`` (bf16).
4. CPU tokens/s (labelled CPU): the same greedy batch through TP=1 (all cores to one rank, and
   half of them) and TP=2 (half the cores each, gloo over loopback), on a random model of
   ``--cpu-preset`` shape. On a small shared machine OpenMP spin-waiting can make the all-cores
   TP=1 run much slower than the thread count suggests; the half-cores TP=1 row is the fair one.

    python bench/tp.py [--batch 8] [--measure-tp 2,4] [--cpu-preset small] [--json PATH] [--quick]
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

import fastinfer  # noqa: F401
from fastinfer.layers.embedding import padded_vocab
from fastinfer.models import ModelConfig, random_weights

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256),
}
CPU_PRESETS = {  # random models for the CPU timing
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=128, vocab_size=8192),
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=2048),
}
MEASURED_LAYERS = 4  # the per-layer collectives are the same in every layer
NVLINK_BPS = 900e9  # H200 NVLink, per GPU
HBM_BPS = 4.3e12  # H200 HBM3e


def weight_params(s: Dict[str, int]) -> int:
    h, f, layers, v = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    return layers * (h * (q + 2 * kv) + q * h + 3 * h * f + 2 * h) + 2 * v * h + h


def computed(s: Dict[str, int], tp: int, batch: int, act_bytes: int = 2, fp8: bool = False) -> Dict[str, int]:
    """Per rank, per decode step of ``batch`` rows (see the module docstring)."""
    if tp == 1:
        return dict(all_reduces=0, all_reduce_bytes=0, gathers=0, gather_bytes=0)
    layers = s["num_hidden_layers"]
    n_ar = 1 + 2 * layers
    ar_bytes = n_ar * batch * s["hidden_size"] * act_bytes
    if fp8:
        n_ar += 2 * layers
        ar_bytes += 2 * layers * batch * 4
    return dict(all_reduces=n_ar, all_reduce_bytes=ar_bytes, gathers=1,
                gather_bytes=batch * padded_vocab(s["vocab_size"], tp) // tp * 4)


def nvlink_model(s: Dict[str, int], tp: int, batch: int, latency_us: float) -> Dict[str, float]:
    """MODEL: seconds of a decode step's communication vs its weight reads, bf16, one GPU per rank."""
    c = computed(s, tp, batch)
    ring = 2 * (tp - 1) / tp if tp > 1 else 0.0
    bw = (c["all_reduce_bytes"] * ring + c["gather_bytes"] * (tp - 1) / max(tp, 1)) / NVLINK_BPS
    lat = (c["all_reduces"] + c["gathers"]) * latency_us * 1e-6
    weights = weight_params(s) * 2 / tp / HBM_BPS
    comm = bw + lat
    return dict(comm_bandwidth_us=bw * 1e6, comm_latency_us=lat * 1e6, weight_read_us=weights * 1e6,
                comm_share=comm / (comm + weights), comm_share_bandwidth_only=bw / (bw + weights))


# ------------------------------------------------------------------------------------------------
def _write_checkpoint(shape: Dict[str, int], path: str, dtype=torch.float32) -> str:
    from safetensors.torch import save_file

    d = dict(shape, architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
             max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
             bos_token_id=0, eos_token_id=1)
    cfg = ModelConfig.from_dict(d)
    tensors = {k: v.contiguous() for k, v in random_weights(cfg, dtype, "cpu", seed=0).items()}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f)
    return path


def _decode_plan(batch: int, block_size: int, ctx: int):
    from fastinfer.engine.model_runner import ForwardPlan

    per = -(-(ctx + 1) // block_size)
    tables = {i: list(range(i * per, (i + 1) * per)) for i in range(batch)}
    return ForwardPlan(decodes=[(i, 5 + i, ctx) for i in range(batch)], tables=tables)


def measure(shape_name: str, tp: int, batch: int, root: str) -> Dict[str, object]:
    """Rank 0's counters over one decode step of ``batch`` rows (gloo, spawned workers)."""
    from fastinfer import LLM

    s = dict(SHAPES[shape_name], num_hidden_layers=MEASURED_LAYERS, intermediate_size=64 * 8, num_attention_heads=8,
             num_key_value_heads=8, head_dim=64, vocab_size=4096)
    path = os.path.join(root, f"{shape_name}-skinny")
    if not os.path.exists(os.path.join(path, "config.json")):
        _write_checkpoint(s, path)
    ctx, bs = 32, 16
    llm = LLM(path, num_kv_blocks=batch * (-(-(ctx + 1) // bs)) + 1, max_num_seqs=batch, tensor_parallel_size=tp,
              dtype="float32")  # the formula's act_bytes below
    try:
        runner = llm.executor.runner
        runner.forward(_decode_plan(batch, bs, ctx))  # warm-up (and the tables reach the workers)
        comm, ctrl = runner.tp.comm, runner.ctrl
        before = (comm.num_collectives, comm.bytes_all_reduced, comm.bytes_gathered, ctrl.bytes_sent)
        plan = _decode_plan(batch, bs, ctx)
        t0 = time.perf_counter()
        runner.forward(plan)
        dt = time.perf_counter() - t0
        got = dict(collectives=comm.num_collectives - before[0], all_reduce_bytes=comm.bytes_all_reduced - before[1],
                   gather_bytes=comm.bytes_gathered - before[2], control_bytes=ctrl.bytes_sent - before[3])
    finally:
        llm.shutdown()
    want = computed(s, tp, batch, act_bytes=4)  # float32, as the engine above runs
    return dict(shape=f"{shape_name} (skinny: same hidden size, {MEASURED_LAYERS} layers, vocab 4096)", tp=tp,
                batch=batch,
                measured=got, computed=want, step_ms_cpu=dt * 1e3,
                matches=(got["all_reduce_bytes"] == want["all_reduce_bytes"]
                         and got["gather_bytes"] == want["gather_bytes"]
                         and got["collectives"] == want["all_reduces"] + want["gathers"]))


def cpu_tokens_per_s(preset: str, tp: int, threads: int, batch: int, out_len: int, root: str) -> Dict[str, object]:
    from fastinfer import LLM, SamplingParams

    path = os.path.join(root, f"cpu-{preset}")
    if not os.path.exists(os.path.join(path, "config.json")):
        _write_checkpoint(CPU_PRESETS[preset], path)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)  # rank 0's; workers get cores // tp, and rank 0 at most that
    llm = LLM(path, num_kv_blocks=batch * 8, max_num_seqs=batch, tensor_parallel_size=tp, dtype="float32")
    try:
        prompts = [[3 + i + j for j in range(16)] for i in range(batch)]
        sp = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        dt = time.perf_counter() - t0
    finally:
        llm.shutdown()
        torch.set_num_threads(old)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(label="CPU", preset=preset, tp=tp, batch=batch, threads_per_rank=threads,
                output_tokens=n, seconds=dt, tokens_per_s=n / dt,
                tokens=[o.outputs[0].token_ids for o in outs])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8, help="decode rows per step (default: 8)")
    ap.add_argument("--latency-us", type=float, default=10.0,
                    help="ASSUMED NVLink per-collective latency for the model, microseconds (default: 10)")
    ap.add_argument("--measure-tp", default="2,4", help="TP sizes measured with gloo here (default: 2,4)")
    ap.add_argument("--cpu-preset", default="small", choices=sorted(CPU_PRESETS),
                    help="random model shape for the CPU tokens/s (default: small)")
    ap.add_argument("--out-len", type=int, default=32, help="generated tokens per request, CPU timing (default: 32)")
    ap.add_argument("--quick", action="store_true", help="measure TP=2 only, tiny CPU model, 8 tokens")
    ap.add_argument("--json", default=None, help="write the results here (default: print only)")
    args = ap.parse_args(argv)
    if args.quick:
        args.measure_tp, args.cpu_preset, args.out_len = "2", "tiny", 8
    res: Dict[str, List] = {"computed": [], "measured_gloo": [], "model_nvlink_h200": [], "cpu_tokens_per_s": []}
    print(f"per decode step, per rank, batch {args.batch}, bf16 activations (computed)")
    print(f"{'shape':<11} {'TP':>2} {'all-reduces':>11} {'AR KiB':>9} {'gather KiB':>10} | MODEL H200: "
          f"{'comm us':>8} {'(lat us)':>8} {'weights us':>10} {'share':>6} {'bw-only':>7}")
    for name, s in SHAPES.items():
        for tp in (1, 2, 4, 8):
            c = computed(s, tp, args.batch)
            m = nvlink_model(s, tp, args.batch, args.latency_us)
            res["computed"].append(dict(shape=name, tp=tp, batch=args.batch, **c))
            res["model_nvlink_h200"].append(dict(shape=name, tp=tp, batch=args.batch, latency_us=args.latency_us,
                                                 label="model", **m))
            print(f"{name:<11} {tp:>2} {c['all_reduces']:>11} {c['all_reduce_bytes'] / 1024:>9.1f} "
                  f"{c['gather_bytes'] / 1024:>10.1f} | {m['comm_bandwidth_us'] + m['comm_latency_us']:>17.1f} "
                  f"{m['comm_latency_us']:>8.1f} {m['weight_read_us']:>10.1f} {m['comm_share']:>6.1%} "
                  f"{m['comm_share_bandwidth_only']:>7.1%}")
    with tempfile.TemporaryDirectory(prefix="fastinfer-tp-bench-") as root:
        print("\nmeasured with gloo on this machine (rank 0's counters, one decode step, float32)")
        for name in SHAPES:
            for tp in [int(x) for x in args.measure_tp.split(",") if x]:
                r = measure(name, tp, args.batch, root)
                res["measured_gloo"].append(r)
                g = r["measured"]
                print(f"{name:<11} TP={tp}: {g['collectives']} collectives, "
                      f"all-reduce {g['all_reduce_bytes']} B, gather {g['gather_bytes']} B, control "
                      f"{g['control_bytes']} B; formula {'matches' if r['matches'] else 'DIFFERS'}; "
                      f"step {r['step_ms_cpu']:.1f} ms (CPU)")
        print(f"\nCPU tokens/s, random '{args.cpu_preset}' model, batch {args.batch} (CPU, not a GPU figure)")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        for tp, threads in ((1, cores), (1, max(1, cores // 2)), (2, max(1, cores // 2))):
            r = cpu_tokens_per_s(args.cpu_preset, tp, threads, args.batch, args.out_len, root)
            res["cpu_tokens_per_s"].append(r)
            print(f"TP={tp}: {r['tokens_per_s']:.1f} tokens/s (CPU, {threads} thread(s) per rank)")
        same = all(r["tokens"] == res["cpu_tokens_per_s"][0]["tokens"] for r in res["cpu_tokens_per_s"])
        print(f"greedy tokens TP=2 == TP=1: {same}")
        for r in res["cpu_tokens_per_s"]:
            r.pop("tokens")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if all(r["matches"] for r in res["measured_gloo"]) and same else 1


if __name__ == "__main__":
    sys.exit(main())
