"""Deterministic-mode sampling: a seeded token depends on the seed, the position and the
logits alone, so the speculative verifier reproduces plain decoding's draws token for token.

The target here is a synthetic one, ``logits = f(prefix)`` (random logits seeded by the prefix), so
the logits are bitwise the same with and without speculation by construction and the test checks
the sampling side alone; the kernels' share of the guarantee is tested with the ops.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from fastinfer.engine.params import SamplingParams
from fastinfer.engine.sampler import Sampler, position_noise
from fastinfer.engine.speculative.drafter import Draft
from fastinfer.engine.speculative.verifier import verify
from fastinfer.ops import backend

DETERMINISTIC = backend("fastinfer", deterministic=True)  # the mode is the op backend's

V = 50


def target_logits(prefix):
    """The synthetic target: peaked random logits, a function of the prefix alone."""
    g = torch.Generator().manual_seed(hash(tuple(prefix)) & 0x7FFFFFFF)
    return torch.randn(V, generator=g) * 3.0


def seeded(seed, index=0):
    return torch.Generator().manual_seed(seed * 1000 + index)


def plain_decode(prompt, params, steps, sampler):
    tokens, gen = list(prompt), seeded(params.seed)
    for _ in range(steps):
        (t,), _ = sampler(target_logits(tokens)[None], [params], [tokens], [gen])
        tokens.append(t)
    return tokens[len(prompt):]


def test_position_noise_is_a_function_of_seed_and_position():
    a = position_noise(7, 12, V, "cpu")
    assert torch.equal(a, position_noise(7, 12, V, "cpu"))
    assert not torch.equal(a, position_noise(7, 13, V, "cpu"))
    assert not torch.equal(a, position_noise(8, 12, V, "cpu"))
    assert (a > 0).all()


def test_deterministic_sampler_ignores_batch_and_earlier_draws():
    prompt = [1, 2, 3]
    p = SamplingParams(temperature=1.0, seed=5)
    row = target_logits(prompt)
    alone, _ = Sampler(torch.Generator(), DETERMINISTIC)(row[None], [p], [prompt], [seeded(5)])
    gen = seeded(5)
    torch.rand(3, generator=gen)  # a generator that drew before (a step without speculation, a draft proposal)
    others = torch.randn(3, V)
    batch = torch.cat([others[:1], row[None], others[1:]])
    params = [SamplingParams(temperature=0.7, top_k=5, seed=1), p, SamplingParams(temperature=1.3)]
    mixed, _ = Sampler(torch.Generator(), DETERMINISTIC)(batch, params, [[9], prompt, [8]],
                                                             [seeded(1), gen, None])
    assert mixed[1] == alone[0]


def test_default_sampler_depends_on_earlier_draws():
    """The mode is what makes the test above hold: by default a seeded row's draw moves with the
    generator's stream (here: the 20 positions do not all repeat after one extra draw)."""
    prompt, p = [1, 2, 3], SamplingParams(temperature=1.0, seed=5)
    fresh, moved = seeded(5), seeded(5)
    torch.rand(1, generator=moved)
    row = target_logits(prompt)[None]
    a = [Sampler(torch.Generator())(row, [p], [prompt], [fresh])[0][0] for _ in range(20)]
    b = [Sampler(torch.Generator())(row, [p], [prompt], [moved])[0][0] for _ in range(20)]
    assert a != b


def random_tree(truth, n_nodes, rng):
    """A draft tree (parents in topological order) whose nodes follow ``truth`` (the tokens plain
    decoding emits) with probability 0.7 and are random otherwise."""
    tokens, parents, depths = [0], [-1], [0]
    for _ in range(n_nodes):
        parent = rng.randrange(len(tokens))
        depth = depths[parent] + 1
        on_truth = all(depths[a] <= len(truth) and tokens[a] == truth[depths[a] - 1]
                       for a in _ancestors(parents, parent) if a != 0)
        t = truth[depth - 1] if on_truth and depth <= len(truth) and rng.random() < 0.7 else rng.randrange(V)
        tokens.append(t)
        parents.append(parent)
        depths.append(depth)
    return tokens, parents, depths


def _ancestors(parents, node):
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out


def tree_rows(context, tokens, parents):
    rows = []
    for j in range(len(tokens)):
        path = [tokens[a] for a in reversed(_ancestors(parents, j)) if a != 0]
        rows.append(target_logits(context + path))
    return torch.stack(rows)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_deterministic_verify_emits_the_plain_decode_tokens(temperature):
    rng = random.Random(int(temperature * 10))
    sampler = Sampler(torch.Generator(), DETERMINISTIC)
    trials = 0
    for seed in range(12):
        p = SamplingParams(temperature=temperature, seed=seed)
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 6))]
        truth = plain_decode(prompt, p, 16, sampler)
        for cut in range(0, 4):  # verify from several points of the same completion
            context = prompt + truth[:cut]
            tokens, parents, depths = random_tree(truth[cut:], rng.randrange(1, 9), rng)
            tokens[0] = context[-1]
            seq = SimpleNamespace(params=p, num_computed_tokens=len(context) - 1)
            d = Draft(seq, tokens, parents, depths, None, None, [-1] * len(tokens), 0)
            verify([d], tree_rows(context, tokens, parents), [seeded(seed)], DETERMINISTIC)
            emitted = [tokens[a] for a in d.path[1:]] + [d.next_token]
            assert emitted == truth[cut:cut + len(emitted)], (seed, cut, tokens, parents)
            trials += 1
    assert trials == 48


def test_default_verify_does_not_reproduce_plain_decode():
    """By default verification draws its own uniforms (rejection sampling), which is exact in
    distribution but not token for token: over these trials some emitted token differs."""
    rng = random.Random(3)
    sampler = Sampler(torch.Generator(), DETERMINISTIC)
    differs = 0
    for seed in range(12):
        p = SamplingParams(temperature=1.0, seed=seed)
        prompt = [rng.randrange(V) for _ in range(3)]
        truth = plain_decode(prompt, p, 6, sampler)
        tokens, parents, depths = random_tree(truth, 4, rng)
        tokens[0] = prompt[-1]
        d = Draft(SimpleNamespace(params=p, num_computed_tokens=len(prompt) - 1), tokens, parents, depths,
                  None, None, [-1] * len(tokens), 0)
        verify([d], tree_rows(prompt, tokens, parents), [seeded(seed)])
        emitted = [tokens[a] for a in d.path[1:]] + [d.next_token]
        differs += emitted != truth[:len(emitted)]
    assert differs > 0
