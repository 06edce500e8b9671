"""A request's new tokens as text: decoded as they come, cut at its first stop string, and held back where a stop
string may be starting or a character is split across tokens (so a stream never sends what it must take back)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from eval.answers import cut_at_stop


class TextStream:
    """The text of one request's tokens (``eos_ids`` left out of the text, special tokens skipped)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str], eos_ids: Iterable[int]):
        self.tokenizer, self.stop, self.eos = tokenizer, tuple(stop), frozenset(eos_ids)
        self.tokens: list[int] = []  # every new token, EOS included (the usage counts them)
        self.sent = 0  # characters of the text already handed out
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def text(self) -> str:
        """The whole text so far, cut before its first stop string."""
        kept = [t for t in self.tokens if t not in self.eos]
        return cut_at_stop(self.tokenizer.decode(kept, skip_special_tokens=True), self.stop)

    def raw(self) -> str:
        """The text with special tokens kept (a tool call's markers may be special tokens), EOS left out."""
        return self.tokenizer.decode([t for t in self.tokens if t not in self.eos], skip_special_tokens=False)

    def add(self, tokens: Sequence[int]) -> str:
        """Take new tokens; the text that can be sent now (maybe empty)."""
        self.tokens.extend(tokens)
        text = self.text()
        ready = text[:max(self.sent, len(text) - self._hold)]
        if ready.endswith("\ufffd"):  # a character split across tokens: wait for the rest of it
            return ""
        out, self.sent = ready[self.sent:], len(ready)
        return out

    def finish(self) -> str:
        """The rest of the text once the request has ended."""
        text = self.text()
        out, self.sent = text[self.sent:], len(text)
        return out
