"""GGUF checkpoints (the files llama.cpp and Ollama run): config, weights and tokenizer metadata.

``LLM("model.gguf")`` (or a directory holding exactly one ``.gguf`` and no ``config.json``) goes
through this module:

* :func:`find_gguf` says whether a path names a GGUF checkpoint.
* :func:`gguf_model_config` builds the :class:`~fastinfer.models.ModelConfig` from the metadata
  (``{arch}.context_length``, ``.embedding_length``, ``.block_count``, heads, kv heads, RoPE base
  and scaling, RMS eps, vocabulary size; tied embeddings when there is no ``output.weight``;
  bos / eos / end-of-turn ids). Architectures: ``llama`` (Llama, Mistral, SmolLM, ... as llama.cpp
  writes them), ``qwen2``, ``qwen3``, ``gemma2`` and ``gemma3`` (the Gemma hyperparameters llama.cpp
  does not store, it derives: see :func:`_gemma_config`), and the mixture-of-experts ``llama`` with
  ``llama.expert_count`` > 0 (Mixtral), ``qwen2moe`` (Qwen2-MoE), ``qwen3moe`` (Qwen3-MoE) and
  ``olmoe`` (OLMoE), which run on :class:`~fastinfer.models.MoeForCausalLM` (see
  :data:`_MOE_FORMATS`: ``{arch}.expert_count`` experts, ``expert_used_count`` per token, each
  ``feed_forward_length`` wide (Mixtral, OLMoE) or ``expert_feed_forward_length`` (Qwen3-MoE;
  Qwen2-MoE, where llama.cpp's default ``feed_forward_length / expert_used_count`` stands in for a
  missing key, as it does ``feed_forward_length`` for Qwen2-MoE's shared expert width
  ``expert_shared_feed_forward_length``); every layer routed, the top-k weights renormalised for
  Mixtral and Qwen3-MoE and not for Qwen2-MoE and OLMoE, as llama.cpp's graphs run them whatever the
  original ``norm_topk_prob``). Any metadata key of the architecture this module does not know is an
  error naming it (it may change the math: OLMoE's ``attention.clamp_kqv``, which llama.cpp's OLMoE
  graph never applies, is one), as is an architecture outside that list, a missing or inconsistent
  expert count, and expert tensors in a file that declares no experts.
* :class:`GGUFWeightReader` is a :class:`~fastinfer.layers.WeightReader` under Hugging Face tensor
  names (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``). Weights of the
  types in :data:`GGUF_INT4_TYPES` are read as stored by :meth:`GGUFWeightReader.int4` (:func:`gguf_int4_blocks`) when
  the quantisation config runs them on the int4 kernels (``fastinfer.quant.GgufQuantization``);
  otherwise tensors are dequantised to float32 by the ``gguf`` package (every type it implements:
  F32/F16/BF16, Q4_0..Q8_0, the K-quants, the IQ types), then the layers cast them to the model
  dtype; ``quantization=``
  re-quantises them on load like any float checkpoint (a mixture-of-experts model's experts with
  ``"fp8"`` only). GGUF stacks a layer's experts in one tensor per projection
  (``blk.{i}.ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]``, ``ffn_down_exps`` ``[E, H, I]`` in
  Hugging Face's row-major order, the router ``ffn_gate_inp`` ``[E, H]``); the reader checks those
  shapes and shows expert ``e`` under the hub's per-expert name, dequantising that expert's slice
  alone (its rows are whole quantisation blocks). Qwen2-MoE's shared expert is
  ``blk.{i}.ffn_gate_shexp`` / ``ffn_up_shexp`` ``[Is, H]``, ``ffn_down_shexp`` ``[H, Is]`` and its
  gate ``ffn_gate_inp_shexp``, ``[H]`` (or ``[1, H]`` from newer converters), read as Hugging Face's
  ``[1, H]``; OLMoE's q/k norms over the whole projections are ``attn_q_norm`` / ``attn_k_norm``.
  For ``llama`` files the rows of ``attn_q`` / ``attn_k`` are put back in Hugging Face order:
  llama.cpp's converter permutes them from the half-split RoPE layout (rotate_half) to interleaved
  pairs; :func:`unpermute_qk` is its inverse (the other architectures' rows are stored as they are).
  For ``gemma2`` / ``gemma3`` files (q/k not permuted) the norm weights are put back in Hugging
  Face's convention: llama.cpp's converter stores Gemma's ``1 + weight`` (see
  :data:`_NORM_PLUS_ONE`), the reader subtracts the 1 (exact: the stored values lie in [0.5, 2]
  for any trained model) and :class:`~fastinfer.models.gemma.GemmaRMSNorm` adds it again.
* :meth:`GGUFFile.tokenizer_metadata` hands the ``tokenizer.*`` keys to the engine, which builds
  the tokenizer (:mod:`fastinfer.engine.tokenizer`).

Needs the ``gguf`` package (a dependency of fastinfer); a truncated or corrupt file, an
unsupported tensor type or an unknown tensor name is a ``ValueError`` naming it.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Set, Tuple

import numpy as np
import torch

from .._optional import require
from ..layers import WeightReader
from .config import MOE_ARCHITECTURES, ModelConfig

__all__ = ["GGUF_ARCHITECTURES", "GGUF_INT4_TYPES", "GGUFFile", "GGUFWeightReader", "GgufInt4", "find_gguf",
           "gguf_int4_blocks", "open_gguf", "gguf_model_config", "unpermute_qk", "permute_qk"]

GGUF_MAGIC = b"GGUF"
# general.architecture -> the Hugging Face architecture it runs as
# (a ``llama`` file with experts runs as Mixtral: see _MOE_FORMATS)
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                      "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# architectures whose q/k rows llama.cpp's converter permutes (LlamaModel.permute; the others' graphs
# rotate Hugging Face's half-split layout as it is: NeoX RoPE)
_PERMUTED_QK = ("llama",)
# Architectures whose norm weights llama.cpp's converter stores as 1 + weight: convert_hf_to_gguf.py,
# Gemma2Model.modify_tensors ("if name.endswith('norm.weight'): data_torch = data_torch + 1") and
# Gemma3Model.modify_tensors (norm_shift: 1.0 for every name ending in "norm.weight", q_norm and
# k_norm included), after transformers' Gemma RMSNorm, which scales by 1 + weight; llama.cpp's
# graphs (src/models/gemma2*.cpp, gemma3.cpp) then multiply by the stored weight as it is.
_NORM_PLUS_ONE = ("gemma2", "gemma3")

# GGUF tensor name (after "blk.{i}.") -> Hugging Face name (after "model.layers.{i}.")
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3 (per head), olmoe (over the whole projection)
    "attn_k_norm": "self_attn.k_norm",
    # qwen2moe's shared expert and its gate (see _SHARED_EXPERT)
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma's four norms per layer (gguf's TENSOR_NAMES for MODEL_ARCH.GEMMA2 / GEMMA3): "ffn_norm" is the
# norm before the feed-forward block there, and the post-attention norm has its own name
_GEMMA_LAYER_TENSORS = dict(_LAYER_TENSORS, ffn_norm="pre_feedforward_layernorm",
                            post_attention_norm="post_attention_layernorm",
                            post_ffw_norm="post_feedforward_layernorm")
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
ROPE_FREQS = "rope_freqs.weight"  # llama3-style per-dimension frequency divisors (read into the config)

# {arch}.* metadata keys this module maps (anything else under the architecture's prefix is refused)
_KNOWN_ARCH_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "rope.dimension_count", "rope.freq_base",
    "rope.scale_linear", "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
    "rope.scaling.finetuned", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
    "expert_count", "expert_used_count",  # 0 (or absent) on a dense file
}
# and per architecture (llama.cpp's load_hparams reads these for it)
_ARCH_KEYS = {
    "gemma2": {"attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa",
               "attn_logit_softcapping", "final_logit_softcapping"},
    # no attention soft-capping in Gemma 3 (llama.cpp's converter asserts attn_logit_softcapping is None)
    "gemma3": {"attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa",
               "final_logit_softcapping"},
}


class _MoeFormat(NamedTuple):
    """How llama.cpp stores and runs one architecture's routed experts. Every layer is routed
    (``blk.{i}.ffn_gate_inp`` the router ``[E, H]``; ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]``
    and ``ffn_down_exps`` ``[E, H, I]`` all experts stacked, in Hugging Face's row-major notation),
    with a softmax over the router logits (``expert_gating_func``, when present, must say softmax)."""

    architecture: str  # the Hugging Face architecture a file with experts runs as
    model_type: str
    # {arch}.* metadata key -> (the Hugging Face config field it is, the value llama.cpp takes when the
    # key is absent or 0, from the config dict built so far; None: the key is required)
    keys: Dict[str, Tuple[str, Optional[Callable[[Dict[str, Any]], int]]]]
    config: Dict[str, Any]  # the Hugging Face config fields llama.cpp's graph fixes for the architecture


# GGUF architecture -> its experts (llama.cpp's src/models/<arch>.cpp: load_arch_hparams and
# build_moe_ffn's arguments). A further architecture that MoeForCausalLM runs is a line here and one
# in GGUF_ARCHITECTURES.
_MOE_FORMATS = {
    # Mixtral is llama.cpp's llama graph with experts (src/models/llama.cpp: n_expert > 0): the top-k
    # weights renormalised (norm_w true); each expert as wide as feed_forward_length; no sliding window
    "llama": _MoeFormat("MixtralForCausalLM", "mixtral", {}, {"sliding_window": None}),
    # src/models/qwen3moe.cpp: every layer routed, the top-k weights renormalised (norm_w true, whatever
    # the original norm_topk_prob)
    "qwen3moe": _MoeFormat("Qwen3MoeForCausalLM", "qwen3_moe",
                           {"expert_feed_forward_length": ("moe_intermediate_size", None)},
                           {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    # src/models/qwen2moe.cpp: every layer routed and with the shared expert (see _SHARED_EXPERT), the
    # top-k weights not renormalised (norm_w false, whatever the original norm_topk_prob); the widths
    # default as llama.cpp's loader has them (files converted before the keys existed lack them)
    "qwen2moe": _MoeFormat("Qwen2MoeForCausalLM", "qwen2_moe",
                           {"expert_feed_forward_length":
                            ("moe_intermediate_size", lambda d: d["intermediate_size"] // d["num_experts_per_tok"]),
                            "expert_shared_feed_forward_length":
                            ("shared_expert_intermediate_size", lambda d: d["intermediate_size"])},
                           {"norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
                            "use_sliding_window": False}),
    # src/models/olmoe.cpp: every layer routed, each expert as wide as feed_forward_length, the top-k
    # weights not renormalised (norm_w false); q and k RMS-normalised over their whole projections
    # (attn_q_norm / attn_k_norm, as Hugging Face's); no clamping (the converter writes no
    # attention.clamp_kqv for OLMoE and the graph applies none)
    "olmoe": _MoeFormat("OlmoeForCausalLM", "olmoe", {}, {"norm_topk_prob": False, "clip_qkv": None}),
}
EXPERT_GATING_SOFTMAX = 1  # gguf.ExpertGatingFuncType.SOFTMAX
# a routed layer's GGUF tensors: the router, then the stacked experts' gate, up and down projections
# (in ExpertProjections' order)
_ROUTER = "ffn_gate_inp"
_STACKED_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# Qwen2-MoE's shared expert on every routed layer: a SwiGLU MLP (gate and up [Is, H], down [H, Is])
# scaled by sigmoid(ffn_gate_inp_shexp . x). That gate is [H] in llama.cpp's loader; the converter
# squeezed Hugging Face's [1, H] to it, and since it stopped squeezing writes [1, H], which ggml reads
# alike: the reader shows both as [1, H].
_SHARED_EXPERT = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp")


def _gguf_module():
    return require("gguf", "gguf", "loading a GGUF checkpoint")


def _is_gguf_file(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    if path.endswith(".gguf"):
        return True
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def find_gguf(path: Any) -> Optional[str]:
    """The GGUF file ``path`` names, or None when it is not a GGUF checkpoint: ``path`` itself when
    it is a ``.gguf`` file (or starts with the GGUF magic), else the only ``.gguf`` file of a
    directory that has no ``config.json`` (a Hugging Face checkpoint directory stays one). A
    directory with several ``.gguf`` files and no ``config.json`` is an error listing them."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    path = os.fspath(path)
    if os.path.isfile(path):
        return path if _is_gguf_file(path) else None
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    files = sorted(f for f in os.listdir(path) if f.endswith(".gguf") and os.path.isfile(os.path.join(path, f)))
    if len(files) > 1:
        raise ValueError(f"{path!r} holds several GGUF files ({', '.join(files)}): pass the one to load")
    return os.path.join(path, files[0]) if files else None


