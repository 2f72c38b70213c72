"""TokenKinds: what a vocabulary's tokens are made of, the side of the span rule (``Spans``) that
needs the tokenizer.

Each token id gets a few flags, read once from its text (the tokenizer's decoding of the token
alone):

- ``BREAK_BEFORE``: a word cannot go on into this token: its text is empty or begins with
  whitespace or a character that is neither a letter nor a digit (" pass", "(", ".");
- ``BREAK_AFTER``: a word cannot go on past it: its text ends in such a character;
- ``DIGITS``: its text, whitespace aside, is decimal digits only ("3", " 12");
- ``ENDS_SENTENCE``: its text, trailing whitespace aside, ends in ".", "!" or "?", or it
  holds a newline.

A token that decodes to U+FFFD (part of a character that takes several byte tokens) counts as
a letter, so a character split over tokens is not split into spans. ``patch`` builds the kinds
of the tokenizer it is given once per tokenizer (``TokenKinds.of``, kept while the tokenizer
lives) and hands them to the scorers with the model's other parts (``ModelParts.token_kinds``).
"""
from __future__ import annotations

import weakref

import torch

BREAK_BEFORE, BREAK_AFTER, DIGITS, ENDS_SENTENCE = 1, 2, 4, 8
SENTENCE_ENDS = (".", "!", "?")
_BY_TOKENIZER: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _wordy(char: str) -> bool:
    return char.isalnum() or char == "\ufffd"


def flags_of(text: str) -> int:
    """The flags of one token's text (above)."""
    flags = 0
    if not text or not _wordy(text[0]):
        flags |= BREAK_BEFORE
    if not text or not _wordy(text[-1]):
        flags |= BREAK_AFTER
    if text.strip() and text.strip().isdecimal():
        flags |= DIGITS
    if text.rstrip().endswith(SENTENCE_ENDS) or "\n" in text:
        flags |= ENDS_SENTENCE
    return flags


class TokenKinds:
    """``flags`` [V] uint8, one entry per token id of a vocabulary (the flags above). An id
    past the table (a model whose embedding is larger than its tokenizer) breaks everywhere."""

    def __init__(self, flags: torch.Tensor):
        if not isinstance(flags, torch.Tensor) or flags.dim() != 1:
            raise TypeError(f"TokenKinds flags must be a 1-D tensor (one entry per token id), got {flags!r}")
        self.flags = flags.to(torch.uint8)
        self._on: dict = {}   # the table on each device it was asked on

    @classmethod
    def from_texts(cls, texts) -> "TokenKinds":
        """The kinds of a vocabulary whose token i has text ``texts[i]``."""
        return cls(torch.tensor([flags_of(t) for t in texts], dtype=torch.uint8))

    @classmethod
    def of(cls, tokenizer) -> "TokenKinds":
        """The kinds of ``tokenizer``'s vocabulary (each token decoded alone), built once per
        tokenizer."""
        try:
            known = _BY_TOKENIZER.get(tokenizer)
        except TypeError:   # a tokenizer that cannot be weakly referenced: built every time
            known = None
        if known is not None:
            return known
        kinds = cls.from_texts(tokenizer.batch_decode([[i] for i in range(len(tokenizer))]))
        try:
            _BY_TOKENIZER[tokenizer] = kinds
        except TypeError:
            pass
        return kinds

    def __len__(self) -> int:
        return self.flags.shape[0]

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The flags of ``ids`` (any shape, int64; a negative or too large id: every break)."""
        table = self._on.get(ids.device)
        if table is None:
            table = self._on[ids.device] = self.flags.to(ids.device)
        inside = (ids >= 0) & (ids < len(self))
        every = BREAK_BEFORE | BREAK_AFTER
        return torch.where(inside, table[ids.clamp(0, len(self) - 1)], torch.full_like(table[:1], every))

    def __repr__(self) -> str:
        return f"TokenKinds({len(self)} tokens)"
