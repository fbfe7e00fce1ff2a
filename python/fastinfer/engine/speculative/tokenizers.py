"""A draft model must share the target's tokenizer (draft heads use the target's by construction)."""

from __future__ import annotations

from ..tokenizer import Tokenizer, has_tokenizer

__all__ = ["check_draft_tokenizer"]


def check_draft_tokenizer(spec, target_tok) -> None:
    """With a draft checkpoint (``spec_method="draft"``: the registry's ``spec_model_is_checkpoint``)
    holding a tokenizer: the same vocabulary as ``target_tok`` (a ValueError naming the first
    differing token otherwise)."""
    if spec is None or not spec.entry.spec_model_is_checkpoint or not isinstance(spec.draft_model, str) \
            or target_tok is None \
            or not has_tokenizer(spec.draft_model):
        return
    dv = Tokenizer(spec.draft_model).get_vocab()
    tv = target_tok.get_vocab()
    if dv != tv:
        diff = next((t for t in sorted(set(dv) | set(tv)) if dv.get(t) != tv.get(t)), None)
        raise ValueError(f"draft_model's tokenizer.json differs from the target's (token {diff!r}: draft id "
                         f"{dv.get(diff)}, target id {tv.get(diff)}): speculative decoding needs the same tokenizer")
