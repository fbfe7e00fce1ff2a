"""Rotary position embedding tables for the ``rotary_embedding`` op.

:func:`compute_inv_freq` reproduces transformers' ``ROPE_INIT_FUNCTIONS`` (``default``, ``linear``,
``dynamic``, ``llama3``, ``yarn``) formula by formula, evaluated in float64 (transformers uses
float32; the difference is far below what the parity tests resolve). :func:`build_cos_sin_cache`
returns the op's table ``[max_pos, R]`` whose row ``p`` is ``cat(cos(p * inv_freq), sin(p *
inv_freq)) * attention_factor`` (the layout of :func:`fastinfer.ops.build_rope_cache`), computed in
float64 and rounded once.

Scaling types
-------------
* ``linear``: ``inv_freq / factor`` (positions divided by ``factor``).
* ``llama3``: Llama-3.1 wavelength-dependent smoothing (``factor``, ``low_freq_factor``,
  ``high_freq_factor``, ``original_max_position_embeddings``).
* ``yarn``: NTK-by-parts interpolation; ``attention_factor`` (the "mscale", ``0.1 ln(factor) + 1``
  by default, or ``mscale`` / ``mscale_all_dim`` ratio) multiplies cos and sin, as transformers
  does, so q.k scores are scaled by its square.
* ``dynamic`` (dynamic NTK): transformers recomputes ``inv_freq`` in the forward pass from
  ``seq_len = max(position_ids) + 1``: ``base' = base * (factor * seq_len / max_pos - (factor -
  1)) ** (R / (R - 2))`` when ``seq_len > max_position_embeddings``, the unscaled frequencies
  otherwise. A paged KV cache needs a rotation that depends only on a token's own position, so
  row ``p`` of our table uses the frequencies transformers would use for ``seq_len = p + 1``:
  identical to transformers for every position ``< max_position_embeddings`` (plain RoPE), and
  beyond it identical to transformers' token-by-token generation (each new token is rotated with
  ``seq_len = its position + 1``). A *single* transformers forward over a prompt longer than
  ``max_position_embeddings`` rotates all its tokens with the prompt's final ``seq_len`` instead;
  we deliberately differ there (and so does every paged-cache engine).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Optional, Tuple

import torch

from .config import ModelConfig

__all__ = ["compute_inv_freq", "build_cos_sin_cache", "cos_sin_cache"]

Tensor = torch.Tensor


def _default_inv_freq(base: float, dim: int) -> Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def compute_inv_freq(
    rotary_dim: int,
    rope_theta: float,
    rope_scaling: Optional[Dict[str, Any]] = None,
    max_position_embeddings: Optional[int] = None,
    seq_len: Optional[int] = None,
) -> Tuple[Tensor, float]:
    """Inverse frequencies ``[rotary_dim / 2]`` (float64) and the cos/sin ``attention_factor``.

    ``rope_scaling`` is :attr:`ModelConfig.rope_scaling` (None = plain RoPE). ``seq_len`` is only
    used by ``dynamic`` (as in transformers: values below ``max_position_embeddings`` are raised to
    it, so the default gives the unscaled frequencies).
    """
    dim = int(rotary_dim)
    base = float(rope_theta)
    if dim <= 0 or dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    rtype = "default" if rope_scaling is None else rope_scaling["rope_type"]
    if rtype == "default":
        return _default_inv_freq(base, dim), 1.0

    if rtype == "linear":
        return _default_inv_freq(base, dim) / float(rope_scaling["factor"]), 1.0

    if rtype == "dynamic":
        if max_position_embeddings is None:
            raise ValueError("dynamic rope needs max_position_embeddings")
        factor = float(rope_scaling["factor"])
        mp = int(max_position_embeddings)
        sl = mp if seq_len is None else max(int(seq_len), mp)
        base = base * ((factor * sl / mp) - (factor - 1)) ** (dim / (dim - 2))
        return _default_inv_freq(base, dim), 1.0

    if rtype == "llama3":
        inv_freq = _default_inv_freq(base, dim)
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling["low_freq_factor"])
        high = float(rope_scaling["high_freq_factor"])
        old_len = float(rope_scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_len / low
        high_freq_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        out = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, out), 1.0

    if rtype == "yarn":
        factor = float(rope_scaling["factor"])
        omp = float(rope_scaling["original_max_position_embeddings"])
        attention_factor = rope_scaling.get("attention_factor")
        mscale = rope_scaling.get("mscale")
        mscale_all_dim = rope_scaling.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            else:
                attention_factor = get_mscale(factor)
        beta_fast = rope_scaling.get("beta_fast") or 32
        beta_slow = rope_scaling.get("beta_slow") or 1
        truncate = rope_scaling.get("truncate", True)

        def correction_dim(num_rotations: float) -> float:
            return (dim * math.log(omp / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001  # transformers: prevent a singularity
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        extrapolation_factor = 1 - ramp
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        inv_extra = 1.0 / pos_freqs
        inv_inter = 1.0 / (factor * pos_freqs)
        inv_freq = inv_inter * (1 - extrapolation_factor) + inv_extra * extrapolation_factor
        return inv_freq, float(attention_factor)

    raise ValueError(f"unsupported rope type {rtype!r}")


def build_cos_sin_cache(
    config: ModelConfig,
    max_positions: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    device=None,
    sliding: bool = False,
) -> Tensor:
    """The ``cos_sin_cache [max_positions, rotary_dim]`` of ``config`` (default
    ``config.max_model_len`` rows), see the module docstring for each scaling type. ``sliding``:
    the table of the sliding-window layers (``config.sliding_rope_theta`` / ``sliding_rope_scaling``
    when set, else the same table)."""
    if sliding and config.sliding_rope_theta is not None:
        config = dataclasses.replace(config, rope_theta=config.sliding_rope_theta,
                                     rope_scaling=config.sliding_rope_scaling)
    n = int(config.max_model_len if max_positions is None else max_positions)
    if n <= 0:
        raise ValueError(f"max_positions must be positive, got {n}")
    dim = config.rotary_dim
    pos = torch.arange(n, dtype=torch.float64)
    if config.rope_type == "dynamic":
        mp = int(config.max_position_embeddings)
        inv0, _ = compute_inv_freq(dim, config.rope_theta, config.rope_scaling, mp)
        ang = torch.outer(pos[: min(n, mp)], inv0)
        if n > mp:
            # row p rotates with the frequencies of seq_len = p + 1 (see module docstring)
            factor = float(config.rope_scaling["factor"])
            p = pos[mp:]
            base = config.rope_theta * ((factor * (p + 1) / mp) - (factor - 1)) ** (dim / (dim - 2))
            expo = torch.arange(0, dim, 2, dtype=torch.float64) / dim
            inv = 1.0 / base[:, None] ** expo[None, :]
            ang = torch.cat([ang, p[:, None] * inv], dim=0)
        scale = 1.0
    else:
        inv, scale = compute_inv_freq(dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings)
        ang = torch.outer(pos, inv)
    cache = torch.cat([torch.cos(ang), torch.sin(ang)], dim=-1)
    if scale != 1.0:
        cache = cache * scale
    return cache.to(dtype=dtype, device=device).contiguous()


cos_sin_cache = build_cos_sin_cache
