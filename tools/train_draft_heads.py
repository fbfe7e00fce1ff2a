#!/usr/bin/env python3
"""Train Medusa heads and an EAGLE head for the shipped tiny model, on CPU, in minutes.

Produces, under --out (normally python/fastinfer/assets):

  tiny-llama-medusa/  Medusa heads, vLLM layout (config.json: model_type "medusa", num_heads,
                      num_hidden_layers, medusa_fc_bias, original_lm_head; model.safetensors)
  tiny-llama-eagle/   EAGLE head, the EAGLE repository's layout (config.json: a one-layer Llama
                      config; model.safetensors: fc.*, layers.0.*)
  tiny-llama-eagle3/  EAGLE-3 head, the EAGLE repository's layout (fc.*, midlayer.*, norm, lm_head,
                      d2t, t2d)

The target (python/fastinfer/assets/tiny-llama) stays frozen; its final-normed hidden states and
logits on the training corpus of tools/train_tiny_models.py (the CPython standard library, the
same held-out files excluded) are the features and the soft labels (self-distillation: the heads
learn what the target would say, which is what verification accepts).

* Medusa head i at position p: ``num_layers`` blocks ``x + SiLU(W x + b)`` on ``f_p``, then the
  projection, shared by the heads and frozen to the target's lm_head (``original_lm_head``: a small
  asset); loss: cross-entropy against the target's distribution at position ``p + i + 1``.
* EAGLE at row p: ``fc([embed(t_{p+1}); f_p])`` then one Llama decoder layer (input norm kept,
  residual added, causal attention, RoPE at position p), output ``g``; loss: smooth-L1(g, f_{p+1})
  + EAGLE_CE x cross-entropy of ``lm_head(g)`` against the target's distribution at p + 1 (EAGLE's
  recipe, with weight 1.0 instead of EAGLE's 0.1: the top-1 token is what greedy verification
  accepts, and a head trained with 0.1 agreed with the target's top-1 on 28% of held-out rows). ``--eagle-levels`` > 1 also trains the head on its own
  output features, unrolled as the drafter runs it (a depth-k row attends to true-feature rows and
  its drafted ancestors; EAGLE-3's training-time test), the same targets at every level.

* EAGLE-3 at row p: ``fc`` of the residual streams entering target layers EAGLE3_AUX, the midlayer
  on [input_layernorm(embed(t_{p+1})); hidden_norm(feature)], ``lm_head(norm(g))`` over the draft
  vocabulary (the most frequent tokens of the corpus); EAGLE3_STEPS unrolled draft steps (the
  training-time test: step k feeds step k-1's outputs back as features, with the attention a
  depth-k draft token has); loss: cross-entropy against the target's distribution restricted to
  the draft vocabulary, per step (EAGLE-3 drops the feature loss).


Budgets are CPU minutes of this process (all threads), so a loaded machine does less work per wall
minute, not less work. After training, the held-out top-1 agreement with the target (Medusa head i;
EAGLE at each draft depth) is logged and written to draft_heads.json. Heads are stored in float16.

Usage:
  python tools/train_draft_heads.py --out python/fastinfer/assets [--minutes-medusa 3 --minutes-eagle 8]
  python tools/train_draft_heads.py --out /tmp/x --eval-only python/fastinfer/assets   # held-out agreement
  python tools/train_draft_heads.py --out python/fastinfer/assets --only eagle3 --minutes-eagle3 8 --threads 1
  python tools/train_draft_heads.py --out /tmp/heads --smoke       # seconds: a few steps
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import List

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_tiny_models as ttm  # noqa: E402  (the corpus and packing of the shipped models)

CONTEXT = 128
MEDUSA_HEADS, MEDUSA_LAYERS = 3, 1
EAGLE_LEVELS, EAGLE_CE = 2, 1.0  # unrolled draft steps in training; cross-entropy weight


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_target(path: str):
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    m.eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


@torch.no_grad()
def features(target, x: torch.Tensor):
    """Final-normed hidden states [B, T, H] and log-probabilities [B, T, V] of the target."""
    h = target.model(input_ids=x).last_hidden_state
    return h, torch.log_softmax(target.lm_head(h), dim=-1)


def soft_ce(logits: torch.Tensor, target_logp: torch.Tensor) -> torch.Tensor:
    return -(target_logp.exp() * torch.log_softmax(logits, dim=-1)).sum(-1).mean()


# ------------------------------------------------------------------------------------- Medusa

class Medusa(torch.nn.Module):
    def __init__(self, H: int):
        super().__init__()
        n = MEDUSA_HEADS * MEDUSA_LAYERS  # zero blocks: every head starts as the identity
        self.w = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(H, H)) for _ in range(n)])
        self.b = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(H)) for _ in range(n)])

    def forward(self, h: torch.Tensor, i: int) -> torch.Tensor:
        for j in range(MEDUSA_LAYERS):
            k = i * MEDUSA_LAYERS + j
            h = h + F.silu(F.linear(h, self.w[k], self.b[k]))
        return h


def medusa_loss(model, lm, h, logp):
    loss = 0.0
    for i in range(MEDUSA_HEADS):  # head i at p predicts the token at p + i + 2: target's view at p + i + 1
        T = h.shape[1] - (i + 1)
        loss = loss + soft_ce(lm(model(h[:, :T], i)), logp[:, i + 1:i + 1 + T]) * (0.8 ** i)
    return loss


def save_medusa(model, lm_weight: torch.Tensor, H: int, V: int, d: Path, lm_head_copy: bool = False) -> None:
    """vLLM layout, ``original_lm_head``: without ``lm_head_copy`` the file has no ``lm_heads.0`` and
    fastinfer uses the target's LM head (what the flag says); vLLM needs the copy written out."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    sd = {}
    for i in range(MEDUSA_HEADS):
        for j in range(MEDUSA_LAYERS):
            k = i * MEDUSA_LAYERS + j
            sd[f"blocks.{i}.layers.{j}.weight"] = model.w[k].detach().to(torch.float16).contiguous()
            sd[f"blocks.{i}.layers.{j}.bias"] = model.b[k].detach().to(torch.float16).contiguous()
    if lm_head_copy:
        sd["lm_heads.0.weight"] = lm_weight.detach().to(torch.float16).contiguous()
    save_file(sd, str(d / "model.safetensors"))
    cfg = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": H, "vocab_size": V,
           "num_heads": MEDUSA_HEADS, "num_hidden_layers": MEDUSA_LAYERS, "medusa_fc_bias": True,
           "original_lm_head": True, "truncated_vocab_size": V}
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# -------------------------------------------------------------------------------------- EAGLE

