"""A sample's text while its tokens stream in, decoded incrementally (:class:`IncrementalDetokenizer`).

The bridge's OpenAI routes stream a completion's text as the engine sends its tokens. Decoding the
whole completion again for every chunk costs time quadratic in its length. The detokenizer decodes
only a window at the end instead, the way vLLM's incremental detokenizer does (``prefix_offset`` /
``read_offset``): the new tokens after a lookback (the tokens of the text given out last, which
begin where all text before them was complete), minus the text of that lookback alone. The
lookback is what makes the difference exact where a token's text depends on the one before it (a
SentencePiece decoder strips the leading space of the first token it decodes). Text that ends in
U+FFFD (a character whose bytes are split across tokens and not all here yet) is held until its
last byte arrives.

What it gives out, joined, is the tokenizer's own ``decode`` of the whole sequence (special tokens
skipped), without a character still incomplete at the end: the text of a non-streamed answer. One
exception, shared with vLLM: a SentencePiece byte-fallback decoder turns a whole run of byte tokens
into U+FFFD when the run is not valid UTF-8, so a character given out can turn into U+FFFD in the
whole decode when an invalid byte follows it in the same run (a byte-level BPE such as SmolLM2's
replaces only the invalid bytes, and the two always agree).
Where a window's text does not continue the lookback's (a decoder that rewrites across tokens), it
decodes everything once and takes what follows the text already given out.
"""

from __future__ import annotations

from typing import Any

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """The text of a token sequence that grows: :meth:`push` the new tokens, get the new text.

    ``tok`` is a Hugging Face tokenizer (``decode(ids, skip_special_tokens=True)``). The text
    given out so far is the start of the whole sequence's ``tok.decode`` (but for the byte-fallback
    case above) and never ends inside a character; :meth:`finish` gives the rest once the sequence
    is complete."""

    def __init__(self, tok: Any, skip_special_tokens: bool = True):
        self.tok = tok
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.read = 0  # the tokens up to here have given out their text
        self.lookback = 0  # where the tokens of the last text given out begin (the window's lookback)
        self.length = 0  # characters given out so far

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _new_text(self, final: bool = False) -> str:
        """The text of the tokens after ``read``: the window's text less its lookback's, or, where the
        window's text does not continue its lookback's, everything decoded once less what was given
        out. A character still incomplete makes the text end in U+FFFD; so does a run of byte tokens
        that is not valid UTF-8 yet in a SentencePiece byte-fallback decoder, which turns the
        whole run into U+FFFD until its last byte arrives (its texts are not prefixes of each other)."""
        prefix = self._decode(self.ids[self.lookback:self.read])
        text = self._decode(self.ids[self.lookback:])
        if text.startswith(prefix):
            return text[len(prefix):]
        if text.endswith(_INCOMPLETE) and not final:
            return text  # held until the run is complete
        return self._decode(self.ids)[self.length:]

    def _give(self, new: str) -> str:
        self.lookback, self.read = self.read, len(self.ids)
        self.length += len(new)
        return new

    def push(self, ids: list[int]) -> str:
        """Add the tokens ``ids``; returns the text they complete ("" while a character is incomplete)."""
        self.ids.extend(ids)
        if len(self.ids) == self.read:
            return ""
        new = self._new_text()
        if new.endswith(_INCOMPLETE):  # the last character's bytes are not all here yet
            return ""
        return self._give(new)

    def finish(self) -> str:
        """The text not given out yet, the sequence being complete: a character still incomplete at
        the end is left out, as vLLM's detokenizer leaves it out."""
        if len(self.ids) == self.read:
            return ""
        return self._give(self._new_text(final=True).rstrip(_INCOMPLETE))
