"""Command line: ``fastinfer generate`` and ``fastinfer bench`` (also ``python -m fastinfer``).

    fastinfer generate --prompt "Once upon a time" --max-tokens 32            # the shipped tiny model
    fastinfer generate --model PATH --chat --prompt "Hi!" --temperature 0.7 --stream
    fastinfer bench --preset llama3-8b --random-weights --batch 32 --input-len 512 --output-len 128 --json
    fastinfer bench --model PATH --batch 8 --compare-transformers
    fastinfer generate --draft-model python/fastinfer/assets/tiny-llama-draft --spec-mode tree --prompt "def"
    fastinfer bench --model M --draft-model D --spec-mode chain --num-spec-tokens 4 --batch 1 --compare-no-spec
    fastinfer quantize --method int4 --group-size 128 [--symmetric] IN_DIR OUT_DIR   # see fastinfer.quant
    fastinfer generate --model PATH --quantization fp8 --prompt "..."           # quantise on load

``bench`` reports TTFT (time from submission to the first token, mean over requests), TPOT (time
per output token after the first, mean), output tokens/s and total (prompt + output) tokens/s.
All requests are submitted at once (offline throughput); greedy, EOS ignored. With ``--draft-model``
(speculative decoding) it also reports the mean accepted length, the acceptance rate per depth and
target forwards per generated token; ``--compare-no-spec`` runs the same prompts again with
speculation off (same engine) and reports the speedup.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict, List, Optional

import torch

PRESETS: Dict[str, Dict[str, Any]] = {
    # Meta-Llama-3-8B shapes
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001,
                      tie_word_embeddings=False),
    # Llama-3.2-1B shapes (no rope scaling)
    "llama3-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001,
                      tie_word_embeddings=True),
    # practical on a CPU
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048, max_position_embeddings=4096, rope_theta=10000.0,
                 rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
}


def _preset_dict(name: str) -> Dict[str, Any]:
    if name not in PRESETS:
        raise SystemExit(f"unknown preset {name!r} (one of {', '.join(PRESETS)})")
    return dict(PRESETS[name], architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu")


def _dtype(name: Optional[str]):
    from .engine.llm import _DTYPES

    if name is None:
        return None
    if name not in _DTYPES:
        raise SystemExit(f"unknown dtype {name!r}")
    return _DTYPES[name]


def _device(name: Optional[str]) -> torch.device:
    from . import cuda_available

    return torch.device(name if name else ("cuda" if cuda_available() else "cpu"))


@torch.no_grad()
def build_random_model(preset: str, dtype, device: torch.device, max_positions: int, seed: int = 0):
    """A ``LlamaForCausalLM`` of a preset's shape with random weights (N(0, 0.02), norms = 1)."""
    from .models import LlamaForCausalLM, ModelConfig

    cfg = ModelConfig.from_dict(_preset_dict(preset))
    model = LlamaForCausalLM(cfg, dtype=dtype, device=device, max_positions=max_positions)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=g)
    return model.eval()


@torch.no_grad()
def _hf_model(args, dtype, device: torch.device, ours=None):
    """The transformers model for --compare-transformers (for a preset: ours' weights copied in)."""
    import transformers

    if args.model:
        return transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    d = _preset_dict(args.preset)
    d.pop("architectures"), d.pop("model_type")
    cfg = transformers.LlamaConfig(**d)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM._from_config(cfg, dtype=dtype)
    from .models.loader import _targets

    targets = _targets(ours)
    for name, t in hf.state_dict().items():
        if name in targets:
            dst, off, rows = targets[name]
            t.copy_(dst.narrow(0, off, rows))
    return hf.eval()


