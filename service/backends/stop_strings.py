"""Cut generated text at the first stop string, holding back text that might start one."""

from __future__ import annotations


class StopStringBuffer:
    """Accumulates a choice's text and decides how much of it may be sent.

    ``push`` returns the text that is safe to release and whether a stop string was found. Text
    that could be the beginning of a stop string stays held until it is decided; the stop string
    itself is never released. ``matched`` is the stop string that was found (None before).
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._text = ""
        self._sent = 0
        self.stopped = False
        self.matched: str | None = None

    @property
    def text(self) -> str:
        """Text released so far."""
        return self._text[: self._sent]

    def _held_suffix(self) -> int:
        """Length of the longest suffix of the unsent text that is a proper prefix of a stop string."""
        longest = 0
        pending = self._text[self._sent :]
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self._text += text
        if not self._stops:
            out = self._text[self._sent :]
            self._sent = len(self._text)
            return out, False
        found = [(p, s) for s in self._stops if (p := self._text.find(s, self._sent)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda item: item[0])
            out = self._text[self._sent : cut]
            self._text = self._text[:cut]
            self._sent = cut
            self.stopped = True
            return out, True
        safe = len(self._text) - self._held_suffix()
        out = self._text[self._sent : safe]
        self._sent = max(self._sent, safe)
        return out, False

    def flush(self) -> str:
        """Release held text (the choice ended without completing a stop string)."""
        if self.stopped:
            return ""
        out = self._text[self._sent :]
        self._sent = len(self._text)
        return out
