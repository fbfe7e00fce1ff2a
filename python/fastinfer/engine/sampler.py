"""Token sampling from float32 logits, one row per sequence, each with its own SamplingParams.

Order of the logits processors (as Hugging Face ``generate``): repetition penalty (then the
presence / frequency penalties and ``logit_bias``), the grammar mask of structured output,
temperature, top-k, top-p, min-p; then greedy
argmax (temperature 0) or a draw from the softmax. Draws use the exponential-race form
``argmax(p / E)`` with ``E ~ Exp(1)`` drawn from the row's own ``torch.Generator`` when the request
has a seed, so a seeded completion does not depend on what else is in the batch.
Log-probabilities reported to the user are the log-softmax of the raw logits.

Deterministic mode (``Sampler(generator, backend(..., deterministic=True))``): a seeded row's noise
is a function of its seed and the position of the token being drawn only (:func:`position_noise`), not of how many draws the
request's generator made before, so the speculative verifier can reproduce the exact draw plain
decoding would make at every position (:func:`race_scores`) and seeded tokens do not depend on
whether, or how, the request speculated.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence as Seq, Tuple

import torch

from ..ops import Backend, backend
from .params import SamplingParams


def apply_repetition_penalty(logits: torch.Tensor, token_ids: Seq[Seq[int]], penalties: Seq[float]) -> torch.Tensor:
    """HF semantics, in place: for every token already seen (prompt + output), l -> l / p if l > 0
    else l * p."""
    for i, (ids, p) in enumerate(zip(token_ids, penalties)):
        if p == 1.0 or not ids:
            continue
        idx = torch.tensor(sorted(set(ids)), dtype=torch.long, device=logits.device)
        vals = logits[i].index_select(0, idx)
        logits[i].index_copy_(0, idx, torch.where(vals > 0, vals / p, vals * p))
    return logits


def apply_presence_frequency_penalties(logits: torch.Tensor, output_ids: Seq[Seq[int]], presence: Seq[float],
                                       frequency: Seq[float]) -> torch.Tensor:
    """OpenAI semantics, in place: ``l[j] -= presence * (c[j] > 0) + frequency * c[j]`` with ``c[j]``
    the count of token j among the generated tokens."""
    for i, (ids, pp, fp) in enumerate(zip(output_ids, presence, frequency)):
        if (pp == 0.0 and fp == 0.0) or not ids:
            continue
        counts = torch.bincount(torch.tensor(list(ids), dtype=torch.long), minlength=logits.shape[-1]).to(logits)
        logits[i] -= pp * (counts > 0).to(logits) + fp * counts
    return logits


def apply_logit_bias(logits: torch.Tensor, biases: Seq[Optional[Dict[int, float]]]) -> torch.Tensor:
    """OpenAI semantics, in place: ``l[i, t] += bias`` for every ``{t: bias}`` of row i, in one
    scatter-add over the rows that have a bias."""
    rows, cols, vals = [], [], []
    for i, b in enumerate(biases):
        if b:
            rows.extend([i] * len(b))
            cols.extend(b.keys())
            vals.extend(b.values())
    if rows:
        dev = logits.device
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                          torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask (with -inf) what top-k, then top-p, then min-p remove. ``top_k`` int64 [N] (<= 0: off),
    ``top_p`` / ``min_p`` float [N]. The most likely token always survives."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    remove = rank >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # top-p: drop a token when the tokens before it already reach top_p
    cum_before = probs.cumsum(dim=-1) - probs
    remove = cum_before >= top_p[:, None]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    # min-p relative to the most likely token (after top-k/top-p renormalisation it is the same ratio)
    probs = sorted_logits.softmax(dim=-1)
    remove = probs < (min_p[:, None] * probs[:, :1])
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_noise(seed: int, position: int, vocab_size: int, device) -> torch.Tensor:
    """``Exp(1)`` noise ``float32 [vocab_size]`` of the token drawn at ``position`` of a sequence
    seeded with ``seed``: a function of the two alone (deterministic mode)."""
    g = torch.Generator(device=device)
    g.manual_seed(_mix64(_mix64(int(seed) & _MASK64) ^ int(position)) >> 1)
    return torch.empty(vocab_size, device=device).exponential_(generator=g)


def race_scores(scaled_logits: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``softmax(scaled_logits) / noise`` over the last dim (float32 logits already divided by the
    temperature): the draw is its argmax. The one computation the sampler and the deterministic
    verifier share, so both give the same bits."""
    return scaled_logits.softmax(dim=-1) / noise


