"""A fixed corpus of attention op outputs, as hashes of their bytes, to show that a change to the
kernels' structure leaves every output bit for bit as it was.

    python tools/attention_corpus.py write before.json        # with the build before the change
    python tools/attention_corpus.py compare before.json      # with the build after it

The cases run the CUDA kernel sources through the emulator (``torch.ops.fastinfer_sim``; on a GPU,
``--backend cuda``) over the prefill kernel's modes (default, the default-mode key split, the
deterministic fold, split-parallel and tree phases), contiguous and paged K/V, fp8 caches, tree masks,
windows, softcap and sinks, for each head dim and half dtype. Inputs come from fixed seeds, so two
builds see the same bytes; the test overrides (docs/design.md) force the plans that the shapes
would not choose on their own.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from typing import Callable, Dict, List, Tuple

import torch

Case = Tuple[str, Dict[str, str], Callable[[], Tuple[torch.Tensor, ...]]]


def _randn(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)


def _tree_mask(q_len: int, gen) -> torch.Tensor:
    """A random tree over q_len nodes: node i's parent is an earlier node; row i sees its ancestors."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, q_len)]
    m = torch.zeros(q_len, q_len, dtype=torch.bool)
    for i in range(q_len):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parent[j]
    return m.flatten()


def _paged(k_lens, hkv, d, dtype, gen, block_size=16, fp8=False):
    blocks = [(n + block_size - 1) // block_size for n in k_lens]
    nb = sum(blocks) + 3
    perm = torch.randperm(nb, generator=gen).to(torch.int32)
    table = torch.zeros(len(k_lens), max(blocks), dtype=torch.int32)
    at = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[at:at + n]
        at += n
    k = _randn((nb, block_size, hkv, d), dtype, gen)
    v = _randn((nb, block_size, hkv, d), dtype, gen)
    if fp8:
        k, v = (k.float() * 8).to(torch.float8_e4m3fn), (v.float() * 8).to(torch.float8_e4m3fn)
    return k, v, table, torch.tensor(k_lens, dtype=torch.int32)


def cases(ns, dtypes, head_dims) -> List[Case]:
    out: List[Case] = []
    for dtype in dtypes:
        for d in head_dims:
            tag = f"{str(dtype)[6:]}-d{d}"

            def contiguous(q_lens, k_lens, hq, hkv, causal, window, softcap, fixed, sinks, seed, dtype=dtype, d=d):
                def run():
                    g = torch.Generator().manual_seed(seed)
                    q = _randn((sum(q_lens), hq, d), dtype, g)
                    k, v = _randn((sum(k_lens), hkv, d), dtype, g), _randn((sum(k_lens), hkv, d), dtype, g)
                    s = torch.randn(hq, generator=g) if sinks else None
                    return ns.prefill_attention(q, k, v, _cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens),
                                                d ** -0.5, causal, window, softcap, True, fixed, s)
                return run

            def paged(q_lens, k_lens, hq, hkv, window, fixed, tree, fp8, sinks, seed, dtype=dtype, d=d):
                def run():
                    g = torch.Generator().manual_seed(seed)
                    q = _randn((sum(q_lens), hq, d), dtype, g)
                    kc, vc, table, lens = _paged(k_lens, hkv, d, dtype, g, fp8=fp8)
                    mask = torch.cat([_tree_mask(n, g) for n in q_lens]) if tree else None
                    s = torch.randn(hq, generator=g) if sinks else None
                    ks = (torch.rand(hkv, generator=g) * 0.2 + 0.05) if fp8 else None
                    vs = (torch.rand(hkv, generator=g) * 0.2 + 0.05) if fp8 else None
                    return ns.paged_prefill_attention(q, kc, vc, table, _cu(q_lens), lens, max(q_lens), d ** -0.5,
                                                      True, window, 0.0, mask, True, None, fixed, s, ks, vs)
                return run

            def decode(k_lens, hq, hkv, splits, fixed, fp8, sinks, seed, dtype=dtype, d=d):
                def run():
                    g = torch.Generator().manual_seed(seed)
                    q = _randn((len(k_lens), hq, d), dtype, g)
                    kc, vc, table, lens = _paged(k_lens, hkv, d, dtype, g, fp8=fp8)
                    s = torch.randn(hq, generator=g) if sinks else None
                    ks = torch.tensor([0.07]) if fp8 else None
                    vs = torch.tensor([0.11]) if fp8 else None
                    return ns.paged_decode_attention(q, kc, vc, table, lens, d ** -0.5, -1, 0.0, splits, True, ks, vs,
                                                     fixed, s)
                return run

            none: Dict[str, str] = {}
            split3 = {"FASTINFER_TEST_DEFAULT_KEY_SPLITS": "3"}
            out += [
                (f"prefill-{tag}-causal", none, contiguous([37, 5, 70], [37, 9, 70], 4, 2, True, -1, 0.0, 0, False, 1)),
                (f"prefill-{tag}-noncausal-softcap", none, contiguous([20, 3], [45, 130], 6, 2, False, -1, 30.0, 0, False, 2)),
                (f"prefill-{tag}-window-sinks", none, contiguous([90], [90], 4, 1, True, 17, 0.0, 0, True, 3)),
                (f"prefill-{tag}-split", split3, contiguous([9, 4], [200, 150], 4, 2, True, -1, 0.0, 0, True, 4)),
                (f"prefill-{tag}-fold", none, contiguous([33, 70], [160, 70], 4, 2, True, -1, 0.0, 64, True, 5)),
                (f"paged-{tag}-chunk", none, paged([12, 30], [140, 30], 8, 2, -1, 0, False, False, False, 6)),
                (f"paged-{tag}-split-fp8", split3, paged([5, 16], [300, 90], 4, 2, -1, 0, False, True, True, 7)),
                (f"paged-{tag}-tree-window", none, paged([9, 16], [100, 40], 4, 2, 20, 0, True, False, False, 8)),
                (f"paged-{tag}-fold-tree-shared", {"FASTINFER_TEST_FIXED_TREE_PREFIX": "shared"},
                 paged([9, 16], [200, 100], 4, 2, -1, 64, True, False, True, 9)),
                (f"paged-{tag}-fold-tree-per-token", {"FASTINFER_TEST_FIXED_TREE_PREFIX": "per-token"},
                 paged([9, 16], [200, 100], 4, 2, -1, 64, True, True, False, 10)),
                (f"paged-{tag}-fold", none, paged([40, 7], [170, 7], 4, 2, -1, 128, False, True, True, 11)),
                (f"decode-{tag}-splits", none, decode([300, 17, 129], 8, 2, 3, 0, False, True, 12)),
                (f"decode-{tag}-fp8", none, decode([77, 250], 4, 4, 0, 0, True, False, 13)),
                (f"decode-{tag}-fixed", {"FASTINFER_TEST_FIXED_SPLIT_PARTIAL_BYTES": "4096"},
                 decode([300, 17, 129], 8, 2, 0, 64, False, True, 14)),
            ]
    return out


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def run_corpus(backend: str, dtypes, head_dims) -> Dict[str, str]:
    import fastinfer  # noqa: F401

    if backend == "sim":
        import fastinfer._sim  # noqa: F401
        ns, device = torch.ops.fastinfer_sim, "cpu"
    else:
        ns, device = torch.ops.fastinfer, "cuda"
    result = {}
    for name, env, run in cases(ns, dtypes, head_dims):
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            with torch.device(device):
                result[name] = digest(run())
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("write", "compare"))
    ap.add_argument("path")
    ap.add_argument("--backend", choices=("sim", "cuda"), default="sim")
    ap.add_argument("--head-dims", default="64,128,256")
    args = ap.parse_args(argv)
    head_dims = [int(x) for x in args.head_dims.split(",")]
    got = run_corpus(args.backend, (torch.float16, torch.bfloat16), head_dims)
    if args.action == "write":
        with open(args.path, "w") as f:
            json.dump({"backend": args.backend, "digests": got}, f, indent=1, sort_keys=True)
        print(f"{len(got)} outputs written to {args.path}")
        return 0
    with open(args.path) as f:
        want = json.load(f)["digests"]
    common = sorted(set(want) & set(got))
    differ = [n for n in common if want[n] != got[n]]
    for n in differ:
        print(f"differs: {n}")
    print(f"{len(common) - len(differ)} of {len(common)} outputs bitwise equal"
          f" ({len(set(got) - set(want))} new, {len(set(want) - set(got))} missing)")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