def _quant_kwargs(args) -> Dict[str, Any]:
    """``quantization`` / ``quantization_config`` for LLM(...) from --quantization and its options."""
    if args.quantization is None:
        if args.group_size is not None or args.symmetric or not args.pad_groups:
            raise ValueError("--group-size / --symmetric / --no-pad-groups need --quantization int4")
        return {}
    qc: Dict[str, Any] = {}
    if args.group_size is not None:
        qc["group_size"] = args.group_size
    if args.symmetric:
        qc["symmetric"] = True
    if not args.pad_groups:
        qc["pad_groups"] = False
    return {"quantization": args.quantization, "quantization_config": qc or None}


def _add_quant_args(p: argparse.ArgumentParser, on_load: bool) -> None:
    if on_load:
        p.add_argument("--quantization", default=None,
                       help="fp8 | int4: quantise a float checkpoint on load (default: as stored)")
    p.add_argument("--group-size", type=int, default=None, help="int4 group size (default 128)")
    p.add_argument("--symmetric", action="store_true", help="int4 without zero points (z = 8)")
    p.add_argument("--no-pad-groups", dest="pad_groups", action="store_false",
                   help="int4: refuse layers whose input size the group size does not divide (default: zero-pad)")


def cmd_quantize(args) -> int:
    from .quant import QuantOptions, quantize_checkpoint

    opts = QuantOptions(args.method, group_size=128 if args.group_size is None else args.group_size,
                        symmetric=args.symmetric, pad_groups=args.pad_groups)
    if args.method != "int4" and (args.group_size is not None or args.symmetric or not args.pad_groups):
        raise ValueError("--group-size / --symmetric / --no-pad-groups apply to --method int4 only")
    res = quantize_checkpoint(args.in_dir, args.out_dir, opts, progress=not args.quiet)
    if not args.quiet:
        print(f"wrote {args.out_dir}: {res['quantized_linears']} {args.method} linears, "
              f"{', '.join(res['weights'])}; copied {', '.join(res['copied']) or 'nothing'}")
    return 0


