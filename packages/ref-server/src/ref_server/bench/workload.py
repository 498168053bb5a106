"""What a benchmark sends: each request's prompt (token ids) and how many tokens it asks for.

Lengths come from two `LengthSpec`s (a fixed count `128`, or `64..512`: uniform, both ends
included) or from a JSONL file of `{"prompt_tokens": n, "output_tokens": m}` lines, taken in
order and repeated from the top when more requests are asked for than the file has lines.
Prompt tokens are drawn uniformly from [0, vocab_size). With a shared-prefix ratio r, the
first floor(r * n) tokens of every n-token prompt are the same (one prefix for the whole
workload), so a server with a prefix cache finds them there.

Everything follows from the seed. The lengths are the same for every run of a sweep; the
prompts' own tokens are drawn anew for each run (`run`), so a later run finds only the shared
prefix in the server's cache, not an earlier run's prompts. The same seed against the same
server again does find them: change the seed between invocations.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LENGTH = re.compile(r"\s*(\d+)\s*(?:\.\.\s*(\d+)\s*)?")


@dataclass(frozen=True)
class LengthSpec:
    """Token counts from low to high, both included (low == high: a fixed count)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        """`N` or `LO..HI`, whole numbers > 0; ValueError naming the text otherwise."""
        match = LENGTH.fullmatch(text)
        if match is None:
            raise ValueError(f"expected N or LO..HI (whole numbers), got {text!r}")
        low = int(match[1])
        high = int(match[2]) if match[2] is not None else low
        if low <= 0 or high < low:
            raise ValueError(f"expected 0 < LO <= HI, got {text!r}")
        return cls(low, high)

    def draw(self, rng: np.random.Generator, count: int) -> list[int]:
        return rng.integers(self.low, self.high + 1, size=count).tolist()

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}..{self.high}"


@dataclass(frozen=True)
class LengthFile:
    path: str
    rows: tuple[tuple[int, int], ...]  # (prompt tokens, output tokens) of each line


def read_length_file(path: str | Path) -> LengthFile:
    """The (prompt_tokens, output_tokens) of each non-blank line of a JSONL file; ValueError
    or OSError naming the file (and the line) when it is missing, empty or malformed."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(f"length file not found: {path}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} line {number} is not JSON: {error.msg}") from None
        keys = ("prompt_tokens", "output_tokens")
        counts = [entry.get(key) if isinstance(entry, dict) else None for key in keys]
        if not all(type(c) is int and c > 0 for c in counts):
            raise ValueError(
                f'{path} line {number}: expected {{"prompt_tokens": n, "output_tokens": m}} '
                f"with whole numbers > 0, got {line.strip()}"
            )
        rows.append((counts[0], counts[1]))
    if not rows:
        raise ValueError(f"{path} holds no lengths")
    return LengthFile(str(path), tuple(rows))


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]  # token ids
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    """The requests of a benchmark; a `length_file` replaces both specs."""

    prompt_tokens: LengthSpec = LengthSpec(128, 128)
    output_tokens: LengthSpec = LengthSpec(32, 32)
    length_file: LengthFile | None = None
    shared_prefix: float = 0.0  # share of each prompt that is the common prefix, 0..1
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.shared_prefix <= 1.0:  # NaN fails too
            raise ValueError(f"shared prefix ratio must be in 0..1, got {self.shared_prefix}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in 0..2**63-1, got {self.seed}")

    def lengths(self, count: int) -> list[tuple[int, int]]:
        """(prompt tokens, output tokens) of each of `count` requests, the same for every run."""
        if self.length_file is not None:
            rows = self.length_file.rows
            return [rows[i % len(rows)] for i in range(count)]
        rng = np.random.default_rng([self.seed, 0])
        prompts = self.prompt_tokens.draw(rng, count)
        return list(zip(prompts, self.output_tokens.draw(rng, count), strict=True))

    def requests(self, count: int, vocab_size: int, run: int = 0) -> list[BenchRequest]:
        """`count` requests whose tokens lie in [0, vocab_size), their own for each `run`."""
        lengths = self.lengths(count)
        longest = max(prompt for prompt, _ in lengths)
        prefix = np.random.default_rng([self.seed, 1]).integers(0, vocab_size, size=longest)
        rng = np.random.default_rng([self.seed, 2, run])
        requests = []
        for prompt_tokens, output_tokens in lengths:
            shared = int(self.shared_prefix * prompt_tokens)
            own = rng.integers(0, vocab_size, size=prompt_tokens - shared)
            prompt = np.concatenate([prefix[:shared], own]).tolist()
            requests.append(BenchRequest(prompt, output_tokens))
        return requests

    def check_context(self, count: int, max_model_len: int) -> None:
        """ValueError naming the first request whose prompt and output exceed the context."""
        for i, (prompt, output) in enumerate(self.lengths(count)):
            if prompt + output > max_model_len:
                raise ValueError(
                    f"request {i} asks {prompt} prompt + {output} output tokens, over the "
                    f"server's context limit of {max_model_len}"
                )

    def describe(self) -> dict:
        """The workload as the JSON report states it."""
        if self.length_file is not None:
            lengths = {"length_file": self.length_file.path}
            lengths["length_file_lines"] = len(self.length_file.rows)
        else:
            lengths = {"prompt_tokens": str(self.prompt_tokens)}
            lengths["output_tokens"] = str(self.output_tokens)
        return {**lengths, "shared_prefix": self.shared_prefix, "seed": self.seed}