class GGUFFile:
    """A parsed GGUF file (memory-mapped): ``metadata`` (key -> Python value; the big tokenizer
    arrays are read on demand by :meth:`array`), ``tensors`` (GGUF name -> the gguf package's
    tensor record), ``architecture``."""

    def __init__(self, path: str):
        gguf = _gguf_module()
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ValueError(f"{path!r} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        try:
            self._reader = gguf.GGUFReader(path, "r")
        except Exception as e:  # the gguf package fails in numpy when the file is cut short
            raise ValueError(f"{path!r}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e
        self.tensors = {}
        for t in self._reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise ValueError(f"{path!r}: truncated GGUF file (tensor {t.name!r} ends at byte "
                                 f"{t.data_offset + t.n_bytes}, the file has {size})")
            if t.name in self.tensors:
                raise ValueError(f"{path!r}: tensor {t.name!r} appears twice")
            self.tensors[t.name] = t
        self._fields = self._reader.fields
        self.metadata: Dict[str, Any] = {}
        for k, fld in self._fields.items():
            if k.startswith("GGUF."):
                continue
            if fld.types and fld.types[0] == gguf.GGUFValueType.ARRAY and len(fld.data) > 1024:
                continue  # big arrays (tokens, merges, scores, token types): see array()
            self.metadata[k] = fld.contents()
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{path!r}: no general.architecture in the GGUF metadata")
        self.architecture = arch

    def has(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.metadata:
            return self.metadata[key]
        return self.array(key) if key in self._fields else default

    def array(self, key: str) -> Optional[List[Any]]:
        """An array field as a list (strings decoded as UTF-8), or None when absent."""
        fld = self._fields.get(key)
        if fld is None:
            return None
        gguf = _gguf_module()
        if fld.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(fld.parts[i]).decode("utf-8") for i in fld.data]
        return [v.item() for i in fld.data for v in fld.parts[i]]

    def tokenizer_metadata(self) -> Dict[str, Any]:
        """The ``tokenizer.*`` keys with the ``tokenizer.`` prefix dropped (``ggml.tokens``,
        ``ggml.merges``, ``ggml.token_type``, ``ggml.bos_token_id``, ``chat_template``, ...)."""
        return {k[len("tokenizer."):]: self.get(k) for k in self._fields if k.startswith("tokenizer.")}

    def shape(self, name: str) -> Tuple[int, ...]:
        """The shape of tensor ``name`` in Hugging Face (row-major, reversed GGUF dims) order."""
        return tuple(int(s) for s in reversed(self.tensors[name].shape))

    def dequantize(self, name: str, index: Optional[int] = None) -> np.ndarray:
        """Tensor ``name`` as float32, in Hugging Face (row-major, reversed GGUF dims) shape; with
        ``index``, only ``tensor[index]`` (one expert of a stacked ``[E, ...]`` tensor: its rows are
        whole quantisation blocks, so it dequantises alone)."""
        gguf = _gguf_module()
        t = self.tensors[name]
        data, shape = t.data, self.shape(name)
        if index is not None:
            data, shape = data[index], shape[1:]
        try:
            w = gguf.dequantize(data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"tensor {name!r} of {self.path!r} has GGML type {t.tensor_type.name}, which the "
                             f"gguf package cannot dequantise ({e})") from e
        if w.dtype != np.float32:
            if not np.issubdtype(w.dtype, np.floating):
                raise ValueError(f"tensor {name!r} of {self.path!r} has integer GGML type {t.tensor_type.name} "
                                 "(a weight must be a float or quantised type)")
            w = w.astype(np.float32)
        return w.reshape(shape)


@lru_cache(maxsize=2)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str) -> GGUFFile:
    """:class:`GGUFFile` of ``path``, parsed once (the config, the weights and the tokenizer read
    the same file; parsing a 49k-token vocabulary takes seconds)."""
    real = os.path.realpath(path)
    if not os.path.isfile(real):
        raise ValueError(f"GGUF file {path!r} does not exist")
    st = os.stat(real)
    return _open_cached(real, st.st_size, st.st_mtime_ns)


# ----------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------
def _llama3_scaling_from_factors(factors: np.ndarray, theta: float, head_dim: int) -> Optional[Dict[str, Any]]:
    """The ``llama3`` rope_scaling whose per-dimension frequency divisors are ``factors`` (what
    llama.cpp's converter writes as ``rope_freqs.weight``), or None when none matches. The divisors
    depend on ``original_max_position_embeddings / low_freq_factor`` and ``/ high_freq_factor``
    only, so any matching triple gives the same RoPE; the usual ones are tried first."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if factors.shape != inv_freq.shape:
        return None
    wavelen = 2 * math.pi / inv_freq
    factor = float(factors.max())
    for orig in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
        for low in (1.0, 2.0):
            for high in (4.0, 2.0, 8.0):
                lw, hw = orig / low, orig / high
                with np.errstate(all="ignore"):
                    smooth = (orig / wavelen - low) / (high - low)
                    mid = 1.0 / ((1 - smooth) / factor + smooth)
                want = np.where(wavelen < hw, 1.0, np.where(wavelen > lw, factor, mid))
                if np.allclose(want, factors, rtol=1e-4, atol=1e-6):
                    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                            "high_freq_factor": high, "original_max_position_embeddings": orig}
    return None


def gguf_config_dict(f: GGUFFile) -> Dict[str, Any]:
    """The Hugging Face ``config.json`` dict the metadata of ``f`` describes (see the module docstring)."""
    arch = f.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{f.path!r}: unsupported GGUF architecture {arch!r} "
                         f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    prefix = arch + "."
    moe = _MOE_FORMATS.get(arch)
    known = _KNOWN_ARCH_KEYS | _ARCH_KEYS.get(arch, set()) | (set(moe.keys) | {"expert_gating_func"} if moe else set())
    unknown = sorted(k for k in f.metadata if k.startswith(prefix) and k[len(prefix):] not in known)
    if unknown:
        raise ValueError(f"{f.path!r}: GGUF metadata {', '.join(unknown)} is not supported (fastinfer does not "
                         "know what it changes, so it refuses rather than run the model differently)")

    def key(name: str, default: Any = "required") -> Any:
        v = f.metadata.get(prefix + name)
        if v is None:
            if default == "required":
                raise ValueError(f"{f.path!r}: GGUF metadata {prefix + name} is missing")
            return default
        return v

    routed = bool(key("expert_count", 0)) or GGUF_ARCHITECTURES[arch] in MOE_ARCHITECTURES
    if routed and moe is None:
        raise ValueError(f"{f.path!r}: mixture-of-experts {arch} GGUF ({prefix}expert_count = {key('expert_count')}) "
                         f"is not supported (supported: {', '.join(_MOE_FORMATS)})")
    if not routed:
        expert_tensors = [n for n in f.tensors if any(f".{k}." in n for k in (_ROUTER,) + _STACKED_EXPERTS)]
        if key("expert_used_count", 0) or expert_tensors:
            what = f"tensor {expert_tensors[0]!r}" if expert_tensors else \
                f"{prefix}expert_used_count = {key('expert_used_count')}"
            raise ValueError(f"{f.path!r}: GGUF metadata {prefix}expert_count is missing or 0, yet the file has "
                             f"experts ({what})")
    heads = key("attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts
        if len(set(kv_heads)) != 1:
            raise ValueError(f"{f.path!r}: per-layer attention.head_count_kv {kv_heads} is not supported")
        kv_heads = kv_heads[0]
    hidden = key("embedding_length")
    d: Dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
    }
    vocab = key("vocab_size", None)
    if vocab is None and "token_embd.weight" in f.tensors:
        vocab = int(f.tensors["token_embd.weight"].shape[-1])
    if vocab is None and f.has("tokenizer.ggml.tokens"):
        vocab = len(f.array("tokenizer.ggml.tokens"))
    d["vocab_size"] = vocab
    head_dim = key("attention.key_length", None)
    vdim = key("attention.value_length", head_dim)
    if head_dim is not None:
        if vdim != head_dim:
            raise ValueError(f"{f.path!r}: attention.key_length {head_dim} != value_length {vdim} is not supported")
    else:  # llama.cpp's default (not the transformers config class's: Qwen3Config says 128)
        head_dim = hidden // heads if heads and hidden % heads == 0 else None
    if head_dim is not None:
        d["head_dim"] = head_dim
    rot = key("rope.dimension_count", None)
    if rot is not None and head_dim and rot != head_dim:
        d["partial_rotary_factor"] = rot / head_dim  # ModelConfig refuses it, naming it
    # RoPE scaling
    stype = key("rope.scaling.type", None)
    factor = key("rope.scaling.factor", None)
    if stype is None and key("rope.scale_linear", None) is not None:
        stype, factor = "linear", key("rope.scale_linear")
    if stype == "linear" and factor is not None and float(factor) != 1.0:
        d["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    elif stype == "yarn":
        s: Dict[str, Any] = {"rope_type": "yarn", "factor": float(key("rope.scaling.factor"))}
        s["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
        for gk, hk in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if key(gk, None) is not None:
                s[hk] = float(key(gk))
        d["rope_scaling"] = s
    elif stype not in (None, "none", "linear"):
        raise ValueError(f"{f.path!r}: unsupported GGUF rope scaling type {stype!r} (supported: none, linear, yarn)")
    if ROPE_FREQS in f.tensors:
        if "rope_scaling" in d:
            raise ValueError(f"{f.path!r}: both {ROPE_FREQS} and {prefix}rope.scaling.type = {stype!r}")
        factors = f.dequantize(ROPE_FREQS).astype(np.float64).reshape(-1)
        if not np.all(factors == 1.0):
            s = _llama3_scaling_from_factors(factors, d["rope_theta"], head_dim or 0) if head_dim else None
            if s is None:
                raise ValueError(f"{f.path!r}: {ROPE_FREQS} holds per-dimension RoPE frequency factors that "
                                 "match no llama3 rope scaling; not supported")
            d["rope_scaling"] = s
    # biases, tying
    d["tie_word_embeddings"] = "output.weight" not in f.tensors
    if arch == "llama":
        d["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
        d["mlp_bias"] = "blk.0.ffn_up.bias" in f.tensors
    elif arch in ("gemma2", "gemma3"):
        _gemma_config(d, f, key)
    elif arch == "olmoe":  # q/k/v and o biased together in Hugging Face's OLMoE
        d["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
    else:  # qwen2 (q/k/v always biased), qwen2moe, qwen3, qwen3moe; no sliding window in llama.cpp
        if arch in ("qwen3", "qwen3moe"):
            d["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
        elif arch == "qwen2moe":
            d["qkv_bias"] = "blk.0.attn_q.bias" in f.tensors
        d["use_sliding_window"] = False
    if routed:
        _moe_config(d, f, key, moe)
    # special tokens: llama.cpp stops on every end-of-generation id (eos, eot, eom)
    bos = f.get("tokenizer.ggml.bos_token_id")
    eos = [f.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = [int(e) for i, e in enumerate(eos) if e is not None and e not in eos[:i]]
    d["bos_token_id"] = int(bos) if bos is not None else None
    d["eos_token_id"] = eos if len(eos) > 1 else (eos[0] if eos else None)
    pad = f.get("tokenizer.ggml.padding_token_id")
    d["pad_token_id"] = int(pad) if pad is not None else None
    d["gguf_file"] = os.path.basename(f.path)
    return d


def _moe_config(d: Dict[str, Any], f: GGUFFile, key, moe: _MoeFormat) -> None:
    """The mixture-of-experts fields of config dict ``d``: ``{arch}.expert_count`` experts,
    ``expert_used_count`` of them per token, the keys (or their defaults) and fixed fields of ``moe``."""
    prefix = f.architecture + "."
    experts, used = key("expert_count"), key("expert_used_count")
    for name, v in (("expert_count", experts), ("expert_used_count", used)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{f.path!r}: GGUF metadata {prefix}{name} must be an int >= 1, got {v!r}")
    if used > experts:
        raise ValueError(f"{f.path!r}: GGUF metadata {prefix}expert_used_count ({used}) is larger than "
                         f"{prefix}expert_count ({experts})")
    gating = key("expert_gating_func", EXPERT_GATING_SOFTMAX)
    if gating != EXPERT_GATING_SOFTMAX:
        raise ValueError(f"{f.path!r}: GGUF metadata {prefix}expert_gating_func = {gating!r} is not supported "
                         f"(only {EXPERT_GATING_SOFTMAX}, softmax routing)")
    # "num_experts": every MoE config class reads it (Mixtral's as an alias of num_local_experts)
    d.update(architectures=[moe.architecture], model_type=moe.model_type, num_experts=experts,
             num_experts_per_tok=used)
    for k, (field, default) in moe.keys.items():
        v = key(k, None) if default is not None else key(k)
        if default is not None and not v:  # llama.cpp's loader: absent or 0 takes the default
            v = default(d)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{f.path!r}: GGUF metadata {prefix}{k} must be an int >= 1, got {v!r}")
        d[field] = v
    d.update(moe.config)


def _gemma_config(d: Dict[str, Any], f: GGUFFile, key) -> None:
    """The Gemma fields of config dict ``d`` as llama.cpp reads a ``gemma2`` / ``gemma3`` file
    (src/models/gemma2.cpp and llama-model.cpp's LLM_ARCH_GEMMA3 ``load_hparams``):

    * sliding window ``attention.sliding_window`` (gemma2: default 4096; gemma3: absent or 0 means
      no sliding layers); every ``attention.sliding_window_pattern``-th layer full attention
      (default 2 for gemma2, 6 for gemma3; a bool array marks the sliding layers);
    * RoPE base ``rope.freq_base`` (default 10000); sliding layers ``rope.freq_base_swa``, else the
      same base (gemma2) or 10000 (gemma3); rope scaling on every layer (gemma2) or on the full
      attention layers only (gemma3);
    * soft-caps ``attn_logit_softcapping`` (gemma2 only; default 50) and
      ``final_logit_softcapping`` (default 30 for gemma2, none for gemma3);
    * the attention scale is not stored: llama.cpp uses ``head_dim ** -0.5``, except for the 27B
      models (46 layers for gemma2, 62 for gemma3), which use ``(hidden / heads) ** -0.5`` (after
      gemma_pytorch's config), so ``query_pre_attn_scalar`` is set to match."""
    arch = f.architecture
    gemma2 = arch == "gemma2"
    d["model_type"] = "gemma2" if gemma2 else "gemma3_text"
    d["hidden_activation"] = "gelu_pytorch_tanh"  # llama.cpp's LLM_FFN_GELU is gelu's tanh form
    del d["hidden_act"]
    d["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
    layers, hidden, heads = d["num_hidden_layers"], d["hidden_size"], d["num_attention_heads"]
    head_dim = d.get("head_dim") or hidden // heads
    big = layers == (46 if gemma2 else 62)
    d["query_pre_attn_scalar"] = hidden // heads if big else head_dim

    window = key("attention.sliding_window", 4096 if gemma2 else 0)
    pattern = key("attention.sliding_window_pattern", 2 if gemma2 else 6)
    if not window:
        sliding = [False] * layers
    elif isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"{f.path!r}: {arch}.attention.sliding_window_pattern has {len(pattern)} entries "
                             f"for {layers} layers")
        sliding = [bool(p) for p in pattern]
    else:  # llama.cpp's set_swa_pattern: n = 0 all sliding, 1 none, else every n-th layer full
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    d["sliding_window"] = int(window) if window else None
    d["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]

    theta = d.pop("rope_theta")
    scaling = d.pop("rope_scaling", None)
    local_theta = float(key("rope.freq_base_swa", theta if gemma2 else 10000.0))
    if gemma2:
        if local_theta != theta and any(sliding):
            raise ValueError(f"{f.path!r}: gemma2.rope.freq_base_swa {local_theta} != rope.freq_base {theta}: "
                             "Gemma 2 has one RoPE base")
        d["rope_parameters"] = dict(scaling or {"rope_type": "default"}, rope_theta=theta)
    else:
        d["rope_parameters"] = {"full_attention": dict(scaling or {"rope_type": "default"}, rope_theta=theta),
                                "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}

    d["attn_logit_softcapping"] = float(key("attn_logit_softcapping", 50.0)) if gemma2 else None
    final = float(key("final_logit_softcapping", 30.0 if gemma2 else 0.0))
    d["final_logit_softcapping"] = final or None


def gguf_model_config(path: str) -> ModelConfig:
    """The :class:`ModelConfig` of GGUF file ``path`` (see :func:`gguf_config_dict`)."""
    return ModelConfig.from_dict(gguf_config_dict(open_gguf(path)))


# ----------------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------------
def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter permutation of q/k projection rows (weight ``[n_head * D, ...]`` or
    bias ``[n_head * D]``): per head, the two RoPE halves are interleaved (rows ``[x0..x_{D/2-1},
    y0..]`` become ``[x0, y0, x1, y1, ...]``), the GPT-J pair layout ggml's rope expects."""
    shape = w.shape
    return w.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).transpose(1, 2).reshape(shape)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of :func:`permute_qk`: interleaved pairs back to Hugging Face's half-split rows."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> Optional[str]:
    """The Hugging Face name of a GGUF tensor name of architecture ``arch``, or None when this module
    has no mapping."""
    base, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    layer_tensors = _GEMMA_LAYER_TENSORS if arch in ("gemma2", "gemma3") else _LAYER_TENSORS
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
        return f"model.layers.{int(parts[1])}.{layer_tensors[parts[2]]}.{suffix}"
    return None


#: GGML types that run as stored on the int4 weight-only path (:func:`gguf_int4_blocks`)
GGUF_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")


class GgufInt4(NamedTuple):
    """A GGUF weight ``W [n, k]`` as one or two planes of 4-bit codes with one scale and one float
    minimum per ``group_size`` consecutive weights of a row (32; Q6_K 16), as the int4 kernels run it:
    ``W = (codes - 8) scales + 16 (high - 8) scales + mins`` (no ``high`` term for the 4-bit types);
    ``scales`` / ``mins`` float32 ``[k / group_size, n]`` (group, row) as the kernels index them,
    ``mins`` None when it is zero everywhere (Q4_0). Every type is ``w = a q + b`` per group with
    integer codes ``q`` (the block formats below), so ``scales = a`` and ``codes = q mod 16``; the
    wider types' ``high`` is ``q // 16 + 8`` (Q5_0 / Q5_1 / Q5_K, whose ``q // 16`` is the fifth
    bit; Q6_K, its two high bits) or ``q // 16`` (Q8_0, ``q + 128`` split in nibbles), and ``mins = b + 8 a`` (Q8_0:
    ``b + 136 a``, the 8 of each plane): centred, a plane's products are as small as Q4_0's (``q a``
    with q up to 255 would overflow float16 where the whole weight does not), the sum of the terms
    cancels little, and a scale rounded to the model dtype errs by ``q - 8`` times its rounding, not
    ``q`` times."""

    codes: np.ndarray  # uint8 [n, k], 0..15
    scales: np.ndarray  # float32 [k / group_size, n]
    mins: Optional[np.ndarray]  # float32 [k / group_size, n], or None (zero)
    high: Optional[np.ndarray] = None  # uint8 [n, k], 0..15 (types wider than 4 bits)
    group_size: int = 32

    def rows(self, order: np.ndarray) -> "GgufInt4":
        """The weight with its rows taken in ``order`` (codes by row, scales / mins by column)."""
        return GgufInt4(self.codes[order], self.scales[:, order], None if self.mins is None else self.mins[:, order],
                        None if self.high is None else self.high[order], self.group_size)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes (the last axis) of each block as the fp16 they hold, in float32 (the axis kept)."""
    return b.copy().view(np.float16).astype(np.float32)


def _k_scale_min(b: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and minimums of Q4_K / Q5_K's 12 bytes ``[..., 12]`` (gguf's
    ``Q4_K.get_scale_min``)."""
    s = b.reshape(*b.shape[:-1], 3, 4)
    lo, hi, both = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([lo & 0x3F, (both & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (both >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _nibbles(qs: np.ndarray, n: int, k: int, span: int) -> np.ndarray:
    """4-bit fields of ``qs [n, blocks, span / 2 * c]`` where each run of ``span / 2`` bytes holds
    weights ``0 .. span / 2 - 1`` of a span in its low nibbles and the rest in its high nibbles."""
    half = span // 2
    q = qs.reshape(n, -1, 1, half) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, k)


def _bits(qh: np.ndarray, n: int, k: int, per_byte: int, width: int) -> np.ndarray:
    """``width``-bit fields of ``qh [n, blocks, bytes]`` where field ``j`` of byte ``i`` (bits
    ``width j ..``) belongs to weight ``j * bytes + i`` of the block (Q5_K / Q6_K's high bits)."""
    nb = qh.shape[-1]
    shifts = (np.arange(per_byte, dtype=np.uint8) * width).reshape(1, 1, per_byte, 1)
    q = (qh.reshape(n, -1, 1, nb) >> shifts) & ((1 << width) - 1)
    return q.reshape(n, k)


def _planes(q: np.ndarray, a: np.ndarray, b: np.ndarray, bits: int, group: int) -> GgufInt4:
    """The :class:`GgufInt4` of ``w = a q + b``: ``bits``-bit integer codes ``q [n, k]``, ``a`` / ``b``
    float32 ``[n, k / group]``. With 5 or 6 bits the high plane holds ``q // 16 + 8`` (its 8 then
    cancels the implied zero point), with 8 bits ``q // 16`` (centred by the zero point itself)."""
    low = (q & 0x0F).astype(np.uint8)
    if bits == 4:
        high, centre = None, 8
    elif bits == 8:
        high, centre = (q >> 4).astype(np.uint8), 136  # 8 + 16 * 8
    else:
        high, centre = ((q >> 4) + 8).astype(np.uint8), 8
    mins = b + centre * a  # exact: the products of an fp16 and a small integer
    return GgufInt4(low, a.T.copy(), mins.T.copy() if mins.any() else None, high, group)


def gguf_int4_blocks(type_name: str, blocks: np.ndarray, n: int, k: int) -> GgufInt4:
    """The :class:`GgufInt4` of a weight stored as GGML ``type_name`` blocks ``uint8 [n, row bytes]``.

    The block layouts, as the ``gguf`` package's own dequantisers read them (gguf/quants.py; the
    tests check every type against ``gguf.dequantize``), ``d`` / ``m`` / ``dmin`` fp16:

    * Q4_0 (32 weights, 18 bytes): ``d``, 16 bytes whose low nibbles are weights 0..15 and high
      nibbles 16..31; ``w = d (q - 8)``. Q4_1 (20 bytes): ``d``, ``m``, the same 16 bytes;
      ``w = d q + m``.
    * Q5_0 (22 bytes): ``d``, 4 bytes of fifth bits (bit ``j`` of the little-endian word for weight
      ``j``), Q4_0's 16 bytes; ``w = d (q - 16)``. Q5_1 (24 bytes): ``d``, ``m``, the same;
      ``w = d q + m``.
    * Q8_0 (34 bytes): ``d``, 32 int8 ``q``; ``w = d q``.
    * Q4_K (256 weights, 144 bytes): ``d``, ``dmin``, 12 bytes of eight 6-bit scales ``sc_j`` and
      minimums ``m_j`` (``Q4_K.get_scale_min``), 128 bytes, 32 per pair of 32-weight sub-blocks (low
      nibbles the first, high the second); ``w = d sc_j q - dmin m_j`` in sub-block ``j``.
      Q5_K (176 bytes): ``d``, ``dmin``, the same 12 bytes, 32 bytes whose bit ``j`` is the fifth
      bit of sub-block ``j``'s weights (byte ``i`` for weight ``i`` of each), then Q4_K's 128.
    * Q6_K (256 weights, 210 bytes): 128 bytes of low nibbles (per 128 weights, 64 bytes: weights
      0..63 low, 64..127 high), 64 bytes of high bit pairs (per 128 weights, 32 bytes: bits 2 s of
      byte ``i`` for weight ``32 s + i``), 16 int8 scales ``sc_j``, one per 16 weights, and ``d``
      last; ``w = d sc_j (q - 32)``: group size 16.
    """
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        head = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[type_name]
        b = blocks.reshape(n, k // 32, head + 16)
        d = _f16(b[..., 0:2])[..., 0]  # [n, k / 32]
        q = _nibbles(b[..., head:], n, k, 32)
        if type_name.startswith("Q5"):
            qh = b[..., head - 4:head]  # 32 bits, weight j in bit j of the little-endian word
            q = q | (_bits(qh, n, k, 8, 1).reshape(n, k // 32, 8, 4).transpose(0, 1, 3, 2).reshape(n, k) << 4)
        if type_name in ("Q4_1", "Q5_1"):
            m = _f16(b[..., 2:4])[..., 0]
        else:
            m = -(8 if type_name == "Q4_0" else 16) * d
        return _planes(q, d, m, 5 if type_name.startswith("Q5") else 4, 32)
    if type_name in ("Q4_K", "Q5_K"):
        wide = type_name == "Q5_K"
        b = blocks.reshape(n, k // 256, 176 if wide else 144)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [n, k / 256, 1]
        sc, mn = _k_scale_min(b[..., 4:16])  # [n, k / 256, 8]
        q = _nibbles(b[..., 48:] if wide else b[..., 16:], n, k, 64)
        if wide:
            q = q | (_bits(b[..., 16:48], n, k, 8, 1) << 4)
        return _planes(q, (d * sc).reshape(n, k // 32), -(dmin * mn).reshape(n, k // 32), 5 if wide else 4, 32)
    if type_name == "Q6_K":
        b = blocks.reshape(n, k // 256, 210)
        q = _nibbles(b[..., :128], n, k, 128) | (_bits(b[..., 128:192].reshape(n, -1, 32), n, k, 4, 2) << 4)
        a = (_f16(b[..., 208:210]) * b[..., 192:208].view(np.int8).astype(np.float32)).reshape(n, k // 16)
        return _planes(q, a, -32 * a, 6, 16)
    if type_name == "Q8_0":
        b = blocks.reshape(n, k // 32, 34)
        d = _f16(b[..., 0:2])[..., 0]
        u = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8).reshape(n, k)  # q + 128
        return _planes(u, d, -128 * d, 8, 32)
    raise ValueError(f"GGML type {type_name} has no int4 form (one of {', '.join(GGUF_INT4_TYPES)})")


class GGUFWeightReader(WeightReader):
    """The tensors of GGUF file ``path`` under Hugging Face names, dequantised to float32 when read
    (q/k rows un-permuted for ``llama`` files, 1 taken off Gemma's norm weights). A GGUF tensor
    without a mapping keeps its GGUF name, so the loader reports it as unexpected;
    ``rope_freqs.weight`` is read into the config instead. A mixture-of-experts model's stacked
    expert tensors are seen as the hub's per-expert ones: ``blk.{i}.ffn_gate_exps.weight[e]`` is
    ``model.layers.{i}.mlp.experts.{e}.gate_proj.weight`` for Qwen2-MoE, Qwen3-MoE and OLMoE and
    ``model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight`` for Mixtral, the router
    ``blk.{i}.ffn_gate_inp.weight`` is ``model.layers.{i}.mlp.gate.weight`` /
    ``...block_sparse_moe.gate.weight``; each expert is dequantised on its own when read. Qwen2-MoE's
    shared expert keeps its own names (``blk.{i}.ffn_gate_shexp.weight`` is
    ``model.layers.{i}.mlp.shared_expert.gate_proj.weight``, ``ffn_gate_inp_shexp`` is
    ``mlp.shared_expert_gate``, shown ``[1, H]`` when stored ``[H]``), its shapes checked with the
    experts'."""

    def __init__(self, path: str, config: Optional[ModelConfig] = None):
        self.file = open_gguf(path)
        super().__init__(repr(path))
        self.path = path
        config = config if config is not None else gguf_model_config(path)
        self._where: Dict[str, str] = {}  # HF (or unmapped GGUF) name -> GGUF name
        for g in self.file.tensors:
            if g == ROPE_FREQS:
                continue
            name = hf_tensor_name(g, self.file.architecture) or g
            self._where[name] = g
        self._expert: Dict[str, int] = {}  # per-expert HF name -> its index in the stacked GGUF tensor
        self._as_row: Set[str] = set()  # GGUF names of [H] tensors read as Hugging Face's [1, H]
        if config.num_experts:
            self._map_experts(config)
        self._norm_plus_one = self.file.architecture in _NORM_PLUS_ONE
        self._heads: Dict[str, int] = {}  # HF name -> heads of the q/k permutation
        if self.file.architecture in _PERMUTED_QK:
            for i in range(config.num_hidden_layers):
                for proj, n in (("q_proj", config.num_attention_heads), ("k_proj", config.num_key_value_heads)):
                    for suffix in ("weight", "bias"):
                        self._heads[f"model.layers.{i}.self_attn.{proj}.{suffix}"] = n
        self._check_types()

    def _map_experts(self, config: ModelConfig) -> None:
        """The routed layers' router and stacked experts under their per-expert Hugging Face names
        (the module and projection names :class:`~fastinfer.models.moe.MoeForCausalLM` reads), after
        checking each stacked tensor holds ``[E, I, H]`` / ``[E, H, I]``."""
        from .moe import MOE_CHECKPOINT_NAMES  # the models import this module

        module, projections = MOE_CHECKPOINT_NAMES[config.architecture]
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        prefix = self.file.architecture + "."
        for i in range(config.num_hidden_layers):
            if not config.is_moe_layer(i):
                continue
            layer = f"model.layers.{i}.{module}"
            stacked = zip((_ROUTER,) + _STACKED_EXPERTS, (None,) + tuple(projections),
                          ((E, H), (E, I, H), (E, I, H), (E, H, I)))
            for kind, projection, want in stacked:
                g = f"blk.{i}.{kind}.weight"
                if g not in self.file.tensors:
                    raise ValueError(f"{self.path!r}: tensor {g!r} is missing (layer {i} routes over {E} experts)")
                got = self.file.shape(g)
                if got != want:
                    raise ValueError(f"{self.path!r}: tensor {g!r} has shape {list(got)}, expected {list(want)} "
                                     f"({prefix}expert_count {E}, hidden {H}, expert width {I})")
                del self._where[g]
                if projection is None:
                    self._where[f"{layer}.gate.weight"] = g
                    continue
                for e in range(E):
                    name = f"{layer}.experts.{e}.{projection}.weight"
                    self._where[name] = g
                    self._expert[name] = e
            if config.shared_expert_intermediate_size:
                self._check_shared_expert(i, H, config.shared_expert_intermediate_size)

    def _check_shared_expert(self, layer: int, H: int, Is: int) -> None:
        """Layer ``layer``'s shared expert (:data:`_SHARED_EXPERT`) is all there, each tensor of its
        shape; a ``[H]`` gate is read as ``[1, H]``."""
        prefix = self.file.architecture + "."
        want = {"ffn_gate_shexp": [(Is, H)], "ffn_up_shexp": [(Is, H)], "ffn_down_shexp": [(H, Is)],
                "ffn_gate_inp_shexp": [(H,), (1, H)]}
        for kind in _SHARED_EXPERT:
            g = f"blk.{layer}.{kind}.weight"
            if g not in self.file.tensors:
                raise ValueError(f"{self.path!r}: tensor {g!r} is missing (layer {layer} has a shared expert)")
            got = self.file.shape(g)
            if got not in want[kind]:
                raise ValueError(f"{self.path!r}: tensor {g!r} has shape {list(got)}, expected "
                                 f"{' or '.join(str(list(w)) for w in want[kind])} (hidden {H}, "
                                 f"{prefix}expert_shared_feed_forward_length {Is})")
            if got == (H,):
                self._as_row.add(g)

    def _check_types(self) -> None:
        """Refuse a tensor type the gguf package cannot dequantise now, not half-way through loading."""
        seen = set()
        for g, t in self.file.tensors.items():
            if t.tensor_type in seen:
                continue
            seen.add(t.tensor_type)
            gguf = _gguf_module()
            block = t.data.reshape(-1, t.data.shape[-1])[:1]  # one row
            try:
                out = gguf.dequantize(block, t.tensor_type)
            except NotImplementedError as e:
                raise ValueError(f"tensor {g!r} of {self.path!r} has GGML type {t.tensor_type.name}, which the gguf "
                                 f"package cannot dequantise ({e})") from e
            if not np.issubdtype(out.dtype, np.floating):
                raise ValueError(f"tensor {g!r} of {self.path!r} has integer GGML type {t.tensor_type.name} "
                                 "(a weight must be a float or quantised type)")

    def names(self) -> Iterable[str]:
        return self._where.keys()

    def has(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> Tuple[int, ...]:
        g = self._where[name]
        shape = self.file.shape(g)
        if g in self._as_row:
            return (1,) + shape
        return shape[1:] if name in self._expert else shape

    def gguf_type(self, name: str) -> str:
        """The GGML type name of a tensor (``Q4_1``, ``F32``, ...)."""
        return self.file.tensors[self._where[name]].tensor_type.name

    def int4(self, name: str) -> Optional[GgufInt4]:
        """Weight ``name`` as stored (marked used, as :meth:`get` does), when its GGML type is one of
        :data:`GGUF_INT4_TYPES` (None otherwise, and for experts, which load dequantised): its codes,
        scales and minimums (:func:`gguf_int4_blocks`), q/k rows put back in Hugging Face order like
        :meth:`_read`'s."""
        g = self._where[name]
        t = self.file.tensors[g]
        if t.tensor_type.name not in GGUF_INT4_TYPES or name in self._expert or g in self._as_row:
            return None
        shape = self.file.shape(g)
        if len(shape) != 2:
            return None
        n, k = shape
        q = gguf_int4_blocks(t.tensor_type.name, np.asarray(t.data).reshape(n, -1), n, k)
        self.used.add(name)
        heads = self._heads.get(name)
        if heads:  # the permutation moves whole rows: codes by row, scales / mins by column
            order = unpermute_qk(torch.arange(n).reshape(n, 1), heads).reshape(n).numpy()
            q = q.rows(order)
        return q

    def _read(self, name: str) -> torch.Tensor:
        g = self._where[name]
        w = self.file.dequantize(g, self._expert.get(name))
        w = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
        if g in self._as_row:
            return w.reshape(1, -1)
        n = self._heads.get(name)
        if n:
            return unpermute_qk(w, n)
        if self._norm_plus_one and name.endswith("norm.weight"):
            return w - 1.0
        return w