class Sampler:
    """``ops``: the engine's op backend; its mode is the sampler's (deterministic: seeded rows draw
    :func:`position_noise`, see the module docstring). Default: the compiled ops, default mode."""

    def __init__(self, generator: Optional[torch.Generator] = None, ops: Optional[Backend] = None):
        self.generator = generator  # for rows without a seed
        self.ops = backend() if ops is None else ops
        self.deterministic = self.ops.deterministic

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        params: Seq[SamplingParams],
        token_ids: Seq[Seq[int]],
        generators: Seq[Optional[torch.Generator]],
        num_prompt_tokens: Optional[Seq[int]] = None,
        bitmask: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> Tuple[List[int], List[Optional[Dict[int, float]]]]:
        """``logits [N, V]`` float32; per row its params, its tokens so far (prompt + output, for
        the repetition penalty), its generator (None: the sampler's) and how many of its tokens are
        the prompt (the presence / frequency penalties count the rest; None: 0); ``bitmask``:
        structured output's ``(bitmask [N, W] int32, rows)``, the tokens each listed row's grammar
        allows (:func:`~fastinfer.ops.apply_token_bitmask`). Returns the
        sampled token per row and, for rows that asked for logprobs, a dict {token: logprob}."""
        N, V = logits.shape
        dev = logits.device
        logits = logits.float()
        want_lp = [p.logprobs is not None for p in params]
        raw_lp = torch.log_softmax(logits, dim=-1) if any(want_lp) else None

        logits = logits.clone()
        if any(p.repetition_penalty != 1.0 for p in params):
            apply_repetition_penalty(logits, token_ids, [p.repetition_penalty for p in params])
        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
            npt = num_prompt_tokens if num_prompt_tokens is not None else [0] * N
            apply_presence_frequency_penalties(logits, [ids[k:] for ids, k in zip(token_ids, npt)],
                                               [p.presence_penalty for p in params],
                                               [p.frequency_penalty for p in params])
        if any(p.logit_bias for p in params):
            apply_logit_bias(logits, [p.logit_bias for p in params])
        if bitmask is not None:
            self.ops.apply_token_bitmask(logits, bitmask[0].to(dev), bitmask[1].to(dev))

        out = logits.argmax(dim=-1)
        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sample_rows:
            rows = torch.tensor(sample_rows, device=dev)
            sp = [params[i] for i in sample_rows]
            x = logits.index_select(0, rows)
            temp = torch.tensor([p.temperature for p in sp], device=dev, dtype=torch.float32)
            x = x / temp[:, None]
            # only the rows that ask (a row's draw must not depend on what else is in the batch)
            filtered = [j for j, p in enumerate(sp) if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0]
            if filtered:
                fp = [sp[j] for j in filtered]
                f = torch.tensor(filtered, device=dev)
                x = x.index_copy(0, f, apply_top_k_top_p_min_p(
                    x.index_select(0, f),
                    torch.tensor([p.top_k for p in fp], device=dev, dtype=torch.long),
                    torch.tensor([p.top_p for p in fp], device=dev, dtype=torch.float32),
                    torch.tensor([p.min_p for p in fp], device=dev, dtype=torch.float32),
                ))
            noise = torch.empty_like(x)
            shared = [j for j, i in enumerate(sample_rows) if generators[i] is None]
            if shared:
                noise[shared] = torch.empty(len(shared), V, device=dev).exponential_(generator=self.generator)
            for j, i in enumerate(sample_rows):
                if generators[i] is None:
                    continue
                if self.deterministic:
                    noise[j] = position_noise(generators[i].initial_seed(), len(token_ids[i]), V, dev)
                else:
                    noise[j].exponential_(generator=generators[i])
            drawn = race_scores(x, noise).argmax(dim=-1)
            out = out.index_copy(0, rows, drawn)
        tokens = out.tolist()

        lps: List[Optional[Dict[int, float]]] = [None] * N
        if raw_lp is not None:
            for i, p in enumerate(params):
                if want_lp[i]:
                    lps[i] = logprob_dict(raw_lp[i], tokens[i], p.logprobs)
        return tokens, lps


def logprob_dict(row_logprobs: torch.Tensor, token: int, top: int) -> Dict[int, float]:
    """``{token_id: logprob}``: the ``top`` most likely tokens of one row and the chosen ``token``."""
    return logprob_dicts(row_logprobs[None], [token], top)[0]


def logprob_dicts(rows_logprobs: torch.Tensor, tokens: Seq[int], top: int) -> List[Dict[int, float]]:
    """:func:`logprob_dict` of every row of ``rows_logprobs [R, V]`` with its token, in one top-k
    and one gather over the rows (prompt logprobs have one row per prompt token)."""
    idx = torch.tensor(list(tokens), dtype=torch.long, device=rows_logprobs.device)
    chosen = rows_logprobs.gather(1, idx[:, None])[:, 0].tolist()
    dicts: List[Dict[int, float]] = [{} for _ in chosen]
    if top > 0:
        vals, ids = rows_logprobs.topk(min(top, rows_logprobs.shape[-1]), dim=-1)
        for d, i, v in zip(dicts, ids.tolist(), vals.tolist()):
            d.update(zip(i, v))
    for d, t, v in zip(dicts, tokens, chosen):
        d[int(t)] = v
    return dicts
