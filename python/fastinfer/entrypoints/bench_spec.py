"""``fastinfer bench --spec-methods ...``: speculative methods side by side against no speculation.

    fastinfer bench --spec-methods draft-chain,draft-tree,medusa,eagle-chain,eagle-tree \\
        --batch 1 --output-len 64 --compare-repeats 3 --spec-json bench/results/spec-cpu.json
    fastinfer bench --spec-methods eagle-tree:8:2,eagle-tree:16:4:3,eagle-chain:6   # sizes N[:TOPK[:DEPTH]]

Each entry of :data:`SPEC_ENTRIES` is a method with its sizes and its spec model (default: the asset
shipped next to the target, ``fastinfer/assets``; ``--spec-method-model METHOD=PATH`` replaces it;
no DFlash drafter ships, so the ``dflash-*`` entries need ``--spec-method-model dflash=DIR``).
One engine per entry; the no-spec runs are the same engine with speculation opted out per request,
alternated with the spec runs (a shared machine's load drifts). Greedy, EOS ignored, code prompts
(the heads were trained on code). Reported per entry: tokens per target forward (accepted + 1 per
verification), acceptance per depth, and the wall-clock speedup over no-spec (median of
``--compare-repeats`` ratios, min and max). An entry whose method the runner lacks, or whose spec
model is missing, is skipped with the reason.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from typing import Any, Dict, List, Optional

import torch

from ..engine.config import SPEC_METHODS, default_model_path
from ..engine.llm import LLM
from ..engine.params import SamplingParams

__all__ = ["SPEC_ENTRIES", "CODE_PROMPTS", "run_spec_comparison", "spec_metrics"]

#: name -> (spec_method, default spec model under fastinfer/assets, LLM speculative keyword arguments;
#: the sizes not given are the method's defaults, see fastinfer.engine.speculative.registry)
SPEC_ENTRIES: Dict[str, tuple] = {
    "draft-chain": ("draft", "tiny-llama-draft", dict(spec_mode="chain")),
    "draft-tree": ("draft", "tiny-llama-draft", dict(spec_mode="tree")),
    "medusa": ("medusa", "tiny-llama-medusa", dict(spec_mode="tree")),
    "eagle-chain": ("eagle", "tiny-llama-eagle", dict(spec_mode="chain")),
    "eagle-tree": ("eagle", "tiny-llama-eagle", dict(spec_mode="tree")),
    "eagle3-chain": ("eagle3", "tiny-llama-eagle3", dict(spec_mode="chain")),
    "eagle3-tree": ("eagle3", "tiny-llama-eagle3", dict(spec_mode="tree")),
    "dflash-chain": ("dflash", "tiny-llama-dflash", dict(spec_mode="chain")),
    "dflash-tree": ("dflash", "tiny-llama-dflash", dict(spec_mode="tree")),
}

#: Python code prompts (none of them from the training corpus' files verbatim)
CODE_PROMPTS = [
    "def main(argv):\n    ",
    "import os\nimport sys\n\nclass",
    "    def __init__(self, name):\n",
    "def read_config(path):\n    \"\"\"Return the",
    "for key, value in sorted(items.items()):\n",
    "class Parser:\n    def parse(self, text):\n        ",
    "try:\n    import json\nexcept ImportError:\n",
    "    if not isinstance(value, str):\n        raise",
]


def spec_metrics(st0: Dict[str, Any], st1: Dict[str, Any]) -> Dict[str, Any]:
    """Speculation figures between two ``LLM.stats()`` snapshots."""
    nv = st1["spec_num_verify"] - st0["spec_num_verify"]
    acc = st1["spec_num_accepted_tokens"] - st0["spec_num_accepted_tokens"]
    drafted = st1["spec_num_draft_tokens"] - st0["spec_num_draft_tokens"]

    def since(key: str) -> List[int]:
        before = st0[key]
        return [a - (before[i] if i < len(before) else 0) for i, a in enumerate(st1[key])]

    reached, offered = since("spec_depth_reached"), since("spec_depth_offered")
    return {
        "spec_verifications": nv,
        "mean_accepted_length": round(acc / nv, 4) if nv else 0.0,
        "mean_tokens_per_verification": round((acc + nv) / nv, 4) if nv else 0.0,
        "draft_acceptance_rate": round(acc / drafted, 4) if drafted else 0.0,
        "acceptance_rate_per_depth": [round(r / o if o else 0.0, 4) for r, o in zip(reached, offered)],
    }


def _parse_overrides(items: Optional[List[str]]) -> Dict[str, str]:
    out = {}
    for it in items or []:
        method, sep, path = it.partition("=")
        if not sep or not path:
            raise SystemExit(f"--spec-method-model wants METHOD=PATH (e.g. eagle=/path/to/head), got {it!r}")
        out[method] = path
    return out


def _timed(llm, groups, sp) -> tuple:
    """(elapsed_s, outputs) of the prompt groups run one after another (each group at once)."""
    t = time.perf_counter()
    outs = [o for g in groups for o in llm.generate(g, sp)]
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)
    return time.perf_counter() - t, outs


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it is below it (results that travel)."""
    rel = os.path.relpath(os.path.abspath(path))
    return path if rel.startswith("..") else rel


