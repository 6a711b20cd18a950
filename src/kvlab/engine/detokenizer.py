"""Incremental detokenisation with stop strings: text deltas that never split a character or a stop.

Decoding only the newest ids would drop SentencePiece's leading spaces and cut multi-byte
characters in half, so each step decodes a short window (from `prefix` on) twice, with and
without the new ids, and emits the difference once it no longer ends in U+FFFD, the way
Hugging Face's TextStreamer and vLLM do.

Stop strings are matched in the text so far; text that could still turn out to be the start
of a stop string is held back until it cannot, so a streamed stop string is never half-sent.
Before `min_tokens` tokens are out no stop string ends the request (vLLM's rule).
"""

from __future__ import annotations

from typing import Optional, Sequence


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 include_stop: bool = False, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self.prefix = max(len(self.ids) - 5, 0)
        self.read = len(self.ids)
        self.text = ""  # every generated character decoded so far
        self.sent = 0  # characters of `text` already returned
        self.stop, self.include_stop = list(stop), include_stop
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.min_tokens, self.pushed = min_tokens, 0

    def push(self, token_id: int) -> tuple[str, Optional[str]]:
        """Add one generated id; return (text to send now, the stop string matched or None)."""
        self.ids.append(token_id)
        self.pushed += 1
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            start = len(self.text)
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            for stop in (self.stop if self.pushed >= self.min_tokens else ()):  # a match must end in the new characters
                at = self.text.find(stop, max(0, start - len(stop) + 1))
                if at >= 0:
                    self.text = self.text[:at + (len(stop) if self.include_stop else 0)]
                    return self.flush(), stop
        ready = len(self.text) - self.hold if self.stop else len(self.text)
        return self._take(ready), None

    def flush(self) -> str:
        """Everything not sent yet (the request is over)."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent:upto], upto
        return piece
