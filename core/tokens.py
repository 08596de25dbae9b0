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


# Byte-level text (the embedded corpus, cohort prepare without --tokenizer): token id = byte value, 0..255
BYTE_VOCAB_SIZE = 256
# A BERT on bytes reserves the four ids after them.
BYTE_SPECIAL_TOKENS = SpecialTokens(mask=BYTE_VOCAB_SIZE, cls=BYTE_VOCAB_SIZE + 1, sep=BYTE_VOCAB_SIZE + 2,
                                    pad=BYTE_VOCAB_SIZE + 3)
BYTE_BERT_VOCAB_SIZE = BYTE_VOCAB_SIZE + len(BYTE_SPECIAL_TOKENS.ids)
