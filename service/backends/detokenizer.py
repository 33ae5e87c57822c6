"""Incremental detokenization: turn a growing list of token ids into text deltas.

A byte-level BPE token may end in the middle of a multi-byte UTF-8 character; decoding it alone
yields U+FFFD. The decoder keeps a short window of recent tokens and only releases text once the
window decodes without a trailing replacement character, so a delta never splits a character.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = 0  # tokens before this offset have been released as text

    def _decode(self, ids: list[int]) -> str:
        text = self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Release whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
