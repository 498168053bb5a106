"""The text of a streamed completion, safe to show as it grows.

Token ids do not map to characters one to one: a character's UTF-8 bytes may span several
tokens, and a stop string may span several chunks. Streamed text must never show a broken
character, and must never show a stop string (OpenAI semantics: output ends just before it), so
`TextStream` decodes through an incremental decoder and holds back text that could still be the
start of a stop string until it is clear.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing ref_server.model imports torch
    from ref_server.model.tokenizer import IncrementalDecoder


class TextStream:
    """`add` the ids of each step, then `finish`; each returns the new text that is safe to show.

    Once the text contains a stop string, `stopped` is True and the text before the earliest
    stop string has been returned; nothing after it ever is. Each call looks at its new text and
    at most the longest stop string's length of held-back text, so a completion costs linear time.
    """

    def __init__(self, decoder: IncrementalDecoder, stops: list[str]) -> None:
        self._decoder = decoder
        self._stops = [stop for stop in stops if stop]
        self._held = ""
        self._shown: list[str] = []
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return "".join(self._shown)

    def add(self, ids: list[int]) -> str:
        return "" if self.stopped else self._show(self._decoder.add(ids), final=False)

    def finish(self) -> str:
        """The held-back text and the decoder's rest, at the end of a request that did not stop."""
        return "" if self.stopped else self._show(self._decoder.flush(), final=True)

    def _show(self, new: str, final: bool) -> str:
        window = self._held + new
        found = [i for i in (window.find(stop) for stop in self._stops) if i >= 0]
        if found:
            self.stopped = True
            keep = len(window) - min(found)
        elif final:
            keep = 0
        else:
            keep = self._partial_stop(window)
        shown, self._held = window[: len(window) - keep], window[len(window) - keep :]
        self._shown.append(shown)
        return shown

    def _partial_stop(self, window: str) -> int:
        """The length of the longest end of `window` that begins a stop string."""
        longest = max((len(stop) for stop in self._stops), default=1)
        for length in range(min(len(window), longest - 1), 0, -1):
            if any(stop.startswith(window[-length:]) for stop in self._stops):
                return length
        return 0