def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (rotate-half convention) of x [B, heads, T, D] at positions 0..T-1."""
    D, T = x.shape[-1], x.shape[-2]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Eagle(torch.nn.Module):
    """fc + one Llama decoder layer (HF Llama names: the EAGLE layout)."""

    def __init__(self, c):
        super().__init__()
        H, F_, D = c.hidden_size, c.intermediate_size, c.head_dim
        self.nh, self.nkv, self.D, self.eps, self.theta = c.num_attention_heads, c.num_key_value_heads, D, \
            c.rms_norm_eps, float(getattr(c, "rope_theta", 10000.0))
        lin = lambda i, o: torch.randn(o, i) * (0.5 / math.sqrt(i))  # noqa: E731
        # starts as g = f_p (o_proj, down_proj zero: the layer adds nothing yet)
        init = {
            "fc.weight": torch.cat([torch.zeros(H, H), torch.eye(H)], 1),
            "fc.bias": torch.zeros(H),
            "layers.0.input_layernorm.weight": torch.ones(H),
            "layers.0.self_attn.q_proj.weight": lin(H, self.nh * D),
            "layers.0.self_attn.k_proj.weight": lin(H, self.nkv * D),
            "layers.0.self_attn.v_proj.weight": lin(H, self.nkv * D),
            "layers.0.self_attn.o_proj.weight": torch.zeros(H, self.nh * D),
            "layers.0.post_attention_layernorm.weight": torch.ones(H),
            "layers.0.mlp.gate_proj.weight": lin(H, F_),
            "layers.0.mlp.up_proj.weight": lin(H, F_),
            "layers.0.mlp.down_proj.weight": torch.zeros(H, F_),
        }
        self.p = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(v) for k, v in init.items()})

    def w(self, name: str) -> torch.Tensor:
        return self.p[name.replace(".", "__")]

    def norm(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w(name)

    def _qkv(self, e: torch.Tensor, f: torch.Tensor):
        x = F.linear(torch.cat([e, f], -1), self.w("fc.weight"), self.w("fc.bias"))
        B, T, _ = x.shape
        h = self.norm(x, "layers.0.input_layernorm.weight")
        q = F.linear(h, self.w("layers.0.self_attn.q_proj.weight")).view(B, T, self.nh, self.D).transpose(1, 2)
        k = F.linear(h, self.w("layers.0.self_attn.k_proj.weight")).view(B, T, self.nkv, self.D).transpose(1, 2)
        v = F.linear(h, self.w("layers.0.self_attn.v_proj.weight")).view(B, T, self.nkv, self.D).transpose(1, 2)
        rep = self.nh // self.nkv
        return x, rope(q, self.theta), rope(k, self.theta).repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def _out(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        x = x + F.linear(a.transpose(1, 2).reshape(x.shape), self.w("layers.0.self_attn.o_proj.weight"))
        h = self.norm(x, "layers.0.post_attention_layernorm.weight")
        m = F.silu(F.linear(h, self.w("layers.0.mlp.gate_proj.weight"))) \
            * F.linear(h, self.w("layers.0.mlp.up_proj.weight"))
        return x + F.linear(m, self.w("layers.0.mlp.down_proj.weight"))

    def forward(self, e: torch.Tensor, f: torch.Tensor, levels: int = 1) -> List[torch.Tensor]:
        """Rows [B, T]: embeddings e (of t_{p+1}) and the target's features f (f_p); the outputs g
        (~f_{p+1}) of ``levels`` unrolled draft steps, as the drafter runs them. Level 1 is
        teacher-forced; level k's row p takes level k-1's output of row p - 1 as its feature (a
        guess of f_p) and attends, like a depth-k draft token, to the true-feature rows <= p - k + 1,
        to level m's row p - k + m (its drafted ancestors) and to itself (EAGLE-3's training-time
        test). Rows p < k - 1 of level k have no such history: leave them out of the loss."""
        T = e.shape[1]
        i = torch.arange(T)
        ks, vs, outs, feat = [], [], [], f
        for k in range(1, levels + 1):
            x, q, kk, vv = self._qkv(e, feat)
            ks.append(kk)
            vs.append(vv)
            mask = torch.cat([i[None, :] <= i[:, None] - k + 1]
                             + [i[None, :] == i[:, None] - k + m for m in range(2, k + 1)], 1)
            a = F.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), attn_mask=mask)
            outs.append(self._out(x, a))
            feat = torch.cat([f[:, :1], outs[-1][:, :-1]], 1)
        return outs


def eagle_loss(model, target, x, h, logp):
    """Sum over the unrolled levels (weights 1, 0.8, ..) of smooth-L1(g, f_{p+1}) + EAGLE_CE x
    cross-entropy of lm_head(g) against the target's distribution at p + 1."""
    e = target.model.embed_tokens(x[:, 1:])  # t_{p+1} for rows p = 0 .. T-2
    loss = 0.0
    for k, g in enumerate(model(e, h[:, :-1], EAGLE_LEVELS), 1):
        g, f1, lp1 = g[:, k - 1:], h[:, k:], logp[:, k:]
        loss = loss + (0.8 ** (k - 1)) * (F.smooth_l1_loss(g, f1) + EAGLE_CE * soft_ce(target.lm_head(g), lp1))
    return loss


