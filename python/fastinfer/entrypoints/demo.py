"""`make demo`: the shipped tiny model completes a code prompt (fastinfer.LLM, continuous batching
over the paged KV cache), then every op runs on sample data, through each backend present, with
its error against the fp64 reference and its time. Backends: "cpu" (ATen impls), "sim" (the CUDA kernels run by the simt
emulator on the CPU: slow by design, small shapes) and "cuda" (when a GPU is present).
Timings on cpu/sim are CPU timings; nothing here is a GPU figure unless the backend says cuda."""

from __future__ import annotations

import os
import time

import torch

import fastinfer
from fastinfer import ops, reference


def _sample(backend: str, dtype: torch.dtype, device: str):
    """(name, run, ref) triples; run() returns the tensors to compare, ref() their references."""
    big = backend != "sim"
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    T = 100 if big else 17
    H = 4096 if big else 200
    F = 14336 if big else 96
    Hq, Hkv, D = (32, 8, 128) if big else (4, 2, 64)
    NB, BS = (64, 16) if big else (4, 16)
    ns = torch.ops.fastinfer_sim if backend == "sim" else torch.ops.fastinfer
    x, w, res = rnd(T, H), rnd(H, scale=0.5) + 1, rnd(T, H)
    act = rnd(T, 2 * F)
    qkv = rnd(T, (Hq + 2 * Hkv) * D)
    q, k = qkv[:, : Hq * D].view(T, Hq, D), qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D :].view(T, Hkv, D)
    positions = torch.randint(0, 4096, (T,), generator=g).to(device)
    cos_sin = ops.build_rope_cache(4096, D, theta=500000.0, device=device)
    slots = torch.randperm(NB * BS, generator=g)[:T].to(device)
    slots[::7] = -1
    k_cache = torch.full((NB, BS, Hkv, D), 3.0, dtype=dtype, device=device)

    def fused():
        xo, ro = x.clone(), res.clone()
        ns.fused_add_rms_norm(xo, ro, w, 1e-6)
        return xo, ro

    def rope():
        qo, ko = q.clone(), k.clone()
        ns.rotary_embedding(positions, qo, ko, cos_sin, True)
        return qo, ko

    def cache():
        kc, vc = k_cache.clone(), k_cache.clone()
        ns.reshape_and_cache(k, v, kc, vc, slots)
        return kc, vc

    return [
        (f"rms_norm [{T}, {H}]", lambda: (ns.rms_norm(x, w, 1e-6),), lambda: (reference.rms_norm(x, w, 1e-6),)),
        (f"fused_add_rms_norm [{T}, {H}]", fused, lambda: reference.fused_add_rms_norm(x, res, w, 1e-6)),
        (f"silu_and_mul [{T}, {2 * F}]", lambda: (ns.silu_and_mul(act),), lambda: (reference.silu_and_mul(act),)),
        (f"rotary_embedding T={T} Hq={Hq} Hkv={Hkv} D={D}", rope,
         lambda: reference.rotary_embedding(positions, q, k, cos_sin, True)),
        (f"reshape_and_cache T={T} NB={NB} BS={BS}", cache,
         lambda: reference.reshape_and_cache(k, v, k_cache, k_cache, slots)),
    ]


def _time(fn, device: str, reps: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


def generate_demo() -> None:
    from fastinfer.engine import default_model_path

    path = default_model_path()
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        print(f"(no shipped model at {path}: skipping generation)")
        return
    torch.set_num_threads(1)  # tiny matmuls: one thread beats two contending ones
    llm = fastinfer.LLM(path)
    # no trailing whitespace: the tokenizer joins a newline to the next line's indentation
    prompts = ["def fibonacci(n):", "import os\n\n\ndef read_file(path):"]
    start = time.perf_counter()
    outs = llm.generate(prompts, fastinfer.SamplingParams(temperature=0.0, max_tokens=48))
    secs = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    device = "GPU" if str(llm.device).startswith("cuda") else "CPU"
    print(f"shipped model {os.path.basename(path)}: {tokens} tokens in {secs:.2f} s ({tokens / secs:.0f} tok/s, {device}), greedy")
    for o in outs:
        print("-" * 72)
        print(o.prompt + o.outputs[0].text)
    print("-" * 72)
    eagle = os.path.join(os.path.dirname(path), "tiny-llama-eagle")
    if os.path.isdir(eagle):  # the same completions, speculated by the shipped EAGLE head (an EAGLE-2 tree)
        spec = fastinfer.LLM(path, spec_method="eagle", spec_model=eagle, spec_mode="tree", num_spec_tokens=8)
        souts = spec.generate(prompts, fastinfer.SamplingParams(temperature=0.0, max_tokens=48))
        same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, souts))
        print(f"EAGLE-2 tree (tiny-llama-eagle): identical greedy output {same}, "
              f"{spec.stats()['spec_mean_tokens_per_verify']:.2f} tokens per target forward")


def main() -> None:
    generate_demo()
    backends = [("cpu", "cpu", torch.float32), ("cpu", "cpu", torch.bfloat16)]
    if fastinfer.sim_available():
        backends.append(("sim", "cpu", torch.bfloat16))
    if fastinfer.cuda_available():
        backends.append(("cuda", "cuda", torch.bfloat16))
    print(f"fastinfer {fastinfer.__version__}, torch {torch.__version__}; "
          f"GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none (cpu and sim timings are CPU timings)'}")
    print(f"{'backend':<6} {'dtype':<9} {'op':<44} {'max abs err':>12} {'rel err':>9} {'time':>12}")
    for backend, device, dtype in backends:
        for name, run, ref in _sample(backend, dtype, device):
            outs, refs = run(), ref()
            err = max((o.double().cpu() - r.double().cpu()).abs().max().item() for o, r in zip(outs, refs))
            rel = max(((o.double().cpu() - r.double().cpu()).norm() / r.double().cpu().norm()).item()
                      for o, r in zip(outs, refs))
            us = _time(run, device, 3 if backend == "sim" else 20)
            unit = "GPU" if device == "cuda" else "CPU"
            print(f"{backend:<6} {str(dtype).replace('torch.', ''):<9} {name:<44} {err:>12.3e} {rel:>9.2e} "
                  f"{us:>8.0f} µs {unit}")


if __name__ == "__main__":
    main()
