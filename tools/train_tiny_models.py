#!/usr/bin/env python3
"""Train fastinfer's shipped default models from scratch on CPU.

Produces, under --out (normally python/fastinfer/assets):

  tiny-llama/        target model: HF LlamaForCausalLM (GQA, head_dim 64), ~4.7M params, bf16 safetensors
  tiny-llama-draft/  draft model for speculative decoding: ~0.9M params, same tokenizer
  README.md          what the models are, how they were trained, held-out perplexity, samples
  metadata.json      the same numbers, machine readable (plus the list of held-out files)

Both directories are complete, standard Hugging Face model directories (config.json,
model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json,
special_tokens_map.json) loadable with transformers.AutoModelForCausalLM / AutoTokenizer.

Corpus: the .py sources of the CPython standard library of the interpreter running this
script (test suites, idlelib, lib2to3 and site-packages excluded), in sorted path order.
Every 50th file (index % 50 == 25) is held out for perplexity; the tokenizer and the models
never see those files.

Usage:
  python tools/train_tiny_models.py --out python/fastinfer/assets \
      [--minutes-target 25 --minutes-draft 8] [--seed 0] [--threads 2]
  python tools/train_tiny_models.py --out /tmp/smoke --smoke     # seconds; tiny everything

Training is fp32 on CPU (bf16 autocast is not faster on typical CPUs), AdamW, linear warmup
+ cosine decay, 256-token context, packed sequences (<|bos|> file <|eos|> ...). The number of
steps is sized from a measured throughput so each model trains for about its time budget; the
schedule's progress is max(step / planned_steps, elapsed / budget), so a slower-than-measured
machine still ends on time with a fully decayed learning rate.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [BOS, EOS, PAD] + ROLE_TOKENS  # ids 0..5
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
EXCLUDED_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}
HELDOUT_EVERY, HELDOUT_OFFSET = 50, 25
CONTEXT = 256
MAX_POSITIONS = 1024
# No trailing newline/space: the byte-level pre-tokenizer glues "\n" to the following
# indentation and " " to the following word, so such prompts would be out of distribution.
SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef read_file(path):"]

# head_dim 64 everywhere: fastinfer's attention kernels are built for head_dim 64 and 128 (the
# docs/design.md op contract), so the shipped models must use one of them to run on a GPU too.
MODEL_SPECS = {
    "target": dict(
        dirname="tiny-llama",
        hidden_size=256, intermediate_size=704, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        batch_size=16, lr=2e-3, warmup=100,
    ),
    "draft": dict(
        dirname="tiny-llama-draft",
        hidden_size=128, intermediate_size=352, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        batch_size=16, lr=3e-3, warmup=60,
    ),
}
SMOKE_SPECS = {
    "target": dict(
        dirname="tiny-llama",
        hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        batch_size=2, lr=2e-3, warmup=2,
    ),
    "draft": dict(
        dirname="tiny-llama-draft",
        hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, head_dim=64,
        batch_size=2, lr=3e-3, warmup=2,
    ),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------- corpus

def list_corpus(stdlib: Path) -> list[str]:
    files = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
        for n in names:
            if n.endswith(".py"):
                files.append(Path(root, n).relative_to(stdlib).as_posix())
    return sorted(files)


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def load_corpus(stdlib: Path, smoke: bool):
    rels = list_corpus(stdlib)
    train, heldout = [], []
    for i, rel in enumerate(rels):
        text = read_text(stdlib / rel)
        if not text or not text.strip():
            continue
        (heldout if i % HELDOUT_EVERY == HELDOUT_OFFSET else train).append((rel, text))
    if smoke:
        train, heldout = train[:40], heldout[:2]
    return train, heldout


def corpus_digest(files) -> str:
    h = hashlib.sha256()
    for rel, text in files:
        h.update(rel.encode())
        h.update(b"\0")
        h.update(text.encode())
    return h.hexdigest()[:16]


# -------------------------------------------------------------------------------- tokenizer

def train_tokenizer(train_files, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((t for _, t in train_files), trainer=trainer, length=len(train_files))
    bos_id = tok.token_to_id(BOS)
    # Llama convention: encode() prepends <|bos|>; the models are trained with it too.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)]
        ),
    ])
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def save_tokenizer(tok, d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    added = {
        str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, s in enumerate(SPECIAL_TOKENS)
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": ROLE_TOKENS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    stm = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
           "additional_special_tokens": ROLE_TOKENS}
    (d / "special_tokens_map.json").write_text(json.dumps(stm, indent=2) + "\n")


def pack(tok, files) -> torch.Tensor:
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    encs = tok.encode_batch([t for _, t in files], add_special_tokens=False)
    ids = []
    for e in encs:
        ids.append(bos)
        ids.extend(e.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# ------------------------------------------------------------------------------------ model

def make_config(spec, vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"],
        head_dim=spec["head_dim"],
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        hidden_act="silu",
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


class Batcher:
    """Random windows of CONTEXT+1 tokens from the packed stream, epoch-wise shuffled."""

    def __init__(self, stream: torch.Tensor, batch_size: int, seed: int):
        self.stream, self.bs = stream, batch_size
        self.g = torch.Generator().manual_seed(seed)
        self.epoch, self.order, self.pos = -1, None, 0
        self._new_epoch()

    def _new_epoch(self):
        self.epoch += 1
        L = CONTEXT + 1
        off = int(torch.randint(0, CONTEXT, (1,), generator=self.g))
        n = (len(self.stream) - off) // L
        starts = off + torch.arange(n) * L
        self.order = starts[torch.randperm(n, generator=self.g)]
        self.pos = 0

    def next(self) -> torch.Tensor:
        if self.pos + self.bs > len(self.order):
            self._new_epoch()
        idx = self.order[self.pos:self.pos + self.bs]
        self.pos += self.bs
        return torch.stack([self.stream[s:s + CONTEXT + 1] for s in idx.tolist()])


def lm_loss(model, x: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), x[:, 1:].reshape(-1))


def train_model(name, spec, stream, vocab_size, minutes, seed, smoke, max_steps=None):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = make_config(spec, vocab_size)
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    model.train()
    nparam = n_params(model)
    log(f"{name}: {nparam:,} parameters ({nparam - vocab_size * spec['hidden_size']:,} non-embedding)")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec["lr"], betas=(0.9, 0.95), eps=1e-8,
    )
    batcher = Batcher(stream, spec["batch_size"], seed)
    bs_tokens = spec["batch_size"] * CONTEXT
    budget_s = minutes * 60.0
    warmup, peak, floor = spec["warmup"], spec["lr"], spec["lr"] * 0.1

    def lr_at(progress, step):
        if step < warmup:
            return peak * (step + 1) / warmup
        p = min(1.0, max(0.0, progress))
        return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * p))

    # Throughput probe on the real model: a few steps at warmup LR (they count as training).
    planned = max_steps
    step, t0, losses = 0, time.time(), []
    probe_steps = 3 if smoke else 12
    t_probe = None
    t_mark, s_mark, progress = t0, 0, 0.0
    while True:
        elapsed = time.time() - t0
        if planned is None and step == probe_steps:
            sec_per_step = (time.time() - t_probe) / (probe_steps - 2)
            planned = max(probe_steps + 1, int((budget_s - elapsed) / sec_per_step) + step)
            log(f"{name}: {sec_per_step:.3f} s/step = {bs_tokens / sec_per_step:,.0f} tok/s; "
                f"planning {planned} steps, re-planned every 100 ({planned * bs_tokens:,} tokens)")
        if step == 2:
            t_probe = time.time()
        if (planned is not None and max_steps is None and step > probe_steps
                and (step % 100 == 0 or step >= planned)):
            # re-plan from the recent rate (shared machines speed up and slow down)
            rate = (time.time() - t_mark) / max(1, step - s_mark)
            planned = max(step + 1, int((budget_s - elapsed) / rate) + step)
        if step % 100 == 0:
            t_mark, s_mark = time.time(), step
        if planned is not None:
            progress = max(progress, (step - warmup) / max(1, planned - warmup),
                           elapsed / budget_s)
            if step >= planned or (step >= warmup and elapsed >= budget_s):
                break
        lr = lr_at(progress, step)
        for gr in opt.param_groups:
            gr["lr"] = lr
        x = batcher.next()
        loss = lm_loss(model, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % (1 if smoke else 50) == 0:
            avg = sum(losses[-50:]) / len(losses[-50:])
            log(f"{name}: step {step}/{planned} loss {avg:.3f} lr {lr:.2e} "
                f"{time.time() - t0:.0f}s")
    train_time = time.time() - t0
    final_loss = sum(losses[-50:]) / max(1, len(losses[-50:]))
    log(f"{name}: done {step} steps, {step * bs_tokens:,} tokens, {train_time:.0f}s, "
        f"final train loss {final_loss:.3f}")
    stats = dict(
        parameters=nparam,
        non_embedding_parameters=nparam - vocab_size * spec["hidden_size"],
        steps=step,
        batch_size=spec["batch_size"],
        context=CONTEXT,
        tokens_seen=step * bs_tokens,
        epochs=round(step * bs_tokens / len(stream), 3),
        train_seconds=round(train_time, 1),
        peak_lr=peak,
        min_lr=floor,
        warmup_steps=warmup,
        final_train_loss=round(final_loss, 4),
    )
    return model, stats


@torch.no_grad()
def heldout_ppl(model, stream: torch.Tensor, max_tokens: int | None = None):
    """Token-level perplexity, non-overlapping windows of CONTEXT predictions."""
    model.eval()
    L = CONTEXT + 1
    n = (len(stream) - 1) // CONTEXT
    if max_tokens:
        n = min(n, max(1, max_tokens // CONTEXT))
    tot, cnt = 0.0, 0
    for b in range(0, n, 16):
        rows = [stream[i * CONTEXT:i * CONTEXT + L] for i in range(b, min(n, b + 16))]
        x = torch.stack(rows)
        logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1),
                              reduction="sum")
        tot += nll.item()
        cnt += x[:, 1:].numel()
    return math.exp(tot / cnt), cnt


@torch.no_grad()
def greedy_samples(model, tok, n_new=40):
    model.eval()
    out = {}
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tok.encode(prompt).ids])  # includes <|bos|>
        gen = model.generate(ids, max_new_tokens=n_new, do_sample=False,
                             eos_token_id=1, pad_token_id=2)
        out[prompt] = tok.decode(gen[0, ids.shape[1]:].tolist(), skip_special_tokens=False)
    return out


def save_model(model, tok, d: Path) -> None:
    from transformers import GenerationConfig

    d.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=2, do_sample=False, max_new_tokens=128
    )
    model.save_pretrained(d, safe_serialization=True)
    cfgp = d / "config.json"
    cfg = json.loads(cfgp.read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["dtype"] = "bfloat16"
    cfg["torch_dtype"] = "bfloat16"  # older readers
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    cfg.setdefault("rope_scaling", None)
    cfgp.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_tokenizer(tok, d)
    for f in d.iterdir():
        os.chmod(f, 0o644)


# ----------------------------------------------------------------------------------- readme

def write_readme(out: Path, meta: dict) -> None:
    t, dr = meta["models"]["target"], meta["models"]["draft"]

    def shape(m):
        c = m["config"]
        return (f"hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
                f"{c['num_attention_heads']} heads / {c['num_key_value_heads']} KV heads "
                f"(head_dim {c['head_dim']}), intermediate {c['intermediate_size']}, "
                f"vocab {c['vocab_size']}, tied embeddings, rope_theta 10000, "
                f"max_position_embeddings {MAX_POSITIONS}")

    rows = []
    for key, m in (("tiny-llama", t), ("tiny-llama-draft", dr)):
        s = m["train"]
        rows.append(f"| `{key}` | {m['train']['parameters']:,} | {s['steps']:,} | "
                    f"{s['tokens_seen']:,} ({s['epochs']} ep) | {s['train_seconds'] / 60:.1f} min | "
                    f"{s['final_train_loss']:.3f} | {m['heldout_ppl']:.2f} |")
    samples = []
    for key, m in (("tiny-llama", t), ("tiny-llama-draft", dr)):
        for p, g in m["samples"].items():
            samples.append(f"`{key}`, prompt {json.dumps(p)}:\n\n```python\n{p}{g}\n```\n")
    text = f"""# fastinfer default models