def save_eagle(model, target_dir: str, d: Path) -> None:
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    sd = {k.replace("__", "."): v.detach().to(torch.float16).contiguous() for k, v in model.p.items()}
    save_file(sd, str(d / "model.safetensors"))
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    cfg["dtype"] = cfg["torch_dtype"] = "float16"
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# ------------------------------------------------------------------------------------ EAGLE-3

EAGLE3_AUX = (1, 2, 4)  # low / middle / high of the 5-layer target (the default (2, L//2, L-3) is (2, 2, 2))
EAGLE3_STEPS = 3  # unrolled draft steps in training (EAGLE-3's training-time test)
EAGLE3_INTERMEDIATE = 256  # the midlayer's MLP width (the target's is 704: a small asset, within the 16 MB of assets)


def draft_vocab(stream: torch.Tensor, V: int, size: int):
    """The ``size`` most frequent tokens of ``stream``: ``(ids sorted, d2t, t2d)`` (EAGLE convention:
    target_id = draft_id + d2t[draft_id], t2d[target_id] True for the draft vocabulary)."""
    counts = torch.bincount(stream, minlength=V)
    ids = counts.topk(size).indices.sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids, ids - torch.arange(size), t2d, float(counts[ids].sum() / counts.sum())


class Eagle3(torch.nn.Module):
    """fc (3H -> H), the midlayer (q/k/v over [input_layernorm(embed); hidden_norm(feature)]), own
    norm and reduced-vocabulary lm_head (the EAGLE repository's names)."""

    def __init__(self, c, lm_rows: torch.Tensor):
        super().__init__()
        H, D = c.hidden_size, c.head_dim
        self.nh, self.nkv, self.D, self.eps, self.theta = c.num_attention_heads, c.num_key_value_heads, D, \
            c.rms_norm_eps, float(getattr(c, "rope_theta", 10000.0))
        n = len(EAGLE3_AUX)
        lin = lambda i, o: torch.randn(o, i) * (0.5 / math.sqrt(i))  # noqa: E731
        init = {  # starts as g = fc(a) = the high layer's stream (o_proj, down_proj zero)
            "fc.weight": torch.cat([torch.zeros(H, (n - 1) * H), torch.eye(H)], 1),
            "midlayer.input_layernorm.weight": torch.ones(H),
            "midlayer.hidden_norm.weight": torch.ones(H),
            "midlayer.self_attn.q_proj.weight": lin(2 * H, self.nh * D),
            "midlayer.self_attn.k_proj.weight": lin(2 * H, self.nkv * D),
            "midlayer.self_attn.v_proj.weight": lin(2 * H, self.nkv * D),
            "midlayer.self_attn.o_proj.weight": torch.zeros(H, self.nh * D),
            "midlayer.post_attention_layernorm.weight": torch.ones(H),
            "midlayer.mlp.gate_proj.weight": lin(H, EAGLE3_INTERMEDIATE),
            "midlayer.mlp.up_proj.weight": lin(H, EAGLE3_INTERMEDIATE),
            "midlayer.mlp.down_proj.weight": torch.zeros(H, EAGLE3_INTERMEDIATE),
            "norm.weight": torch.ones(H),
            "lm_head.weight": lm_rows.clone(),
        }
        self.p = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(v) for k, v in init.items()})

    def w(self, name: str) -> torch.Tensor:
        return self.p[name.replace(".", "__")]

    def norm(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w(name)

    def forward(self, e: torch.Tensor, a: torch.Tensor, steps: int):
        """Rows [B, T]: embeddings e (of t_{p+1}), the target's aux states a (at p); the draft-vocabulary
        logits of ``steps`` unrolled draft steps. Step 1 takes ``fc(a_p)``; step k's row p takes step
        k-1's output of row p - 1 as its feature and attends, as a depth-k draft token does, to the
        step-1 rows <= p - k + 1, to step m's row p - k + m (its drafted ancestors) and to itself.
        Rows p < k - 1 of step k have no such history (left out of the loss)."""
        B, T, H = e.shape
        i = torch.arange(T)
        en = self.norm(e, "midlayer.input_layernorm.weight")
        f = F.linear(a, self.w("fc.weight"))
        ks, vs, out = [], [], []
        for k in range(1, steps + 1):
            x = torch.cat([en, self.norm(f, "midlayer.hidden_norm.weight")], -1)
            q = F.linear(x, self.w("midlayer.self_attn.q_proj.weight")).view(B, T, self.nh, self.D).transpose(1, 2)
            kk = F.linear(x, self.w("midlayer.self_attn.k_proj.weight")).view(B, T, self.nkv, self.D).transpose(1, 2)
            vv = F.linear(x, self.w("midlayer.self_attn.v_proj.weight")).view(B, T, self.nkv, self.D).transpose(1, 2)
            rep = self.nh // self.nkv
            ks.append(rope(kk, self.theta).repeat_interleave(rep, 1))
            vs.append(vv.repeat_interleave(rep, 1))
            mask = torch.cat([i[None, :] <= i[:, None] - k + 1]
                             + [i[None, :] == i[:, None] - k + m for m in range(2, k + 1)], 1)
            att = F.scaled_dot_product_attention(rope(q, self.theta), torch.cat(ks, 2), torch.cat(vs, 2),
                                                 attn_mask=mask).transpose(1, 2).reshape(B, T, -1)
            r = f + F.linear(att, self.w("midlayer.self_attn.o_proj.weight"))
            h = self.norm(r, "midlayer.post_attention_layernorm.weight")
            m_ = F.silu(F.linear(h, self.w("midlayer.mlp.gate_proj.weight"))) \
                * F.linear(h, self.w("midlayer.mlp.up_proj.weight"))
            g = r + F.linear(m_, self.w("midlayer.mlp.down_proj.weight"))
            out.append(F.linear(self.norm(g, "norm.weight"), self.w("lm_head.weight")))
            f = torch.cat([f[:, :1], g[:, :-1]], 1)  # row p's next feature: row p - 1's output
        return out


@torch.no_grad()
def aux_features(target, x: torch.Tensor):
    """The residual streams entering the EAGLE3_AUX layers, concatenated [B, T, 3H] (HF's
    hidden_states[i] is the input of layer i), and the log-probabilities [B, T, V]."""
    o = target.model(input_ids=x, output_hidden_states=True)
    a = torch.cat([o.hidden_states[i] for i in EAGLE3_AUX], -1)
    return a, torch.log_softmax(target.lm_head(o.last_hidden_state), dim=-1)


def eagle3_loss(model, target, ids, x):
    """Soft cross-entropy of each unrolled step against the target's distribution restricted to the
    draft vocabulary (row p of step k predicts t_{p+2}: the target's view at p + 1), weights 0.8^(k-1)."""
    a, logp = aux_features(target, x)
    e = target.model.embed_tokens(x[:, 1:])
    outs = model(e, a[:, :-1], EAGLE3_STEPS)
    tgt = torch.log_softmax(logp[:, 1:, ids], dim=-1)  # renormalised over the draft vocabulary
    loss = 0.0
    for k, lg in enumerate(outs, 1):
        loss = loss + soft_ce(lg[:, k - 1:], tgt[:, k - 1:]) * (0.8 ** (k - 1))
    return loss


def save_eagle3(model, target_dir: str, d2t: torch.Tensor, t2d: torch.Tensor, d: Path) -> None:
    """The EAGLE repository's layout (midlayer.*, fc, norm, lm_head, d2t, t2d), fp16."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    sd = {k.replace("__", "."): v.detach().to(torch.float16).contiguous() for k, v in model.p.items()}
    sd["d2t"], sd["t2d"] = d2t.to(torch.int64).contiguous(), t2d.contiguous()
    save_file(sd, str(d / "model.safetensors"))
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    cfg.update(num_hidden_layers=1, intermediate_size=EAGLE3_INTERMEDIATE, draft_vocab_size=int(d2t.numel()),
               architectures=["LlamaForCausalLMEagle3"], torch_dtype="float16",
               eagle_aux_hidden_state_layer_ids=list(EAGLE3_AUX))
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# ------------------------------------------------------------------------------------ held-out

@torch.no_grad()
def heldout_agreement(target, medusa, eagle, windows: torch.Tensor, levels: int = 4):
    """Top-1 agreement with the target on held-out windows [N, T]: Medusa head i at p vs the
    target's argmax at p + i + 1; EAGLE level k (k - 1 steps on its own features, as a depth-k
    draft token in a chain whose earlier tokens were accepted) at p vs the target's argmax at p + 1."""
    out = {}
    for c in windows.split(8):
        h, logp = features(target, c)
        top = logp.argmax(-1)
        if medusa is not None:
            for i in range(MEDUSA_HEADS):
                T = h.shape[1] - (i + 1)
                hit = target.lm_head(medusa(h[:, :T], i)).argmax(-1) == top[:, i + 1:i + 1 + T]
                out.setdefault(f"medusa_head{i}", []).append(hit.float().mean())
        if eagle is not None:
            gs = eagle(target.model.embed_tokens(c[:, 1:]), h[:, :-1], levels)
            for k, g in enumerate(gs, 1):
                hit = target.lm_head(g[:, k - 1:]).argmax(-1) == top[:, k:]
                out.setdefault(f"eagle_depth{k}", []).append(hit.float().mean())
    return {k: round(float(torch.stack(v).mean()), 4) for k, v in out.items()}


