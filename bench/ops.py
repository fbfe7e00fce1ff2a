#!/usr/bin/env python
"""Benchmark the fused elementwise ops and the KV-cache write against their peers.

For each op and shape (Llama-3-8B-like: hidden 4096, F 14336, Hq 32, Hkv 8, D 128, BS 16; T in
{1, 16, 512, 4096}) this times

* ``fastinfer``  -- ``torch.ops.fastinfer.*``;
* ``torch``      -- the obvious eager PyTorch implementation in the input dtype;
* ``compile``    -- ``torch.compile`` of that eager implementation (``--no-compile`` skips it; it is
  skipped by default on CPU with ``--quick`` because Inductor's C++ compile takes long there);
* ``vllm`` / ``flashinfer`` -- their kernels for the same op, when the package imports;
* ``unfused`` (the norms fused with the e4m3 per-token quantisation, ``rms_norm_quant`` and
  ``fused_add_rms_norm_quant``) -- the fastinfer pair they replace: the norm, then ``fp8_quantize``.

Timing: on CUDA, batches of calls are bracketed by CUDA events; on CPU by ``time.perf_counter``.
Each call uses the next of several *rotating* input sets, sized together to exceed the L2 cache on
GPU (>= 256 MB; at most ``--max-copies`` sets), so a call does not find its inputs cached. After a
warm-up, the per-call time is the median over ``--reps`` batches. GB/s counts the bytes each op
must move (inputs read + outputs written, once). The speedup column is ``peer_us / fastinfer_us``.

Every row carries the device label; CPU rows say "CPU": CPU figures say nothing about GPU
performance (see docs/design.md, "Nothing here counts until measured on a GPU").

Usage::

    python bench/ops.py                          # all ops, all shapes, current device
    python bench/ops.py --ops rms_norm,silu_and_mul --json out.json
    python bench/ops.py --quick                  # few shapes, short timing (< 60 s on CPU)
    python bench/ops.py --ops rms_norm_quant,fused_add_rms_norm_quant --threads 1   # fused vs unfused
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from timing import device_label, git_commit, time_fn

ALL_OPS = ["rms_norm", "fused_add_rms_norm", "rms_norm_quant", "fused_add_rms_norm_quant", "silu_and_mul",
           "rotary_embedding", "reshape_and_cache"]

# Llama-3-8B
HIDDEN, FFN, HQ, HKV, HEAD_DIM, BLOCK = 4096, 14336, 32, 8, 128, 16
MAX_POS = 8192
EPS = 1e-5


# --------------------------------------------------------------------------------------------
# eager implementations in the input dtype (the "torch" peer, also what "compile" compiles)
# --------------------------------------------------------------------------------------------


def eager_rms_norm(x, w, eps: float = EPS):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def eager_fused_add_rms_norm(x, res, w, eps: float = EPS):
    res.add_(x)
    x.copy_(res * torch.rsqrt(res.pow(2).mean(-1, keepdim=True) + eps) * w)


def _eager_fp8_per_token(n):
    s = n.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    return (n.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), s


def eager_rms_norm_quant(x, w, eps: float = EPS):
    return _eager_fp8_per_token(eager_rms_norm(x, w, eps))


def eager_fused_add_rms_norm_quant(x, res, w, eps: float = EPS):
    res.add_(x)
    return _eager_fp8_per_token(eager_rms_norm(res, w, eps))


def eager_silu_and_mul(x):
    f = x.shape[-1] // 2
    return F.silu(x[..., :f]) * x[..., f:]


def _rope_inplace(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    x.copy_(torch.cat([o1, o2], dim=-1))


def eager_rotary_embedding(positions, q, k, cos_sin_cache):
    c = cos_sin_cache[positions].to(q.dtype)
    half = c.shape[-1] // 2
    cos, sin = c[:, None, :half], c[:, None, half:]
    _rope_inplace(q, cos, sin)
    _rope_inplace(k, cos, sin)


def eager_reshape_and_cache(k, v, k_cache, v_cache, slots):
    n = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(n, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(n, *v_cache.shape[2:]).index_copy_(0, slots, v)


# --------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------


@dataclass
class Case:
    op: str
    shape: str
    t: int
    make_set: Callable[[], dict]  # one input set
    nbytes: int  # bytes moved per call
    impls: Dict[str, Callable[[dict], object]] = field(default_factory=dict)
    peer_fns: dict = field(default_factory=dict)  # name -> (eager fn to compile, args getter)
    ext: dict = field(default_factory=dict)  # external peer name -> fn(module, set)


def _fi():
    return torch.ops.fastinfer


def make_case(op: str, t: int, dtype, device) -> Case:
    es = torch.tensor([], dtype=dtype).element_size()

    def rn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    if op == "rms_norm":
        h = HIDDEN

        def mk():
            return dict(x=rn(t, h), w=rn(h) * 0.1 + 1, out=torch.empty(t, h, device=device, dtype=dtype))

        c = Case(op, f"T={t} H={h}", t, mk, (2 * t * h + h) * es)
        c.impls = {
            "fastinfer": lambda s: _fi().rms_norm_out(s["out"], s["x"], s["w"], EPS),
            "torch": lambda s: eager_rms_norm(s["x"], s["w"]),
        }
        c.peer_fns = {"compile": (eager_rms_norm, lambda s: (s["x"], s["w"]))}
        c.ext = {
            "vllm": lambda m, s: m.rms_norm(s["out"], s["x"], s["w"], EPS),
            "flashinfer": lambda m, s: m.norm.rmsnorm(s["x"], s["w"], EPS, out=s["out"]),
        }
    elif op == "fused_add_rms_norm":
        h = HIDDEN

        def mk():
            return dict(x=rn(t, h), res=rn(t, h), w=rn(h) * 0.1 + 1)

        c = Case(op, f"T={t} H={h}", t, mk, (4 * t * h + h) * es)
        c.impls = {
            "fastinfer": lambda s: _fi().fused_add_rms_norm(s["x"], s["res"], s["w"], EPS),
            "torch": lambda s: eager_fused_add_rms_norm(s["x"], s["res"], s["w"]),
        }
        c.peer_fns = {"compile": (eager_fused_add_rms_norm, lambda s: (s["x"], s["res"], s["w"]))}
        c.ext = {
            "vllm": lambda m, s: m.fused_add_rms_norm(s["x"], s["res"], s["w"], EPS),
            "flashinfer": lambda m, s: m.norm.fused_add_rmsnorm(s["x"], s["res"], s["w"], EPS),
        }
    elif op == "rms_norm_quant":
        h = HIDDEN

        def mk():
            return dict(x=rn(t, h), w=rn(h) * 0.1 + 1, out=torch.empty(t, h, device=device, dtype=dtype))

        c = Case(op, f"T={t} H={h} e4m3/token", t, mk, (t * h * (es + 1) + h * es + 4 * t))
        c.impls = {
            "fastinfer": lambda s: _fi().rms_norm_quant(s["x"], s["w"], EPS, torch.float8_e4m3fn, None),
            "unfused": lambda s: _fi().fp8_quantize(_fi().rms_norm(s["x"], s["w"], EPS), "token", 128, None),
            "torch": lambda s: eager_rms_norm_quant(s["x"], s["w"]),
        }
        c.peer_fns = {"compile": (eager_rms_norm_quant, lambda s: (s["x"], s["w"]))}
    elif op == "fused_add_rms_norm_quant":
        h = HIDDEN

        def mk():
            return dict(x=rn(t, h), res=rn(t, h), w=rn(h) * 0.1 + 1)

        def unfused(s):  # the norm writes x in place, as the runner's unfused path does
            _fi().fused_add_rms_norm(s["x"], s["res"], s["w"], EPS)
            return _fi().fp8_quantize(s["x"], "token", 128, None)

        c = Case(op, f"T={t} H={h} e4m3/token", t, mk, (t * h * (3 * es + 1) + h * es + 4 * t))
        c.impls = {
            "fastinfer": lambda s: _fi().fused_add_rms_norm_quant(s["x"], s["res"], s["w"], EPS,
                                                                 torch.float8_e4m3fn, None),
            "unfused": unfused,
            "torch": lambda s: eager_fused_add_rms_norm_quant(s["x"], s["res"], s["w"]),
        }
        c.peer_fns = {"compile": (eager_fused_add_rms_norm_quant, lambda s: (s["x"], s["res"], s["w"]))}
    elif op == "silu_and_mul":
        f = FFN

        def mk():
            return dict(x=rn(t, 2 * f), out=torch.empty(t, f, device=device, dtype=dtype))

        c = Case(op, f"T={t} F={f}", t, mk, 3 * t * f * es)
        c.impls = {
            "fastinfer": lambda s: _fi().silu_and_mul_out(s["out"], s["x"]),
            "torch": lambda s: eager_silu_and_mul(s["x"]),
        }
        c.peer_fns = {"compile": (eager_silu_and_mul, lambda s: (s["x"],))}
        c.ext = {
            "vllm": lambda m, s: m.silu_and_mul(s["out"], s["x"]),
            "flashinfer": lambda m, s: m.activation.silu_and_mul(s["x"], out=s["out"]),
        }
    elif op == "rotary_embedding":
        d = HEAD_DIM
        from fastinfer.ops import build_rope_cache

        cache = build_rope_cache(MAX_POS, d, theta=500000.0, device=device)
        cache_h = cache.to(dtype)  # for peers that want the cache in the activation dtype

        def mk():
            qkv = rn(t, (HQ + 2 * HKV) * d)
            return dict(
                qkv=qkv,
                q=qkv[:, : HQ * d].view(t, HQ, d),
                k=qkv[:, HQ * d : (HQ + HKV) * d].view(t, HKV, d),
                pos=torch.randint(0, MAX_POS, (t,), device=device),
                cache=cache,
            )

        nbytes = 2 * t * (HQ + HKV) * d * es + t * 8 + t * d * 4
        c = Case(op, f"T={t} Hq={HQ} Hkv={HKV} D={d} (qkv views)", t, mk, nbytes)
        c.impls = {
            "fastinfer": lambda s: _fi().rotary_embedding(s["pos"], s["q"], s["k"], s["cache"], True),
            "torch": lambda s: eager_rotary_embedding(s["pos"], s["q"], s["k"], s["cache"]),
        }
        c.peer_fns = {"compile": (eager_rotary_embedding, lambda s: (s["pos"], s["q"], s["k"], s["cache"]))}
        c.ext = {
            "vllm": lambda m, s: m.rotary_embedding(
                s["pos"], s["q"].reshape(t, -1), s["k"].reshape(t, -1), d, cache_h, True
            ),
            "flashinfer": lambda m, s: m.rope.apply_rope_with_cos_sin_cache_inplace(
                s["pos"], s["q"].reshape(t, -1), s["k"].reshape(t, -1), d, s["cache"], True
            ),
        }
    elif op == "reshape_and_cache":
        d = HEAD_DIM
        nb = max(4, math.ceil(t / BLOCK) * 2)

        def mk():
            qkv = rn(t, (HQ + 2 * HKV) * d)
            return dict(
                k=qkv[:, HQ * d : (HQ + HKV) * d].view(t, HKV, d),
                v=qkv[:, (HQ + HKV) * d :].view(t, HKV, d),
                kc=torch.zeros(nb, BLOCK, HKV, d, device=device, dtype=dtype),
                vc=torch.zeros(nb, BLOCK, HKV, d, device=device, dtype=dtype),
                slots=torch.randperm(nb * BLOCK, device=device)[:t],
            )

        nbytes = 4 * t * HKV * d * es + t * 8
        c = Case(op, f"T={t} Hkv={HKV} D={d} BS={BLOCK}", t, mk, nbytes)
        c.impls = {
            "fastinfer": lambda s: _fi().reshape_and_cache(s["k"], s["v"], s["kc"], s["vc"], s["slots"], None, None),
            "torch": lambda s: eager_reshape_and_cache(s["k"], s["v"], s["kc"], s["vc"], s["slots"]),
        }
        c.peer_fns = {
            "compile": (eager_reshape_and_cache, lambda s: (s["k"], s["v"], s["kc"], s["vc"], s["slots"]))
        }
        c.ext = {
            "vllm": lambda m, s: m.reshape_and_cache_flash(
                s["k"], s["v"], s["kc"], s["vc"], s["slots"], "auto",
                torch.ones(1, device=device), torch.ones(1, device=device),
            ),
        }
    else:
        raise ValueError(f"unknown op {op!r}; choose from {ALL_OPS}")
    return c


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


def _import_peer(name):
    try:
        if name == "vllm":
            from vllm import _custom_ops as m  # type: ignore
        else:
            import flashinfer as m  # type: ignore
        return m
    except Exception:
        return None


def _set_bytes(s: dict) -> int:
    seen, total = set(), 0
    for v in s.values():
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def run_case(case: Case, device, args, peers: dict) -> List[dict]:
    torch.manual_seed(0)
    first = case.make_set()
    target = args.l2_bytes if device.type == "cuda" else args.cpu_rotate_bytes
    copies = int(min(args.max_copies, max(2, math.ceil(target / max(1, _set_bytes(first))))))
    sets = [first] + [case.make_set() for _ in range(copies - 1)]

    impls = dict(case.impls)
    if args.compile:
        fn, get_args = case.peer_fns["compile"]
        # default dynamic=None: the first shape compiles static, a second shape recompiles with
        # dynamic sizes (what a user of torch.compile gets); keeps the number of compiles small
        cfn = torch.compile(fn)
        impls["compile"] = lambda s, cfn=cfn, get_args=get_args: cfn(*get_args(s))
    for pname, mod in peers.items():
        if pname in case.ext:
            impls[pname] = lambda s, f=case.ext[pname], m=mod: f(m, s)

    label = device_label(device)
    rows = []
    for name, fn in impls.items():
        row = dict(op=case.op, shape=case.shape, T=case.t, impl=name, device=label,
                   dtype=str(args.dtype).replace("torch.", ""), copies=copies)
        try:
            us = time_fn(fn, sets, device, args.budget, args.reps, args.warmup)
            row.update(us=us, gbps=case.nbytes / (us * 1e-6) / 1e9)
        except Exception as e:  # a peer that rejects the shape must not stop the run
            row.update(us=None, gbps=None, error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
        rows.append(row)
    fi = next((r for r in rows if r["impl"] == "fastinfer"), None)
    for r in rows:
        if fi and fi.get("us") and r.get("us"):
            r["speedup_of_fastinfer"] = r["us"] / fi["us"]
    del sets
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def print_table(rows):
    hdr = f"{'device':<6} {'op':<20} {'shape':<40} {'impl':<10} {'us':>11} {'GB/s':>8} {'fi speedup':>10}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        dev = "CPU" if r["device"].startswith("CPU") else "GPU"
        us = f"{r['us']:.2f}" if r.get("us") else "error"
        gb = f"{r['gbps']:.1f}" if r.get("gbps") else "-"
        sp = f"{r['speedup_of_fastinfer']:.2f}x" if r.get("speedup_of_fastinfer") else "-"
        extra = f"  ({r['error']})" if r.get("error") else ""
        print(f"{dev:<6} {r['op']:<20} {r['shape']:<40} {r['impl']:<10} {us:>11} {gb:>8} {sp:>10}{extra}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=",".join(ALL_OPS), help="comma-separated subset of " + ",".join(ALL_OPS))
    p.add_argument("--tokens", default=None, help="comma-separated T values (default 1,16,512,4096)")
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.add_argument("--quick", action="store_true", help="few shapes, short timing, no compile on CPU")
    p.add_argument("--no-compile", dest="compile", action="store_false", default=None,
                   help="skip the torch.compile peer")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (CPU; default: torch's)")
    p.add_argument("--reps", type=int, default=None, help="timed batches (median is reported)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--budget", type=float, default=None, help="seconds of timed work per impl and shape")
    p.add_argument("--deadline", type=float, default=None,
                   help="stop starting new cases after this many seconds (results so far are kept)")
    p.add_argument("--max-copies", type=int, default=None,
                   help="max rotating input sets (default 8192 on GPU, 8 on CPU)")
    args = p.parse_args(argv)

    import fastinfer  # noqa: F401  (registers torch.ops.fastinfer)

    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = getattr(torch, args.dtype)
    on_cpu = device.type == "cpu"
    if args.compile is None:
        args.compile = not (on_cpu and args.quick)
    if args.tokens:
        tokens = [int(x) for x in args.tokens.split(",")]
    elif args.quick:
        tokens = [1, 512] if on_cpu else [1, 512, 4096]
    else:
        tokens = [1, 16, 512, 4096]
    args.reps = args.reps or (3 if on_cpu and args.quick else 5 if on_cpu else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if on_cpu else 5)
    args.budget = args.budget or (0.25 if args.quick else 1.0 if on_cpu else 0.2)
    args.max_copies = args.max_copies or (8 if on_cpu else 8192)
    args.l2_bytes = 256 << 20
    args.cpu_rotate_bytes = 64 << 20
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    for o in ops:
        if o not in ALL_OPS:
            p.error(f"unknown op {o!r}; choose from {ALL_OPS}")

    peers = {n: m for n in ("vllm", "flashinfer") if (m := _import_peer(n)) is not None} if not on_cpu else {}
    t_start = time.perf_counter()
    rows = []
    skipped = []
    for op in ops:
        for t in tokens:
            if args.deadline is not None and time.perf_counter() - t_start > args.deadline:
                skipped.append(f"{op} T={t}")
                continue
            rows.extend(run_case(make_case(op, t, args.dtype, device), device, args, peers))
            write_json(args, device, on_cpu, peers, rows, skipped)  # partial results survive a kill
    write_json(args, device, on_cpu, peers, rows, skipped)
    print_table(rows)
    elapsed = time.perf_counter() - t_start
    print(f"\n{device_label(device)}; torch {torch.__version__}; {elapsed:.1f} s"
          + ("; CPU figures only -- not a GPU measurement" if on_cpu else ""))
    if skipped:
        print(f"deadline reached; not run: {', '.join(skipped)}")
    if args.json:
        print(f"wrote {args.json}")
    return rows


def write_json(args, device, on_cpu, peers, rows, skipped):
    if args.json:
        out = dict(
            device=device_label(device),
            device_type="CPU" if on_cpu else "GPU",
            torch_version=torch.__version__,
            cuda_version=torch.version.cuda,
            git_commit=git_commit(),
            dtype=str(args.dtype).replace("torch.", ""),
            threads=torch.get_num_threads(),
            quick=args.quick,
            compile=args.compile,
            peers=sorted(peers),
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            not_run=skipped,
            rows=rows,
        )
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=2)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
