"""The generated text as it becomes final, and where a stop string ends it.

Only the newest tokens are decoded again each time, in the context of the few before them (decoding
tokens alone can drop a leading space or split a multi-byte character), so a long generation costs
linear time. Text is released only once nothing later can change it: a trailing incomplete
character, or a tail that could be the start of a stop string, is held back. When a stop string
appears, the generation ends before it: the text stops where the string starts, and only the
tokens up to the one completing it are kept. Stop strings act on committed tokens only, so the
tokens before them are exactly the target's, as without stop strings.
"""
from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"  # what decoding shows for the bytes of a character not yet complete


class Decoder(Protocol):
    """Anything that turns token ids into text (edge/textcodec.py)."""

    def decode(self, ids: list[int]) -> str:
        ...


class TextTracker:
    """Generated tokens → released text, ending at the first stop string."""

    def __init__(self, decoder: Decoder, stops: tuple[str, ...] = ()) -> None:
        self.decoder = decoder
        self.stops = tuple(s for s in stops if s)
        self.ids: list[int] = []
        self.text = ""  # the decoded text so far (cut before a stop string once one appeared)
        self._fixed = ""  # the text of ids[:_read], which later tokens cannot change
        self._prefix = 0  # ids[_prefix:_read] are decoded again as context for the newer ones
        self._read = 0
        self.released = 0  # characters of `text` handed out
        self.stopped = False  # a stop string appeared

    def add(self, tokens: list[int]) -> tuple[int, str]:
        """Append committed tokens; (how many of them to keep, text now final). Fewer than
        len(tokens) are kept when a stop string completes inside them."""
        if self.stopped:
            return 0, ""
        base = len(self.ids)
        self.ids += tokens
        text = self._decode()
        hit = self._find_stop(text)
        if hit is None:
            self.text = text
            return len(tokens), self._release(len(text) - self._holdback(text))
        start, stop = hit
        # The shortest prefix of the new tokens whose text already holds the stop string.
        keep = next((j for j in range(1, len(tokens) + 1)
                     if self.decoder.decode(self.ids[:base + j]).startswith(stop, start)), len(tokens))
        del self.ids[base + keep:]
        self.text, self.stopped = text[:start], True
        return keep, self._release(start)

    def finish(self) -> str:
        """Whatever was held back: the generation is over."""
        return self._release(len(self.text))

    def continuation(self, extra: list[int]) -> str:
        """The text `extra` tokens (not committed: an unverified tail) would add after the text so
        far, decoded in context so that separators between the two are kept."""
        if not extra:
            return ""
        context = self.decoder.decode(self.ids[self._prefix:])
        full = self.decoder.decode(self.ids[self._prefix:] + list(extra))
        return full[len(context):] if full.startswith(context) else self.decoder.decode(list(extra))

    def _decode(self) -> str:
        """The text of all ids, decoding only those after `_prefix`."""
        context = self.decoder.decode(self.ids[self._prefix:self._read])
        full = self.decoder.decode(self.ids[self._prefix:])
        if not full.startswith(context):  # a tokenizer whose decoding is not prefix-stable here
            return self.decoder.decode(self.ids)
        new = full[len(context):]
        if not new or new.endswith(REPLACEMENT):
            # No text yet, or an incomplete character: decode these tokens again next time, with the
            # same context before them (a separator belongs to the token that adds text).
            return self._fixed + new
        self._fixed += new
        self._prefix, self._read = self._read, len(self.ids)
        return self._fixed

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """(where, which) for the earliest stop string not wholly inside released text."""
        longest = max((len(s) for s in self.stops), default=0)
        begin = max(0, self.released - longest + 1)
        hits = [(i, s) for s in self.stops if (i := text.find(s, begin)) >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        """Characters at the end of `text` that may still change: an incomplete character, or the
        longest tail that is the start of a stop string."""
        incomplete = len(text) - len(text.rstrip(REPLACEMENT))
        body = text[:len(text) - incomplete]
        partial = max((k for s in self.stops for k in range(1, len(s)) if body.endswith(s[:k])), default=0)
        return incomplete + partial

    def _release(self, upto: int) -> str:
        upto = max(upto, self.released)
        out, self.released = self.text[self.released:upto], upto
        return out