def load_trained(d: Path, model) -> None:
    """Weights written by save_medusa / save_eagle back into the training modules (--eval-only)."""
    from safetensors.torch import load_file

    sd = load_file(str(d / "model.safetensors"))
    if isinstance(model, Medusa):
        for i in range(MEDUSA_HEADS):
            for j in range(MEDUSA_LAYERS):
                model.w[i * MEDUSA_LAYERS + j].data.copy_(sd[f"blocks.{i}.layers.{j}.weight"].float())
                model.b[i * MEDUSA_LAYERS + j].data.copy_(sd[f"blocks.{i}.layers.{j}.bias"].float())
    else:
        for k, v in model.p.items():
            v.data.copy_(sd[k.replace("__", ".")].float())


# -------------------------------------------------------------------------------------- train

def train(name, model, loss_fn, batches, cpu_minutes, max_steps, lr):
    """AdamW, 20 warm-up steps then cosine decay to 10% of ``lr``, for ``cpu_minutes`` of this
    process's CPU time (all threads; a shared machine's load does not change the work done)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    t0, c0, step, avg = time.time(), time.process_time(), 0, None
    budget = cpu_minutes * 60.0
    while step < max_steps:
        frac = max(step / max_steps, (time.process_time() - c0) / budget)
        if frac >= 1.0:
            break
        for gr in opt.param_groups:
            gr["lr"] = lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        loss = loss_fn(*next(batches))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = float(loss.detach())
        avg = lv if avg is None else 0.95 * avg + 0.05 * lv
        step += 1
        if step % 25 == 0:
            log(f"{name}: step {step}, loss {avg:.4f}, {time.process_time() - c0:.0f} CPU s, {time.time() - t0:.0f} s")
    cpu = time.process_time() - c0
    log(f"{name}: {step} steps, final loss {avg:.4f}, {cpu:.0f} CPU s, {time.time() - t0:.0f} s")
    return {"steps": step, "final_loss": round(avg, 4), "cpu_seconds": round(cpu, 1),
            "wall_seconds": round(time.time() - t0, 1), "lr": lr}


def main(argv=None) -> int:
    global EAGLE_LEVELS, EAGLE_CE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--target", default=str(Path(__file__).resolve().parents[1] / "python/fastinfer/assets/tiny-llama"),
                    help="the frozen target checkpoint (default: the shipped tiny-llama)")
    ap.add_argument("--minutes-medusa", type=float, default=3.0, help="CPU minutes (process time, all threads)")
    ap.add_argument("--minutes-eagle", type=float, default=8.0, help="CPU minutes (process time, all threads)")
    ap.add_argument("--minutes-eagle3", type=float, default=8.0, help="CPU minutes (process time, all threads)")
    ap.add_argument("--eagle3-vocab", type=int, default=1024, help="EAGLE-3 draft vocabulary: the most frequent tokens")
    ap.add_argument("--medusa-lm-head-copy", action="store_true",
                    help="write lm_heads.0 (the target's LM head) into the Medusa file, as vLLM needs")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--lr-medusa", type=float, default=2e-3)
    ap.add_argument("--lr-eagle", type=float, default=2e-3)
    ap.add_argument("--eagle-levels", type=int, default=EAGLE_LEVELS,
                    help="unrolled draft steps per EAGLE training row (1: teacher-forced only)")
    ap.add_argument("--eagle-ce", type=float, default=EAGLE_CE, help="EAGLE cross-entropy weight")
    ap.add_argument("--only", choices=["medusa", "eagle", "eagle3"], default=None, help="train one kind")
    ap.add_argument("--eval-only", type=Path, default=None,
                    help="no training: held-out top-1 agreement of the heads under this assets directory")
    ap.add_argument("--smoke", action="store_true", help="a few steps on a small corpus")
    args = ap.parse_args(argv)
    EAGLE_LEVELS, EAGLE_CE = args.eagle_levels, args.eagle_ce
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(args.target) / "tokenizer.json"))
    train_files, heldout_files = ttm.load_corpus(args.stdlib, args.smoke)
    stream = ttm.pack(tok, train_files)
    log(f"corpus: {len(train_files)} files, {len(stream):,} tokens")
    target = load_target(args.target)
    c = target.config
    H, V = c.hidden_size, c.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    held = ttm.pack(tok, heldout_files)  # non-overlapping windows of the held-out files, at most 32 (smoke: 4)
    n_held = min(4 if args.smoke else 32, (len(held) - 1) // CONTEXT)
    held = held[:n_held * CONTEXT].view(n_held, CONTEXT)
    if args.eval_only is not None:
        medusa, eagle = Medusa(H), Eagle(c)
        load_trained(args.eval_only / "tiny-llama-medusa", medusa)
        load_trained(args.eval_only / "tiny-llama-eagle", eagle)
        print(json.dumps(heldout_agreement(target, medusa, eagle, held), indent=2))
        return 0

    def batches():
        while True:
            starts = torch.randint(0, len(stream) - CONTEXT - 1, (args.batch,), generator=g)
            x = torch.stack([stream[s:s + CONTEXT] for s in starts.tolist()])
            h, logp = features(target, x)
            yield x, h, logp

    max_steps = 5 if args.smoke else 10 ** 9
    command = "python tools/train_draft_heads.py " + " ".join(argv if argv is not None else sys.argv[1:])
    meta_file = args.out / "draft_heads.json"  # each head's entry is replaced, the others' are kept
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    meta.update({"target": "tiny-llama", "context": CONTEXT, "seed": args.seed})
    it = batches()
    if args.only in (None, "medusa"):
        medusa = Medusa(H)
        meta["medusa"] = train("medusa", medusa, lambda x, h, lp: medusa_loss(medusa, target.lm_head, h, lp),
                               it, args.minutes_medusa, max_steps, args.lr_medusa)
        meta["medusa"].update(batch=args.batch, command=command)
        meta["medusa"]["heldout_top1"] = heldout_agreement(target, medusa, None, held)
        log(f"medusa held-out top-1 agreement: {meta['medusa']['heldout_top1']}")
        save_medusa(medusa, target.lm_head.weight, H, V, args.out / "tiny-llama-medusa", args.medusa_lm_head_copy)
    if args.only in (None, "eagle"):
        eagle = Eagle(c)
        meta["eagle"] = train("eagle", eagle, lambda x, h, lp: eagle_loss(eagle, target, x, h, lp),
                              it, args.minutes_eagle, max_steps, args.lr_eagle)
        meta["eagle"].update(batch=args.batch, command=command, levels=EAGLE_LEVELS, ce_weight=EAGLE_CE,
                             heldout_top1=heldout_agreement(target, None, eagle, held))
        log(f"eagle held-out top-1 agreement: {meta['eagle']['heldout_top1']}")
        save_eagle(eagle, args.target, args.out / "tiny-llama-eagle")
    if args.only in (None, "eagle3"):
        ids, d2t, t2d, coverage = draft_vocab(stream, V, min(args.eagle3_vocab, V))
        log(f"eagle3: draft vocabulary {len(ids)} tokens, {coverage:.1%} of the corpus")
        eagle3 = Eagle3(c, target.lm_head.weight[ids])
        meta["eagle3"] = train("eagle3", eagle3, lambda x, h, lp: eagle3_loss(eagle3, target, ids, x),
                               it, args.minutes_eagle3, max_steps, 1e-3)
        meta["eagle3"].update(batch=args.batch, command=command, draft_vocab_size=len(ids),
                              corpus_coverage=round(coverage, 4), aux_layers=list(EAGLE3_AUX),
                              unrolled_steps=EAGLE3_STEPS)
        save_eagle3(eagle3, args.target, d2t, t2d, args.out / "tiny-llama-eagle3")
    args.out.mkdir(parents=True, exist_ok=True)
    meta_file.write_text(json.dumps(meta, indent=2) + "\n")
    log(f"wrote {args.only or 'medusa, eagle and eagle3'} under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