Two tiny Llama-architecture causal LMs trained from scratch by
`tools/train_tiny_models.py`, shipped so that the runner, tests and benchmarks have real,
standard Hugging Face checkpoints to load without any download. They are toys: they have
learned the *shape* of Python code, not how to program.

- `tiny-llama/`: target model, {shape(t)}.
- `tiny-llama-draft/`: draft model for speculative decoding, same tokenizer, {shape(dr)}.

Both are `LlamaForCausalLM` checkpoints in bfloat16 safetensors with a complete tokenizer
(`tokenizer.json`, byte-level BPE, {meta['tokenizer']['vocab_size']} tokens; special tokens
`<|bos|>`=0, `<|eos|>`=1, `<|pad|>`=2, `<|system|>`=3, `<|user|>`=4, `<|assistant|>`=5;
`encode()` prepends `<|bos|>`; a minimal jinja2 `chat_template` in `tokenizer_config.json`).

## Training

Command:

```
{meta['command']}
```

- Corpus: {meta['corpus']['n_train_files']} `.py` files of the CPython {meta['corpus']['python_version']}
  standard library (`{meta['corpus']['excluded_dirs']}` directories excluded), sorted by path;
  {meta['corpus']['train_tokens']:,} training tokens. Held out: every {HELDOUT_EVERY}th file
  (index % {HELDOUT_EVERY} == {HELDOUT_OFFSET}), {meta['corpus']['n_heldout_files']} files,
  {meta['corpus']['heldout_tokens']:,} tokens, listed in `metadata.json`; neither the tokenizer
  nor the models saw them.
