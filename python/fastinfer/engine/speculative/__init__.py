"""Speculative decoding: a draft model (same tokenizer) proposes chains or EAGLE-2-style trees,
the target verifies them in one forward with tree attention.

Split along the engine's lines: :mod:`.proposer` is the engine core's half (the scheduler's
lookahead rule, the draft's KV coverage, statistics; token ids only), :mod:`.drafter` the
executor's (the draft model, its KV pool, its forwards), :mod:`.verifier` turns the target's
logits into accepted tokens and KV slot moves (data the executor applies). This package's face
imports nothing (the core imports the proposer without torch): import the defining modules.

One speculative step of a decoding sequence with committed tokens ``t_0 .. t_{n-1}`` (the target has
K/V for ``t_0 .. t_{n-2}``; ``t_{n-1}``, the *root*, is the last sampled token):

1. **Draft** (:meth:`DraftModelDrafter.propose`). The draft model first catches up: it computes the
   committed tokens it has no K/V for (from the proposer's ``draft_computed`` to ``n-1``) and
   yields its distribution at the root. Then

   * ``chain`` (k = ``num_spec_tokens``): k tokens ``d_1 .. d_k``, each from the draft's
     distribution at the previous one (``d_i`` is fed to the draft as a decode row at position
     ``n - 1 + i``). Greedy requests take the draft's argmax; sampling requests draw from
     ``q = softmax(draft_logits / temperature)`` (the request's temperature) and the rows of ``q``
     are passed to ``tree_verify`` as ``draft_probs`` (recursive rejection sampling: exact).
   * ``tree`` (EAGLE-2): the root's ``topk`` most probable children form depth 1; for every further
     depth, the ``topk`` nodes of the current depth with the highest cumulative draft
     log-probability are *fed* to the draft (one draft forward per depth, tree attention over the
     fed nodes) and each gets its ``topk`` most probable children. Finally the ``num_spec_tokens``
     best nodes of the whole candidate tree by cumulative log-probability are kept (ties: shallower
     first, so a kept node's parent is always kept). Candidates are deterministic given the draft,
     so ``tree_verify`` runs with ``draft_probs=None`` (exact by the deterministic-candidate rule).

2. **Verify** (one target forward for all sequences, :mod:`.verifier`): the root and the nodes
   are one prefill chunk of the sequence at slots ``n-1 .. n-2+N`` with positions ``n - 1 + depth``
   and, for trees, the ancestor ``custom_mask``; every node row gets logits.
   :func:`fastinfer.ops.tree_verify` (per group of equal tree size and mode) returns the accepted
   path and the next token; uniforms are drawn from the request's generator (its seed), so seeded
   requests are reproducible.

3. **Commit** (:func:`.verifier.commit_moves`): the accepted nodes' K/V rows are moved to the
   slots of consecutive positions with ``move_kv_slots`` in the target pool and, for nodes the draft
   was fed, in the draft pool (by the executor); the engine core gives the blocks past the new
   length back to the block manager.

KV layout of the draft: its own pool (per layer ``[num_blocks, block_size, Hkv_draft, D_draft]``)
indexed by the SAME block ids as the target's (the sequence's block table); which of it is valid is
the core proposer's state (:mod:`.proposer`). Fed draft nodes live at positions ``n + fed_index``
(inside the slots the scheduler reserved, the plan's ``span``).

Seeded requests are reproducible: the draft's draws (chain sampling) and the verification uniforms
come from the request's generator. A step in which a sequence cannot speculate (token budget or free
blocks short, see the scheduler's lookahead) samples it the ordinary way, which consumes its generator
differently: under such pressure a seeded completion may depend on the load (it stays exact).

Draft heads (``spec_method``; :mod:`.registry` holds each method's configuration as data,
:mod:`.build` its head loader and drafter, :mod:`.proposer` its proposer): :mod:`.medusa` (static
trees of :mod:`.trees` from heads on the hidden state that produced the root: the executor hands the
drafter the target's hidden states of the logits rows),
:mod:`.eagle` (the drafting above, one row earlier, on a decoder layer fed with the target's features
of every row, kept in a feature pool by KV slot), :mod:`.eagle3` (the same on ``fc`` of three target
layers' states, the drafter's ``hidden_layers``, with its own norm and a reduced vocabulary) and
:mod:`.dflash` (a whole block drafted in one forward of a drafter conditioned on several target
layers' outputs, its context K/V written from a feature pool by KV slot; Medusa's static trees over
the block's positions).

Not speculated (they decode normally, in the same step): requests with ``SamplingParams.speculative
= False``, requests using top-k / top-p / min-p / repetition penalty (the verifier reproduces the
plain temperature distribution only), requests with fewer than 2 tokens left to generate, and
sequences whose tree would not fit ``max_model_len``.
"""
