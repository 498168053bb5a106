"""`State`: what one microbatch's ops hand each other, written once per key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class StateError(KeyError):
    """A key written twice, or read before it was written."""

    def __str__(self) -> str:
        return str(self.args[0])


class State:
    """Attribute-style storage that refuses to overwrite: `state.x = 1` twice raises;
    `state.pop("x")` takes the value out, after which `x` may be written again.

    `num_tokens` is the microbatch's size (0 for a rank that only serves its peers' experts).
    Reading a key written by a communication op first waits for that op (see `run`).
    """

    def __init__(self, microbatch: int = 0, num_tokens: int | None = None, **values: Any) -> None:
        object.__setattr__(self, "_values", {})
        object.__setattr__(self, "_waits", {})  # key -> the callable that makes it ready
        object.__setattr__(self, "microbatch", microbatch)
        object.__setattr__(self, "num_tokens", num_tokens)
        for key, value in values.items():
            setattr(self, key, value)

    def __setattr__(self, key: str, value: Any) -> None:
        if key in self._values:
            raise StateError(
                f"microbatch {self.microbatch}: state key {key!r} is set already; pop it first"
            )
        self._values[key] = value

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):
            raise AttributeError(key)
        self._ready(key)
        return self._values[key]

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def pop(self, key: str, *default: Any) -> Any:
        if key not in self._values and default:
            return default[0]
        self._ready(key)
        return self._values.pop(key)

    def keys(self) -> list[str]:
        return list(self._values)

    def _ready(self, key: str) -> None:
        if key not in self._values:
            raise StateError(
                f"microbatch {self.microbatch}: no state key {key!r} (keys: "
                f"{', '.join(self._values) or 'none'})"
            )
        wait = self._waits.get(key)
        if wait is not None:
            wait()

    def _wait_for(self, keys: list[str], wait: Callable[[], None]) -> None:
        """Reading any of `keys` first calls `wait` (once for all of them)."""
        for key in keys:
            self._waits[key] = wait

    def _pending(self) -> list[Callable[[], None]]:
        return list({id(w): w for w in self._waits.values()}.values())

    def _done_waiting(self, wait: Callable[[], None]) -> None:
        for key in [k for k, w in self._waits.items() if w is wait]:
            del self._waits[key]

    def __repr__(self) -> str:
        return f"State(microbatch={self.microbatch}, keys={self.keys()})"