def _entry(name: str, overrides: Dict[str, str], assets: str):
    """(method, path, kwargs) of an entry ``NAME[:N[:TOPK[:DEPTH]]]`` (sizes replacing the entry's:
    draft tokens, tree top-k, tree depth), or (None, reason) when it cannot run here."""
    base, *sizes = name.split(":")
    method, asset, kw = SPEC_ENTRIES[base]
    try:
        vals = [int(v) for v in sizes]
    except ValueError:
        raise SystemExit(f"--spec-methods: {name!r}: sizes after NAME: are ints (N[:TOPK[:DEPTH]])") from None
    kw = dict(kw, **dict(zip(("num_spec_tokens", "spec_tree_topk", "spec_tree_depth"), vals)))
    if method not in SPEC_METHODS:
        return None, f"spec_method {method!r} is not in this runner (one of {', '.join(SPEC_METHODS)})"
    path = overrides.get(method, os.path.join(assets, asset))
    if not os.path.exists(path):
        return None, f"spec model {path!r} not found (pass --spec-method-model {method}=PATH)"
    return (method, path, kw), None


def run_spec_comparison(args, engine_kw: Dict[str, Any]) -> int:
    names = [n.strip() for n in args.spec_methods.split(",") if n.strip()]
    unknown = [n for n in names if n.split(":")[0] not in SPEC_ENTRIES or n.count(":") > 3]
    if unknown or not names:
        raise SystemExit(f"--spec-methods: unknown {', '.join(unknown) or '(none)'} (choose from "
                         f"{', '.join(SPEC_ENTRIES)})")
    if args.compare_repeats < 1:
        raise SystemExit("--compare-repeats must be >= 1")
    model = args.model or default_model_path()
    assets = os.path.dirname(os.path.abspath(default_model_path()))
    overrides = _parse_overrides(args.spec_method_model)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    res: Dict[str, Any] = {"label": None, "model": _shown(model), "batch": args.batch, "output_len": args.output_len,
                           "repeats": args.compare_repeats, "methods": [], "skipped": []}
    base_runs: List[float] = []
    for name in names:
        entry, reason = _entry(name, overrides, assets)
        if entry is None:
            print(f"[bench] skipping {name}: {reason}", flush=True)
            res["skipped"].append({"name": name, "reason": reason})
            continue
        method, path, kw = entry
        llm = LLM(model, spec_method=method, spec_model=path, **kw, **engine_kw)
        if res["label"] is None:
            dev = llm.device
            res["label"] = "CPU" if dev.type == "cpu" else torch.cuda.get_device_name(dev)
            res["device"] = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)" \
                if dev.type == "cpu" else res["label"]
            res["dtype"] = str(llm.config.model_dtype).replace("torch.", "")
        tok = llm.tokenizer
        prompts = [tok.encode(p) if tok is not None else list(range(3, 3 + 8 + i)) for i, p in enumerate(CODE_PROMPTS)]
        prompts = (prompts * (1 + args.num_prompts // len(prompts)))[:args.num_prompts]
        groups = [prompts[i:i + max(args.batch, 1)] for i in range(0, len(prompts), max(args.batch, 1))]
        llm.generate(groups[0], warm)
        llm.generate(groups[0], dataclasses.replace(warm, speculative=False))
        spec = llm.config.speculative
        spec_s, no_s, ratios, figs, same = [], [], [], None, None
        for r in range(args.compare_repeats):
            st0 = llm.stats()
            e1, outs = _timed(llm, groups, sp)
            if r == 0:
                figs = spec_metrics(st0, llm.stats())
            e0, base = _timed(llm, groups, dataclasses.replace(sp, speculative=False))
            if r == 0:
                same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, base))
            spec_s.append(e1)
            no_s.append(e0)
            ratios.append(e0 / e1)
        base_runs += no_s
        drafted_tree = spec.mode == "tree" and not spec.entry.static_tree  # top-k / depth apply
        row = {"name": name, "spec_method": method, "spec_model": _shown(path), "spec_mode": spec.mode,
               "num_spec_tokens": spec.num_tokens,
               "spec_tree_topk": spec.tree_topk if drafted_tree else None,
               "spec_tree_depth": spec.tree_depth if drafted_tree else None,
               "tokens_per_target_forward": figs["mean_tokens_per_verification"], **figs,
               "speedup_median": round(statistics.median(ratios), 3),
               "speedup_min_max": [round(min(ratios), 3), round(max(ratios), 3)],
               "elapsed_s_runs": [round(x, 4) for x in spec_s], "no_spec_elapsed_s_runs": [round(x, 4) for x in no_s],
               "greedy_outputs_identical": f"{same}/{len(prompts)}"}
        res["methods"].append(row)
        print(f"[bench] {name}: {row['tokens_per_target_forward']:.3f} tokens/forward, speedup "
              f"{row['speedup_median']:.3f}x", flush=True)
        llm.shutdown()
        del llm
    total = args.num_prompts * args.output_len
    res["no_spec"] = {"elapsed_s_median": round(statistics.median(base_runs), 4) if base_runs else None,
                      "output_tokens_per_s": round(total / statistics.median(base_runs), 2) if base_runs else None,
                      "tokens_per_target_forward": 1.0}
    res["num_prompts"] = args.num_prompts
    if args.spec_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.spec_json)), exist_ok=True)
        with open(args.spec_json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
            f.write("\n")
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(format_table(res))
    return 0


def format_table(res: Dict[str, Any]) -> str:
    """The comparison as a Markdown table (what README shows)."""
    lines = [f"{res['label']}: {res['model']}, {res['num_prompts']} code prompts x {res['output_len']} tokens, "
             f"batch {res['batch']}, greedy; speedup = median of {res['repeats']} no-spec / spec wall-clock ratios",
             "",
             "| method | mode | draft tokens | tokens / target forward | acceptance per depth | speedup (min-max) |",
             "|---|---|---|---|---|---|",
             f"| no-spec | - | - | 1.000 | - | 1.000 ({res['no_spec']['output_tokens_per_s']} tokens/s) |"]
    for m in res["methods"]:
        size = str(m["num_spec_tokens"] or "all")
        if m["spec_tree_topk"]:
            size += f" (top-{m['spec_tree_topk']}, depth {m['spec_tree_depth']})"
        depth = " ".join(f"{a:.2f}" for a in m["acceptance_rate_per_depth"])
        lo, hi = m["speedup_min_max"]
        lines.append(f"| {m['name']} | {m['spec_mode']} | {size} | {m['tokens_per_target_forward']:.3f} | {depth} | "
                     f"{m['speedup_median']:.3f} ({lo:.2f}-{hi:.2f}) |")
    for s in res["skipped"]:
        lines.append(f"| {s['name']} | skipped: {s['reason']} | | | | |")
    return "\n".join(lines)
