"""Token ids whose meaning the data and the models share."""

from __future__ import annotations

from dataclasses import dataclass

IGNORE_INDEX = -100  # a target id the loss skips (padding); torch's cross-entropy default


@dataclass(frozen=True)
class SpecialTokens:
    """The ids a masked language model adds to its vocabulary: [MASK] replaces a token to predict, [CLS] opens a
    sequence, [SEP] ends one, [PAD] fills a sequence up to the batch's length."""

    mask: int
    cls: int
    sep: int
    pad: int

    @property
    def ids(self) -> tuple[int, ...]:
        return (self.mask, self.cls, self.sep, self.pad)


# The embedded byte-level corpus's ids are the bytes 0..255; a BERT on it reserves the four ids after them.
BYTE_SPECIAL_TOKENS = SpecialTokens(mask=256, cls=257, sep=258, pad=259)
BYTE_BERT_VOCAB_SIZE = 260
