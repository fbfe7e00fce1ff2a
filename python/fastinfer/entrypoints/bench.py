"""``fastinfer bench``: end-to-end throughput and latency of the runner.

    fastinfer bench --preset llama3-8b --random-weights --batch 32 --input-len 512 --output-len 128 --json
    fastinfer bench --model PATH --batch 8 --compare-transformers
    fastinfer bench --model M --draft-model D --spec-mode chain --num-spec-tokens 4 --batch 1 --compare-no-spec

Reports TTFT (time from submission to the first token, mean over requests), TPOT (time per output
token after the first, mean), output tokens/s and total (prompt + output) tokens/s. All requests are
submitted at once (offline throughput); greedy, EOS ignored. With ``--draft-model`` (speculative
decoding) it also reports the mean accepted length, the acceptance rate per depth and target
forwards per generated token; ``--compare-no-spec`` runs the same prompts again with speculation
off (same engine) and reports the speedup. ``--spec-methods a,b,..`` compares several speculative
methods against no speculation in one run (:mod:`.bench_spec`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Dict, Optional

import torch

from .. import cuda_available
from ..engine.config import parse_dtype
from ..engine.llm import LLM
from ..engine.params import SamplingParams
from ..engine.worker import serve_torchrun_worker
from ..layers import TensorDictReader
from ..models import ModelConfig, default_dtype, find_gguf, load_model, random_weights
from .args import BENCH_OPTIONS, add_cli_args, add_quant_args, llm_kwargs
from .bench_spec import SPEC_ENTRIES, run_spec_comparison, spec_metrics

__all__ = ["PRESETS", "add_bench_parser", "build_random_model"]

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


@torch.no_grad()
def build_random_model(preset: str, dtype, device: torch.device, max_positions: int, seed: int = 0):
    """``(model, tensors)``: a ``LlamaForCausalLM`` of a preset's shape with random weights
    (N(0, 0.02), norms = 1) and those weights by checkpoint name; ``dtype`` None: the device's
    ``dtype="auto"`` (:func:`~fastinfer.models.default_dtype`)."""
    cfg = ModelConfig.from_dict(_preset_dict(preset))
    dtype = default_dtype(cfg, device) if dtype is None else dtype
    tensors = random_weights(cfg, dtype, device, seed)
    return load_model(TensorDictReader(tensors, f"random {preset}"), config=cfg, dtype=dtype, device=device,
                      max_positions=max_positions), tensors


@torch.no_grad()
def _hf_model(args, dtype, device: torch.device, tensors: Optional[Dict[str, torch.Tensor]]):
    """The transformers model for --compare-transformers (for a preset: the same random weights)."""
    import transformers

    if args.model:
        gguf_file = find_gguf(args.model)
        if gguf_file:  # transformers dequantises a GGUF file on load (needs the gguf package)
            return transformers.AutoModelForCausalLM.from_pretrained(
                os.path.dirname(os.path.abspath(gguf_file)), gguf_file=os.path.basename(gguf_file),
                dtype=dtype).to(device).eval()
        return transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    d = _preset_dict(args.preset)
    d.pop("architectures"), d.pop("model_type")
    with torch.device(device):
        hf = transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(**d), dtype=dtype)
    hf.load_state_dict(tensors, strict=not d["tie_word_embeddings"])
    return hf.eval()


def _timed_run(llm, prompts, sp, speculative: Optional[bool] = None):
    """Submit all prompts at once and run them to completion; returns (elapsed_s, start, outputs)."""
    if speculative is not None:
        sp = dataclasses.replace(sp, speculative=speculative)
    start = time.perf_counter()
    outs = llm.generate(prompts, sp)
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)
    return time.perf_counter() - start, start, outs


def cmd_bench(args) -> int:
    if args.spec_methods:
        if args.preset or args.draft_model or args.spec_model or args.spec_method:
            raise SystemExit("--spec-methods runs its own methods on --model (default: the shipped model); "
                             "drop --preset / --draft-model / --spec-model / --spec-method")
        opts = llm_kwargs(args, ("dtype", "device", "max_num_batched_tokens", "num_kv_blocks", "kv_cache_dtype",
                                 "deterministic"))
        return run_spec_comparison(args, dict(opts, max_num_seqs=max(args.batch, 1),
                                              max_model_len=args.max_model_len or 1024,
                                              enable_prefix_caching=False, seed=args.seed))
    if bool(args.model) == bool(args.preset):
        raise SystemExit("give exactly one of --model PATH or --preset NAME --random-weights")
    if args.preset and not args.random_weights:
        raise SystemExit("--preset needs --random-weights (presets have no weights to download)")
    if args.compare_no_spec and not (args.draft_model or args.spec_model):
        raise SystemExit("--compare-no-spec needs --draft-model or --spec-model")
    device = torch.device(args.device if args.device else ("cuda" if cuda_available() else "cpu"))
    dtype = parse_dtype(args.dtype)  # None: auto, resolved by the engine (a preset: by build_random_model)
    max_len = args.max_model_len or (args.input_len + args.output_len + 16)
    t0 = time.perf_counter()
    tensors = None
    # the options given, with what this command fixes: one batch of prompts, no prefix reuse
    opts = dict(llm_kwargs(args, BENCH_OPTIONS), device=device, max_model_len=max_len,
                max_num_seqs=max(args.batch, 1), enable_prefix_caching=False)
    if args.preset:
        model, tensors = build_random_model(args.preset, dtype, device, max_len)
        if not args.compare_transformers:
            tensors = None
        opts.pop("dtype", None)  # the model is built in it
        llm = LLM(model, **opts)
        del model  # quantisation rebuilds it: do not keep the float copy alive
    else:
        kw = dict(opts, load_progress=True)
        if serve_torchrun_worker(kw):  # torchrun rank > 0: served rank 0's engine
            return 0
        llm = LLM(**kw)
    load_s = time.perf_counter() - t0
    dtype = llm.config.model_dtype
    V = llm.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, V, (args.batch, args.input_len), generator=g).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
    for _ in range(args.warmup):
        llm.generate(prompts[: min(len(prompts), 4)], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))

    spec = llm.config.speculative
    st0 = llm.stats()
    elapsed, start, outs = _timed_run(llm, prompts, sp)
    st1 = llm.stats()
    ttft = [o.metrics["first_token_time"] - start for o in outs]
    tpot = [(o.metrics["finished_time"] - o.metrics["first_token_time"]) / max(len(o.outputs[0].token_ids) - 1, 1)
            for o in outs if len(o.outputs[0].token_ids) > 1]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    res: Dict[str, Any] = {
        "model": args.model or f"{args.preset} (random weights)",
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "dtype": str(dtype).replace("torch.", ""),
        "quantization": args.quantization, "kv_cache_dtype": str(llm.kv_cache_dtype).replace("torch.", ""),
        "deterministic": llm.config.deterministic, "batch": args.batch, "input_len": args.input_len, "output_len": args.output_len,
        "load_s": round(load_s, 3), "elapsed_s": round(elapsed, 4),
        "ttft_ms_mean": round(1e3 * sum(ttft) / len(ttft), 3),
        "ttft_ms_max": round(1e3 * max(ttft), 3),
        "tpot_ms_mean": round(1e3 * sum(tpot) / len(tpot), 3) if tpot else None,
        "output_tokens_per_s": round(out_tokens / elapsed, 2),
        "total_tokens_per_s": round((out_tokens + args.batch * args.input_len) / elapsed, 2),
        "num_preemptions": llm.stats()["num_preemptions"], "num_kv_blocks": llm.stats()["num_kv_blocks"],
    }
    if spec is not None:
        res.update({
            "draft_model": args.draft_model, "spec_method": spec.method, "spec_model": args.spec_model or args.draft_model,
            "spec_mode": spec.mode, "num_spec_tokens": spec.num_tokens,
            "spec_tree_topk": spec.tree_topk if spec.mode == "tree" else None,
            "spec_tree_depth": spec.tree_depth if spec.mode == "tree" else None,
            **spec_metrics(st0, st1),
            # per request: target forward passes that computed its tokens / its generated tokens
            "target_forwards_per_generated_token": round(
                sum(o.metrics["target_forwards_per_token"] for o in outs) / len(outs), 4),
        })
        if args.compare_no_spec:
            base_s, _, base_outs = _timed_run(llm, prompts, sp, speculative=False)
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
        hf = _hf_model(args, dtype, device, tensors)
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
    llm.shutdown()  # (tensor-parallel workers)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k:34s} {v}")
    return 0


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="end-to-end throughput / latency (TTFT, TPOT, tokens/s)",
                       description=__doc__.split("\n\n")[0])
    b.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="a model shape instead of a checkpoint, with --random-weights (default: none)")
    b.add_argument("--random-weights", action="store_true", help="fill the --preset model with random weights")
    b.add_argument("--batch", type=int, default=8, help="requests submitted at once (default: 8)")
    b.add_argument("--input-len", type=int, default=128, help="prompt length, tokens (random ids; default: 128)")
    b.add_argument("--output-len", type=int, default=64, help="generated tokens per request (default: 64)")
    b.add_argument("--warmup", type=int, default=1, help="warm-up generate() calls before timing (default: 1)")
    b.add_argument("--seed", type=int, default=0, help="seed of the random prompts and weights (default: 0)")
    b.add_argument("--compare-transformers", action="store_true",
                   help="also time transformers generate() on the same model and prompts (default: off)")
    b.add_argument("--json", action="store_true", help="print the results as JSON (default: a table)")
    add_cli_args(b, BENCH_OPTIONS, {
        "model": "checkpoint directory or .gguf file (default: none; give it or --preset with --random-weights)",
        "max_model_len": "longest prompt + completion, tokens (default: input + output + 16)"})
    b.add_argument("--compare-no-spec", action="store_true",
                   help="with --draft-model: run the same prompts again without speculation, report the speedup")
    b.add_argument("--compare-repeats", type=int, default=1,
                   help="with --compare-no-spec / --spec-methods: alternate spec / no-spec runs this many times "
                        "(median, min, max; default: 1)")
    b.add_argument("--spec-methods", default=None,
                   help="compare these speculative methods with no speculation in one run, comma-separated "
                        f"({', '.join(SPEC_ENTRIES)}; NAME:N[:TOPK[:DEPTH]] sets the sizes); code prompts, --batch at once, --compare-repeats "
                        "alternated runs (default: off)")
    b.add_argument("--spec-method-model", action="append", default=None, metavar="METHOD=PATH",
                   help="with --spec-methods: the spec model of a spec_method, e.g. eagle=DIR (repeatable; "
                        "default: the shipped fastinfer/assets/tiny-llama-{draft,medusa,eagle,eagle3})")
    b.add_argument("--num-prompts", type=int, default=8,
                   help="with --spec-methods: code prompts per run, in groups of --batch (default: 8)")
    b.add_argument("--spec-json", default=None,
                   help="with --spec-methods: also write the results to this JSON file (default: none)")
    add_quant_args(b)
    b.set_defaults(func=cmd_bench)

