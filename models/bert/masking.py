"""BERT's masked-language-model corruption: which tokens a batch hides, and what the model must predict there.

Of the positions that are not special tokens ([CLS], [SEP], [PAD], [MASK]), each is chosen with ``probability``
(0.15 in BERT). A chosen position becomes [MASK] with probability 0.8, a random non-special token with 0.1, and
stays as it is with 0.1, so that the model cannot learn that only [MASK] positions matter. Labels hold the original
token at chosen positions and IGNORE_INDEX everywhere else. Every draw comes from the caller's generator, on the
tokens' device, and the same number of values is drawn whatever the tokens are: a generator seeded from (seed,
rank, step) masks the same way again on resume.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from core.errors import check_ranges
from core.tokens import IGNORE_INDEX

MASK_FRACTION = 0.8  # of the chosen positions, those replaced by [MASK]
RANDOM_FRACTION = 0.1  # those replaced by a random token; the rest (0.1) keep their token


def mask_tokens(
    tokens: torch.Tensor,
    generator: torch.Generator,
    vocab_size: int,
    mask_token_id: int,
    special_token_ids: Iterable[int],
    probability: float = 0.15,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's inputs and the labels for ``tokens`` (any shape, usually (B, T)): see the module docstring.
    ``special_token_ids`` are never chosen and never drawn as random replacements; ``mask_token_id`` counts as one
    whether listed or not. ``generator`` must live on ``tokens.device``."""
    special_ids = sorted({*special_token_ids, mask_token_id})
    is_special = torch.zeros_like(tokens, dtype=torch.bool)
    for special_id in special_ids:  # comparisons with Python ints: nothing is copied to the device, no sync
        is_special |= tokens == special_id

    chosen = torch.rand(tokens.shape, generator=generator, device=tokens.device) < probability
    chosen &= ~is_special
    how = torch.rand(tokens.shape, generator=generator, device=tokens.device)  # which of the three corruptions
    # a random non-special token: the k-th of the vocabulary without the special ids, found by stepping k over each
    # special id at or below it, in ascending order
    replacement = torch.randint(vocab_size - len(special_ids), tokens.shape, generator=generator, device=tokens.device)
    for special_id in special_ids:
        replacement += replacement >= special_id

    inputs = torch.where(chosen & (how < MASK_FRACTION), mask_token_id, tokens)
    inputs = torch.where(chosen & (how >= MASK_FRACTION) & (how < MASK_FRACTION + RANDOM_FRACTION), replacement, inputs)
    labels = torch.where(chosen, tokens, IGNORE_INDEX)
    return inputs, labels


def check_special_tokens(
    vocab_size: int,
    mask_token_id: int | None,
    cls_token_id: int | None,
    sep_token_id: int | None,
    pad_token_id: int | None,
    mask_probability: float,
) -> None:
    """A UserError naming the first of the model's masking settings that is unusable: a special-token id that is
    not set or lies outside the vocabulary [0, vocab_size), or a mask probability outside (0, 1)."""
    ids = {"mask_token_id": mask_token_id, "cls_token_id": cls_token_id, "sep_token_id": sep_token_id,
           "pad_token_id": pad_token_id}
    rules = {name: (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size,
                    f"a token id in [0, {vocab_size}) (the model's vocabulary)")
             for name, value in ids.items()}
    rules["mask_probability"] = (0 < mask_probability < 1, "between 0 and 1, exclusive (BERT used 0.15)")
    check_ranges("model", rules, {**ids, "mask_probability": mask_probability})
