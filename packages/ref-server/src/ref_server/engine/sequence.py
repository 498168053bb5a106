"""One request inside an engine: its tokens, its pages, how far it has been computed."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from ref_server.model.sampling import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # eos or a stop token
    LENGTH = "length"  # max_tokens
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"seq-{next(_ids)}")
    tokens: list[int] = field(init=False)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    num_cached: int = 0  # prompt tokens found in the prefix cache at admission
    page_hashes: list[bytes] = field(default_factory=list)  # chained, of full pages so far
    num_registered: int = 0  # leading pages already offered to the prefix cache
    eos_ids: frozenset[int] = frozenset()  # the model's end-of-sequence ids
    hold_pages: bool = False  # keep the pages after finishing, until released (prefill role)
    cache_salt: bytes = b""  # seeds the page hashes: prefix-cache hits only within one salt
    pending: bool = False  # one more token, sampled on the device, not read back yet (`__len__`)
    num_new: int = 0  # tokens the latest step gave it: 1, or up to k + 1 when speculating
    # speculative decoding: the MTP module's drafts, which the next step verifies, and the q
    # each was drawn from (None: greedy)
    drafts: list[int] = field(default_factory=list)
    draft_probs: list = field(default_factory=list)
    # prefilled elsewhere and not drafted for yet: the module drafts from the prompt's last
    # hidden state (kept in that token's page) before a step verifies this sequence
    awaits_draft: bool = False

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("a sequence needs at least one prompt token")
        self.tokens = list(self.prompt)

    def __len__(self) -> int:
        """Its tokens, the pending one included: `tokens` holds those the host has read."""
        return len(self.tokens) + self.pending

    @property
    def completion(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def num_generated(self) -> int:
        return len(self) - len(self.prompt)

    @property
    def reached_max_tokens(self) -> bool:
        """Every token it may generate is sampled (the last may still be pending)."""
        return self.num_generated >= self.params.max_tokens

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose KV is not in the cache yet: 1 while decoding (the newest token), more
        while (re)filling, e.g. the prompt, or everything after a preemption."""
        return len(self) - self.num_computed

    def num_blocks(self, block_size: int) -> int:
        return -(-len(self) // block_size)

    def block_tokens(self, index: int, block_size: int) -> list[int]:
        return self.tokens[index * block_size : (index + 1) * block_size]
