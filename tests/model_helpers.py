"""Test shorthands over :class:`fastinfer.layers.BatchBuilder` (the one batch builder), and tiny random
Hugging Face models of the Llama family (written with ``save_pretrained``, loaded by fastinfer)."""

from __future__ import annotations

import contextlib
from typing import Sequence, Tuple

import torch

from fastinfer.layers import BatchBuilder, RMSNorm


def make_forward_batch(prefill: Sequence[Tuple[Sequence[int], int, Sequence[int]]] = (),
                       decode: Sequence[Tuple[int, int, Sequence[int]]] = (), block_size: int = 16, device=None,
                       all_logits: bool = False):
    """``prefill``: per chunk ``(new_token_ids, num_cached, block_ids)``; ``decode``: per row
    ``(token_id, position, block_ids)``. Logits: the last row of each chunk (every row with
    ``all_logits``), then every decode row."""
    b = BatchBuilder(block_size, device)
    for toks, start, blocks in prefill:
        b.prefill(toks, start, blocks, logits="all" if all_logits else "last")
    for tok, pos, blocks in decode:
        b.decode(tok, pos, blocks)
    return b.build()


def prefill_logits(model, token_ids: Sequence[int], block_size: int = 16) -> torch.Tensor:
    """Logits ``[len(token_ids), vocab]`` (float32) of a whole prompt in one prefill, with a fresh
    cache and the contiguous block table ``0, 1, 2, ...``."""
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    caches = model.allocate_kv_cache(num_blocks, block_size)
    return model(make_forward_batch([(list(token_ids), 0, list(range(num_blocks)))], block_size=block_size,
                                    device=model.device, all_logits=True), caches)


# 2 layers, hidden 128, head_dim 64, vocab 300, GQA 4/2 (the cases override what they test)
HF_BASE = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, max_position_embeddings=512)


def hf_classes(kind):
    import transformers as t

    return {
        "llama": (t.LlamaConfig, t.LlamaForCausalLM),
        "mistral": (t.MistralConfig, t.MistralForCausalLM),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM),
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM),
        "mixtral": (t.MixtralConfig, t.MixtralForCausalLM),
        "qwen2_moe": (t.Qwen2MoeConfig, t.Qwen2MoeForCausalLM),
        "qwen3_moe": (t.Qwen3MoeConfig, t.Qwen3MoeForCausalLM),
        "olmoe": (t.OlmoeConfig, t.OlmoeForCausalLM),
    }[kind]


def reinit_(model, seed: int):
    """Weights with a larger scale than transformers' init (std 0.02 makes attention nearly uniform
    and would hide RoPE or mask bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * r)
            elif "embed" in name:
                p.copy_(r)
            elif name.endswith("bias"):
                p.copy_(0.2 * r)
            else:
                p.copy_(r * (0.9 / p.shape[-1] ** 0.5))  # fan-in (stacked experts are [E, N, K])


def make_hf_model(kind: str, seed: int = 0, **overrides):
    """A random transformers model of ``kind`` (a key of :func:`hf_classes`),
    ``HF_BASE`` + ``overrides``."""
    cfg_cls, model_cls = hf_classes(kind)
    kw = dict(HF_BASE, **overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).eval()
    reinit_(model, seed)
    if kw.get("tie_word_embeddings"):
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def lazy_checkpoints(tmp_path_factory, cases, make):
    """``name -> (hf_model, path)``, each built on first use: ``make(kind, seed=..., **overrides)`` for
    ``cases[name] = (kind, overrides)``, written with ``save_pretrained``. A case's seed is its place
    in ``cases``, so a checkpoint does not depend on which tests ran first."""
    cache = {}

    def get(name):
        if name not in cache:
            kind, over = cases[name]
            hf = make(kind, seed=list(cases).index(name) + 1, **over)
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(path)
            cache[name] = (hf, str(path))
        return cache[name]

    return get


def random_prompt(n: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms, in float64)."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def hf_logits(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_greedy(hf, ids, n: int):
    """transformers' greedy continuation of ``ids`` (the whole sequence recomputed per token)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def check_batching_prefix_caching_and_preemption(hf, path: str, vocab: int, block_size: int, greedy: dict):
    """Many prompts (a third sharing a prefix) in a pool small enough to preempt, with a token
    budget that chunks the prefills, give each prompt's tokens alone (the deterministic mode: every
    op batch invariant), and those are transformers' (``hf``) greedy tokens."""
    import random

    from fastinfer import LLM, SamplingParams

    rng = random.Random(1)
    shared = [rng.randrange(vocab) for _ in range(35)]
    prompts = [(shared if i % 3 == 0 else []) + [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
               for i in range(12)]
    params = [SamplingParams(max_tokens=rng.randint(1, 10), **greedy) for _ in prompts]
    alone = LLM(path, dtype="float32", num_kv_blocks=64, block_size=block_size, deterministic=True)
    ref = [alone.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    for i in (0, 1):
        assert list(ref[i]) == hf_greedy(hf, prompts[i], params[i].max_tokens)
    small = LLM(path, dtype="float32", num_kv_blocks=10, block_size=block_size, max_num_seqs=8,
                max_num_batched_tokens=48, deterministic=True)
    outs = small.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    st = small.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hits"] > 0, st
    assert st["num_free_blocks"] == st["num_kv_blocks"], st


def plan_logits(llm, prompt) -> torch.Tensor:
    """Logits of a whole-prompt prefill (every row), then of one decode row, through ``llm``'s runner
    (so that tensor- and expert-parallel engines are compared with one process row by row)."""
    from fastinfer.engine.model_runner import Chunk, ForwardPlan

    table = list(range(-(-(len(prompt) + 1) // llm.block_size)))
    run = llm.executor.runner.forward
    pre, _ = run(ForwardPlan(chunks=[Chunk(-1, list(prompt), 0, "all")], tables={-1: table}))
    nxt = int(pre[-1].argmax())
    dec, _ = run(ForwardPlan(decodes=[(-1, nxt, len(prompt))], tables={-1: table}, finished=[-1]))
    return torch.cat([pre, dec])


@contextlib.contextmanager
def unfused_norm_quant(model):
    """The norms of ``model`` hand float tensors to every linear (``RMSNorm.fuse_quant = False``):
    for hooks that read a quantised linear's float input. Bit for bit the same logits
    (tests/test_quant_formats.py::test_norm_quant_fusion_is_bit_exact)."""
    saved = [(m, m.fuse_quant) for m in model.modules() if isinstance(m, RMSNorm)]
    for m, _ in saved:
        m.fuse_quant = False
    try:
        yield
    finally:
        for m, fuse in saved:
            m.fuse_quant = fuse