# ------------------------------------------------------------------------------------------------
def cmd_generate(args) -> int:
    from .engine import LLM, SamplingParams

    sp = SamplingParams(n=args.n, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed_request,
                        max_tokens=args.max_tokens, stop=args.stop or None, ignore_eos=args.ignore_eos)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              seed=args.seed, load_progress=True, **_spec_kwargs(args), **_quant_kwargs(args))
    prompts: List[Any] = list(args.prompt or [])
    if not prompts:
        prompts = [sys.stdin.read()]
    if args.chat:
        def conv(p):
            msgs = [{"role": "system", "content": args.system}] if args.system else []
            return msgs + [{"role": "user", "content": p}]
        if llm.tokenizer is None:
            raise SystemExit("--chat needs a tokenizer")
        prompts = [{"prompt_token_ids": llm.tokenizer.apply_chat_template(conv(p), tokenize=True)} for p in prompts]
    if args.stream:
        for p in prompts:
            printed = 0
            for out in llm.stream(p, sp):
                text = out.outputs[0].text
                print(text[printed:], end="", flush=True)
                printed = len(text)
            print()
        return 0
    outs = llm.generate(prompts, sp, use_tqdm=len(prompts) > 1)
    if args.json:
        print(json.dumps([{"prompt": args.prompt[i] if args.prompt else None, "error": o.error,
                           "outputs": [{"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                                       for c in o.outputs]} for i, o in enumerate(outs)], indent=2))
        return 0
    for o in outs:
        if o.error:
            print(f"[error] {o.error}", file=sys.stderr)
            continue
        for c in o.outputs:
            head = f"[{c.index}] " if len(o.outputs) > 1 else ""
            print(f"{head}{c.text}" if llm.tokenizer is not None else f"{head}{c.token_ids}")
    return 0


def _spec_kwargs(args) -> Dict[str, Any]:
    if not args.draft_model:
        return {}
    return dict(draft_model=args.draft_model, spec_mode=args.spec_mode, num_spec_tokens=args.num_spec_tokens,
                spec_tree_topk=args.spec_tree_topk, spec_tree_depth=args.spec_tree_depth)


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-model", default=None, help="speculative decoding with this draft model (same tokenizer)")
    p.add_argument("--spec-mode", default="chain", choices=["chain", "tree"])
    p.add_argument("--num-spec-tokens", type=int, default=None,
                   help="chain length / tree node budget (default 4 chain, 8 tree)")
    p.add_argument("--spec-tree-topk", type=int, default=2, help="tree mode: children per expanded node")
    p.add_argument("--spec-tree-depth", type=int, default=None, help="tree mode: depth (default min(N, max(2, N // (2 * topk) + 1)))")


def _timed_run(llm, prompts, sp, speculative: Optional[bool] = None):
    """Submit all prompts, step to completion; returns (elapsed_s, requests, outputs)."""
    import dataclasses

    from tqdm.auto import tqdm

    if speculative is not None:
        sp = dataclasses.replace(sp, speculative=speculative)
    start = time.perf_counter()
    ids = [llm.add_request(p, sp) for p in prompts]
    reqs = [llm._requests[i] for i in ids]
    bar = tqdm(total=len(prompts) * sp.max_tokens, desc="bench", unit="tok", disable=not sys.stderr.isatty())
    done = 0
    while llm.has_unfinished_requests():
        llm._step()
        n = sum(len(s.output_token_ids) for r in reqs for s in r.seqs)
        bar.update(n - done)
        done = n
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)
    elapsed = time.perf_counter() - start
    bar.close()
    outs = [llm._output(r) for r in reqs]
    for i in ids:
        llm._requests.pop(i, None)
    return elapsed, start, reqs, outs


def cmd_bench(args) -> int:
    from .engine import LLM, SamplingParams

    if bool(args.model) == bool(args.preset):
        raise SystemExit("give exactly one of --model PATH or --preset NAME --random-weights")
    if args.preset and not args.random_weights:
        raise SystemExit("--preset needs --random-weights (presets have no weights to download)")
    if args.compare_no_spec and not args.draft_model:
        raise SystemExit("--compare-no-spec needs --draft-model")
    device = _device(args.device)
    dtype = _dtype(args.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    max_len = args.max_model_len or (args.input_len + args.output_len + 16)
    t0 = time.perf_counter()
    if args.preset:
        model = build_random_model(args.preset, dtype, device, max_len)
        llm = LLM(model, device=device, max_model_len=max_len, max_num_seqs=max(args.batch, 1),
                  max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
                  gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
                  enforce_eager=args.enforce_eager, **_spec_kwargs(args), **_quant_kwargs(args))
    else:
        llm = LLM(args.model, dtype=dtype, device=device, max_model_len=max_len, max_num_seqs=max(args.batch, 1),
                  max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
                  gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
                  load_progress=True, enforce_eager=args.enforce_eager, **_spec_kwargs(args), **_quant_kwargs(args))
    load_s = time.perf_counter() - t0
    V = llm.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, V, (args.batch, args.input_len), generator=g).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
    for _ in range(args.warmup):
        llm.generate(prompts[: min(len(prompts), 4)], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))

    st0 = llm.stats()
    d0 = (list(llm.spec.depth_reached), list(llm.spec.depth_offered)) if llm.spec is not None else None
    elapsed, start, reqs, outs = _timed_run(llm, prompts, sp)
    st1 = llm.stats()
    ttft = [r.first_token_time - start for r in reqs]
    tpot = [(r.finished_time - r.first_token_time) / max(len(o.outputs[0].token_ids) - 1, 1)
            for r, o in zip(reqs, outs) if len(o.outputs[0].token_ids) > 1]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    res: Dict[str, Any] = {
        "model": args.model or f"{args.preset} (random weights)",
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "dtype": str(dtype).replace("torch.", ""),
        "quantization": args.quantization,
        "batch": args.batch, "input_len": args.input_len, "output_len": args.output_len,
        "load_s": round(load_s, 3), "elapsed_s": round(elapsed, 4),
        "ttft_ms_mean": round(1e3 * sum(ttft) / len(ttft), 3),
        "ttft_ms_max": round(1e3 * max(ttft), 3),
        "tpot_ms_mean": round(1e3 * sum(tpot) / len(tpot), 3) if tpot else None,
        "output_tokens_per_s": round(out_tokens / elapsed, 2),
        "total_tokens_per_s": round((out_tokens + args.batch * args.input_len) / elapsed, 2),
        "num_preemptions": llm.stats()["num_preemptions"], "num_kv_blocks": llm.stats()["num_kv_blocks"],
    }
    if llm.spec is not None:
        nv = st1["spec_num_verify"] - st0["spec_num_verify"]
        acc = st1["spec_num_accepted_tokens"] - st0["spec_num_accepted_tokens"]
        drafted = st1["spec_num_draft_tokens"] - st0["spec_num_draft_tokens"]
        reached = [a - (d0[0][i] if i < len(d0[0]) else 0) for i, a in enumerate(llm.spec.depth_reached)]
        offered = [a - (d0[1][i] if i < len(d0[1]) else 0) for i, a in enumerate(llm.spec.depth_offered)]
        rates = [r / o if o else 0.0 for r, o in zip(reached, offered)]
        res.update({
            "draft_model": args.draft_model, "spec_mode": args.spec_mode, "num_spec_tokens": llm.spec.k,
            "spec_tree_topk": llm.spec.topk if args.spec_mode == "tree" else None,
            "spec_tree_depth": llm.spec.depth if args.spec_mode == "tree" else None,
            "spec_verifications": nv,
            "mean_accepted_length": round(acc / nv, 4) if nv else 0.0,
            "mean_tokens_per_verification": round((acc + nv) / nv, 4) if nv else 0.0,
            "draft_acceptance_rate": round(acc / drafted, 4) if drafted else 0.0,
            "acceptance_rate_per_depth": [round(r, 4) for r in rates],
            # per request: target forward passes that computed its tokens / its generated tokens
            "target_forwards_per_generated_token": round(
                sum(o.metrics["target_forwards_per_token"] for o in outs) / len(outs), 4),
        })
        if args.compare_no_spec:
            base_s, _, _, base_outs = _timed_run(llm, prompts, sp, speculative=False)
            base_tokens = sum(len(o.outputs[0].token_ids) for o in base_outs)
            same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, base_outs))
            res.update({
                "no_spec_elapsed_s": round(base_s, 4),
                "no_spec_output_tokens_per_s": round(base_tokens / base_s, 2),
                "no_spec_target_forwards_per_generated_token": round(
                    sum(o.metrics["target_forwards_per_token"] for o in base_outs) / len(base_outs), 4),
                "speedup_vs_no_spec": round(base_s / elapsed, 3),
                "greedy_outputs_identical": f"{same}/{len(outs)}",
            })
            if args.compare_repeats > 1:
                # alternate spec / no-spec runs (a shared machine's load drifts): median and spread
                ratios, spec_s, base_ss = [base_s / elapsed], [elapsed], [base_s]
                for _ in range(args.compare_repeats - 1):
                    e1 = _timed_run(llm, prompts, sp)[0]
                    e0 = _timed_run(llm, prompts, sp, speculative=False)[0]
                    spec_s.append(e1)
                    base_ss.append(e0)
                    ratios.append(e0 / e1)
                r = sorted(ratios)
                res.update({
                    "spec_elapsed_s_runs": [round(x, 4) for x in spec_s],
                    "no_spec_elapsed_s_runs": [round(x, 4) for x in base_ss],
                    "speedup_vs_no_spec_median": round(r[len(r) // 2] if len(r) % 2 else
                                                       (r[len(r) // 2 - 1] + r[len(r) // 2]) / 2, 3),
                    "speedup_vs_no_spec_min_max": [round(r[0], 3), round(r[-1], 3)],
                    # fastest run of each (the least disturbed by other load)
                    "speedup_vs_no_spec_best_of": round(min(base_ss) / min(spec_s), 3),
                })
    if args.compare_transformers:
        hf = _hf_model(args, dtype, device, ours=llm.model)
        x = torch.tensor(prompts, device=device)
        hf.generate(x[:1, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        y = hf.generate(x, max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
                        pad_token_id=0, eos_token_id=None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        hf_s = time.perf_counter() - t
        hf_tps = args.batch * args.output_len / hf_s
        ref = y[:, args.input_len:].tolist()
        agree = [sum(a == b for a, b in zip(o.outputs[0].token_ids, r)) / max(len(r), 1) for o, r in zip(outs, ref)]
        first = [next((i for i, (a, b) in enumerate(zip(o.outputs[0].token_ids, r)) if a != b), len(r))
                 for o, r in zip(outs, ref)]
        res.update({"transformers_elapsed_s": round(hf_s, 4),
                    "transformers_output_tokens_per_s": round(hf_tps, 2),
                    "speedup_vs_transformers": round(res["output_tokens_per_s"] / hf_tps, 3),
                    "greedy_token_agreement": round(sum(agree) / len(agree), 4),
                    "greedy_first_divergence_mean": round(sum(first) / len(first), 2)})
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k:34s} {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fastinfer", description="fastinfer LLM runner")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text (no --model: the shipped tiny model)")
    g.add_argument("--model", default=None)
    g.add_argument("--prompt", action="append", help="repeatable; default: read stdin")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    g.add_argument("--system", default=None, help="system message for --chat")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--stop", action="append")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--seed", type=int, default=0, help="engine seed")
    g.add_argument("--seed-request", type=int, default=None, help="per-request seed")
    g.add_argument("--stream", action="store_true")
    g.add_argument("--json", action="store_true")
    g.add_argument("--device", default=None)
    g.add_argument("--dtype", default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    _add_spec_args(g)
    _add_quant_args(g, on_load=True)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="end-to-end throughput/latency (TTFT, TPOT, tokens/s)")
    b.add_argument("--model", default=None)
    b.add_argument("--preset", default=None, choices=sorted(PRESETS))
    b.add_argument("--random-weights", action="store_true")
    b.add_argument("--batch", type=int, default=8)
    b.add_argument("--input-len", type=int, default=128)
    b.add_argument("--output-len", type=int, default=64)
    b.add_argument("--max-model-len", type=int, default=None)
    b.add_argument("--max-num-batched-tokens", type=int, default=None)
    b.add_argument("--num-kv-blocks", type=int, default=None)
    b.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    b.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--device", default=None)
    b.add_argument("--dtype", default=None)
    b.add_argument("--compare-transformers", action="store_true",
                   help="also time transformers generate() on the same model and prompts")
    b.add_argument("--json", action="store_true")
    _add_spec_args(b)
    b.add_argument("--compare-no-spec", action="store_true",
                   help="with --draft-model: run the same prompts again without speculation, report the speedup")
    b.add_argument("--compare-repeats", type=int, default=1,
                   help="with --compare-no-spec: alternate spec / no-spec runs this many times (median, min, max)")
    _add_quant_args(b, on_load=True)
    b.set_defaults(func=cmd_bench)

    q = sub.add_parser("quantize", help="write a quantised checkpoint (fp8 W8A8 or int4 W4A16; see fastinfer.quant)")
    q.add_argument("--method", required=True, help="fp8 | int4")
    _add_quant_args(q, on_load=False)
    q.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    q.add_argument("in_dir", metavar="IN_DIR", help="float safetensors checkpoint")
    q.add_argument("out_dir", metavar="OUT_DIR", help="output directory (created; must hold no weights)")
    q.set_defaults(func=cmd_quantize)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"fastinfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
