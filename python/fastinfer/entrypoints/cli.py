"""Command line: ``fastinfer generate | serve | bench | quantize | eval`` (also ``python -m fastinfer``).

    fastinfer generate --prompt "Once upon a time" --max-tokens 32            # the shipped tiny model
    fastinfer generate --model PATH --chat --prompt "Hi!" --temperature 0.7 --stream
    fastinfer generate --draft-model python/fastinfer/assets/tiny-llama-draft --spec-mode tree --prompt "def"
    fastinfer generate --model PATH --quantization fp8 --prompt "..."           # quantise on load
    fastinfer serve [MODEL] --port 8000 [--api-key KEY]                           # OpenAI-compatible server
    fastinfer bench --preset llama3-8b --random-weights --batch 32 --input-len 512 --output-len 128 --json
    fastinfer quantize --method int4 --group-size 128 [--symmetric] IN_DIR OUT_DIR   # see fastinfer.quant
    fastinfer quantize --method int8 --smoothquant 0.5 [--calibration FILE] IN_DIR OUT_DIR
    fastinfer eval --dtype bfloat16 [--quantization int4]                        # held-out perplexity
    fastinfer generate --model PATH --tensor-parallel-size 2 --prompt "..."      # 2 spawned ranks
    fastinfer generate --model MOE --tensor-parallel-size 2 --expert-parallel-size 2 --prompt "..."  # experts split
    torchrun --nproc-per-node 2 -m fastinfer generate --model PATH --prompt "..." # rank 0 drives

``fastinfer <command> --help`` lists every option with its unit and default.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, List, Optional

from ..engine.llm import LLM
from ..engine.params import SamplingParams
from ..engine.worker import serve_torchrun_worker
from ..quant import QuantOptions, quantize_checkpoint
from . import eval as eval_cmd
from .args import GENERATE_OPTIONS, SERVE_OPTIONS, add_cli_args, add_quant_args, llm_kwargs
from .bench import add_bench_parser

__all__ = ["main", "build_parser"]


def cmd_quantize(args) -> int:
    opts = QuantOptions(args.method, group_size=128 if args.group_size is None else args.group_size,
                        symmetric=args.symmetric, pad_groups=args.pad_groups)
    if args.method != "int4" and (args.group_size is not None or args.symmetric or not args.pad_groups):
        raise ValueError("--group-size / --symmetric / --no-pad-groups apply to --method int4 only")
    if args.method != "int8" and (args.smoothquant is not None or args.calibration is not None):
        raise ValueError("--smoothquant / --calibration apply to --method int8 only")
    if args.calibration is not None and args.smoothquant is None:
        raise ValueError("--calibration needs --smoothquant ALPHA")
    calib = None
    if args.smoothquant is not None:
        calib = eval_cmd.calibration_ids(args.in_dir, args.calibration, args.calibration_tokens)
    res = quantize_checkpoint(args.in_dir, args.out_dir, opts, progress=not args.quiet,
                              smoothquant=args.smoothquant, calibration=calib)
    if not args.quiet:
        print(f"wrote {args.out_dir}: {res['quantized_linears']} {args.method} linears, "
              f"{', '.join(res['weights'])}; copied {', '.join(res['copied']) or 'nothing'}")
    return 0


def cmd_generate(args) -> int:
    sp = SamplingParams(n=args.n, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed_request,
                        max_tokens=args.max_tokens, stop=args.stop or None, ignore_eos=args.ignore_eos)
    kw = dict(llm_kwargs(args, GENERATE_OPTIONS), load_progress=True)
    if serve_torchrun_worker(kw):  # torchrun rank > 0: this process was a worker of rank 0's engine
        return 0
    llm = LLM(**kw)
    try:
        return _generate(llm, args, sp)
    finally:
        llm.shutdown()


def _generate(llm, args, sp) -> int:
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


def cmd_serve(args) -> int:
    import os

    from ..engine.async_llm import AsyncLLM
    from .openai.api_server import build_app, run_server
    from .openai.serving import ServeLimits
    from .openai.tool_parsers import check_tool_call_parser

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"MODEL {args.model_tag!r} and --model {args.model!r} differ: give one")
    model = args.model_tag if args.model_tag is not None else args.model
    name = args.served_model_name or (model if model is not None else "tiny-llama")
    limits = ServeLimits(max_n=args.max_n, max_tokens=args.max_tokens_limit, max_waiting=args.max_waiting)
    for field, v in (("--max-n", args.max_n), ("--max-tokens-limit", args.max_tokens_limit),
                     ("--max-body-bytes", args.max_body_bytes)):
        if v < 1:
            raise ValueError(f"{field} must be >= 1, got {v}")
    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    check_tool_call_parser(args.tool_call_parser)  # before the model loads
    kw = dict(llm_kwargs(args, SERVE_OPTIONS), model=model, load_progress=True)
    if serve_torchrun_worker(kw):  # torchrun rank > 0: this process was a worker of rank 0's engine
        return 0
    engine = AsyncLLM(**kw)
    app = build_app(engine, name, limits, api_key=args.api_key or os.environ.get("FASTINFER_API_KEY") or None,
                    max_body_bytes=args.max_body_bytes, model_root=engine.llm.model_path,
                    tool_call_parser=args.tool_call_parser)
    run_server(engine, app, args.host, args.port, args.log_level)
    return 0


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)")
    s.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="checkpoint directory or .gguf file (default: the shipped tiny model)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0 exposes it (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $FASTINFER_API_KEY, else none)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: MODEL as given, or tiny-llama)")
    s.add_argument("--max-waiting", type=int, default=1024,
                   help="requests waiting for admission at most; beyond: 503 + Retry-After (default: 1024)")
    s.add_argument("--max-n", type=int, default=16, help="largest n (completions per prompt) (default: 16)")
    s.add_argument("--max-tokens-limit", type=int, default=4096,
                   help="largest max_tokens a request may ask for, and the default when it asks none "
                        "(capped by max_model_len) (default: 4096)")
    s.add_argument("--max-body-bytes", type=int, default=4 << 20,
                   help="largest request body, in bytes; beyond: 413 (default: 4194304)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default: info)")
    s.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="enables tools in chat requests: the format of the model's tool calls, hermes (Hermes 2 "
                        "Pro, Qwen2.5, Qwen3) or llama3_json (Llama 3.x) (default: none, tools refused)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM command lines; --tool-call-parser alone enables tool calls")
    add_cli_args(s, SERVE_OPTIONS, {"model": "the same as MODEL (default: the shipped tiny model)"})
    add_quant_args(s)
    s.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fastinfer", description="fastinfer LLM runner")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text (no --model: the shipped tiny model)")
    g.add_argument("--prompt", action="append", help="a prompt; repeatable (default: read one from stdin)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    g.add_argument("--system", default=None, help="system message for --chat (default: none)")
    g.add_argument("--max-tokens", type=int, default=64, help="generated tokens at most, per completion (default: 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default: 0)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off (default: 1)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min-p x the top probability; 0 = off (default: 0)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="Hugging Face repetition penalty; 1 = off (default: 1)")
    g.add_argument("--n", type=int, default=1, help="completions per prompt (default: 1)")
    g.add_argument("--stop", action="append", help="stop string; repeatable (default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    g.add_argument("--seed-request", type=int, default=None,
                   help="per-request seed: the same completion whatever else runs (default: none)")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--json", action="store_true", help="print the outputs as JSON")
    add_cli_args(g, GENERATE_OPTIONS)
    add_quant_args(g)
    g.set_defaults(func=cmd_generate)

    add_serve_parser(sub)
    add_bench_parser(sub)

    q = sub.add_parser("quantize", help="write a quantised checkpoint (fp8 / int8 W8A8 or int4 W4A16; see "
                                        "fastinfer.quant)")
    q.add_argument("--method", required=True, help="fp8 (e4m3 weights per channel) | int4 (group-wise W4A16) | "
                                                   "int8 (int8 weights per channel, W8A8)")
    add_quant_args(q)
    q.add_argument("--smoothquant", type=float, default=None, metavar="ALPHA",
                   help="int8: SmoothQuant migration strength in [0, 1] (0.5 is the paper's default; default: off)")
    q.add_argument("--calibration", default=None, metavar="FILE",
                   help="--smoothquant: a UTF-8 text file run through the float model for the activation "
                        "statistics (default: the shipped corpus' training split, every 50th file)")
    q.add_argument("--calibration-tokens", type=int, default=16384,
                   help="--smoothquant: calibration tokens at most (default: 16384)")
    q.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    q.add_argument("in_dir", metavar="IN_DIR", help="float safetensors checkpoint directory")
    q.add_argument("out_dir", metavar="OUT_DIR", help="output directory (created; must hold no weights)")
    q.set_defaults(func=cmd_quantize)

    e = sub.add_parser("eval", help="held-out perplexity on the shipped models' evaluation text",
                       description=eval_cmd.__doc__.split("\n\n")[0])
    eval_cmd.add_args(e)
    e.set_defaults(func=eval_cmd.run)
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