- Packing: `<|bos|> file <|eos|>` concatenated, random {CONTEXT + 1}-token windows, context {CONTEXT}.
- fp32 on CPU ({meta['machine']}, {meta['threads']} threads), AdamW (betas 0.9/0.95,
  weight decay 0.1 on matrices), linear warmup then cosine decay to 10% of peak, grad clip 1.0,
  seed {meta['seed']}. Steps were sized from measured throughput to fit the time budget.

| model | params | steps | tokens seen | time | final train loss | held-out ppl |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Held-out perplexity is token-level (this tokenizer), over non-overlapping {CONTEXT}-token
windows of the held-out token stream, computed in fp32 before the bf16 conversion
(bf16 weights: target {t['heldout_ppl_bf16']:.2f}, draft {dr['heldout_ppl_bf16']:.2f}).

## Greedy samples (40 new tokens, shipped bf16 weights run in fp32)

{chr(10).join(samples)}
## License

The weights and tokenizer are derived from (trained on) the CPython standard library sources,
which are distributed under the Python Software Foundation License (PSF-2.0); see
https://docs.python.org/3/license.html. The training script is part of fastinfer.
"""
    (out / "README.md").write_text(text)


# ------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--minutes-target", type=float, default=25.0)
    ap.add_argument("--minutes-draft", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--smoke", action="store_true", help="tiny models, few steps, small corpus")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    specs = SMOKE_SPECS if args.smoke else MODEL_SPECS
    vocab_size = 512 if args.smoke else args.vocab_size
    max_steps = 6 if args.smoke else None
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    t_all = time.time()
    train_files, heldout_files = load_corpus(args.stdlib, args.smoke)
    log(f"corpus: {len(train_files)} train files, {len(heldout_files)} held-out files "
        f"from {args.stdlib}")
    tok = train_tokenizer(train_files, vocab_size)
    log(f"tokenizer: vocab {tok.get_vocab_size()}")
    train_stream, held_stream = pack(tok, train_files), pack(tok, heldout_files)
    log(f"tokens: train {len(train_stream):,}, held-out {len(held_stream):,} "
        f"({sum(len(t) for _, t in train_files) / len(train_stream):.2f} chars/token)")

    meta = {
        "command": "python tools/train_tiny_models.py " + " ".join(
            a if " " not in a else json.dumps(a) for a in (argv if argv is not None else sys.argv[1:])),
        "seed": args.seed,
        "threads": args.threads,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch_version": torch.__version__,
        "smoke": args.smoke,
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": tok.get_vocab_size(),
                      "special_tokens": SPECIAL_TOKENS, "chat_template": CHAT_TEMPLATE},
        "corpus": {
            "source": "CPython standard library .py files",
            "python_version": platform.python_version(),
            "excluded_dirs": sorted(EXCLUDED_DIRS),
            "heldout_rule": f"sorted index % {HELDOUT_EVERY} == {HELDOUT_OFFSET}",
            "n_train_files": len(train_files),
            "n_heldout_files": len(heldout_files),
            "train_tokens": len(train_stream),
            "heldout_tokens": len(held_stream),
            "train_sha256_16": corpus_digest(train_files),
            "heldout_files": [r for r, _ in heldout_files],
        },
        "models": {},
    }

    budgets = {"draft": args.minutes_draft, "target": args.minutes_target}
    for name in ("draft", "target"):
        spec = specs[name]
        model, stats = train_model(name, spec, train_stream, vocab_size, budgets[name],
                                   args.seed, args.smoke, max_steps)
        max_eval = 4096 if args.smoke else None
        ppl, n_eval = heldout_ppl(model, held_stream, max_eval)
        d = out / spec["dirname"]
        save_model(model, tok, d)
        ppl_bf16, _ = heldout_ppl(model, held_stream, max_eval)
        # samples from the shipped (bf16-rounded) weights, run in fp32
        samples = greedy_samples(model.float(), tok, n_new=8 if args.smoke else 40)
        log(f"{name}: held-out ppl {ppl:.3f} (bf16 {ppl_bf16:.3f}) over {n_eval:,} tokens")
        for p, g in samples.items():
            log(f"{name} sample: {p!r} -> {g!r}")
        meta["models"][name] = {
            "dir": spec["dirname"],
            "config": {k: v for k, v in spec.items() if k not in ("dirname", "batch_size", "lr", "warmup")}
            | {"vocab_size": vocab_size},
            "train": stats,
            "heldout_ppl": round(ppl, 3),
            "heldout_ppl_bf16": round(ppl_bf16, 3),
            "heldout_eval_tokens": n_eval,
            "samples": samples,
        }
        del model

    meta["total_seconds"] = round(time.time() - t_all, 1)
    (out / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    write_readme(out, meta)
    log(f"wrote {out} in {meta['total_seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
