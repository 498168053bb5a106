"""Which sequences run in the next step, and how many of their tokens. No torch.

Continuous batching: sequences join and leave between steps. A step is either a prefill step
(chunks of sequences that have more than one token to compute, within a token budget; a long
prompt is spread over several steps: chunked prefill) or a decode step (one token for every
running sequence, with its drafts when speculating). Prefill goes first. When a decode step
runs out of pages, the most recently admitted sequence is preempted: its pages are freed and
it waits to be recomputed.

A step's outcome comes in two halves: `computed` (its chunks are in the cache, the sequences
that sample await a `pending` token) and `received` (the sampled tokens, read back; finishes
are decided here). `advance` is both at once. An engine that overlaps its steps calls
`computed` as it queues a step on the device and `received` a step later, so a sequence that
ends is known one step late: a step queued meanwhile still has its row, which is dropped.
`accepted` is the outcome of a speculative step, whose sequences may each take several tokens
and give back the KV of rejected drafts; `draft_room` gives each the pages of its next drafts.

A prefill instance keeps a finished sequence's pages (`held`) until a decode instance has
copied them; a decode instance reserves pages for a sequence prefilled elsewhere (`reserved`)
while its KV arrives, then starts it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ref_server.engine.block_manager import BlockManager
from ref_server.engine.sequence import FinishReason, Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 64
    max_num_seqs: int = 256  # running at once
    max_num_batched_tokens: int = 8192  # tokens per step
    max_model_len: int = 4096  # prompt + completion
    max_waiting: int = 1024  # queued requests beyond which add() refuses

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len > self.num_blocks * self.block_size:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the cache "
                f"({self.num_blocks} blocks x {self.block_size} tokens)"
            )


class QueueFull(RuntimeError):
    """No room for a request now: more waiting than max_waiting, or no pages to reserve."""


@dataclass
class Step:
    """What the model runs: each sequence with the number of its tokens to compute now."""

    seqs: list[Sequence]
    chunks: list[int]
    is_prefill: bool


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[str, Sequence] = {}  # finished, pages kept for a transfer
        self.reserved: dict[str, Sequence] = {}  # pages allocated, KV arriving from elsewhere
        self.num_preemptions = 0

    def check_length(self, seq: Sequence) -> None:
        total = len(seq.prompt) + seq.params.max_tokens
        if total > self.config.max_model_len:
            raise ValueError(
                f"prompt ({len(seq.prompt)} tokens) + max_tokens ({seq.params.max_tokens}) exceeds "
                f"the context limit of {self.config.max_model_len}"
            )

    def add(self, seq: Sequence) -> None:
        self.check_length(seq)
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are waiting already")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def knows(self, request_id: str) -> bool:
        """Whether a sequence of this id holds or waits for pages here."""
        return (
            request_id in self.held
            or request_id in self.reserved
            or any(s.request_id == request_id for s in (*self.running, *self.waiting))
        )

    def abort(self, request_id: str) -> Sequence | None:
        """End a sequence now, wherever it is, and free its pages; None if it is unknown."""
        for table in (self.held, self.reserved):
            if request_id in table:
                seq = table.pop(request_id)
                self.blocks.deallocate(seq)
                seq.status, seq.finish_reason = Status.FINISHED, FinishReason.ABORT
                return seq
        for queue in (self.running, self.waiting):
            for seq in list(queue):
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.finish(seq, FinishReason.ABORT)
                    return seq
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        seq.pending = False  # aborted with a step in flight: its token is dropped
        if seq in self.running:
            self.running.remove(seq)
        if seq.hold_pages and reason is not FinishReason.ABORT:
            # a step queued before its last token was read may have taken a page for the next
            self.blocks.trim(seq, seq.num_computed)
            self.held[seq.request_id] = seq
        else:
            self.blocks.deallocate(seq)

    def release(self, request_id: str) -> bool:
        """Free a held sequence's pages; False if none is held under that id."""
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.blocks.deallocate(seq)
        return seq is not None

    def reserve(self, seq: Sequence, computed: int, shareable: int | None = None) -> list[int]:
        """Pages for a sequence whose first `computed` tokens' KV comes from elsewhere (decode
        role), sharing cached prefix pages among those of its first `shareable` tokens (None:
        all but its newest); returns the indices of its pages the caller must fill before
        `start`. QueueFull when its pages are not free or the batch is full."""
        self.check_length(seq)
        if seq.request_id in self.reserved:
            raise ValueError(f"{seq.request_id} is reserved already")
        busy = len(self.running) + len(self.reserved)
        if busy >= self.config.max_num_seqs:
            raise QueueFull(f"{busy} sequences run or are being filled already")
        if not self.blocks.can_allocate(seq, shareable):
            raise QueueFull(
                f"not enough free KV pages for {seq.num_blocks(self.config.block_size)}"
            )
        self.blocks.allocate(seq, shareable)
        self.reserved[seq.request_id] = seq
        first = seq.num_cached // self.config.block_size
        return list(range(first, -(-computed // self.config.block_size)))

    def start(self, request_id: str, computed: int) -> Sequence:
        """A reserved sequence whose pages are filled joins the running batch; its pages
        become findable in the prefix cache only now."""
        seq = self.reserved.pop(request_id)
        seq.num_computed = computed
        self.blocks.register_computed(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        return seq

    def schedule(self) -> Step | None:
        return self._prefill() or self._decode()

    def _prefill(self) -> Step | None:
        budget = self.config.max_num_batched_tokens
        seqs, chunks = [], []
        for seq in self.running:
            if seq.num_uncomputed > 1 and budget > 0:
                seqs.append(seq)
                chunks.append(min(seq.num_uncomputed, budget))
                budget -= chunks[-1]
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.blocks.can_allocate(seq):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            chunks.append(min(seq.num_uncomputed, budget))
            budget -= chunks[-1]
        return Step(seqs, chunks, is_prefill=True) if seqs else None

    def short_of_pages(self) -> bool:
        """Whether a decode step now would preempt: its sequences need more pages than are free."""
        if self.blocks.num_free >= len(self.running):  # each needs one at most
            return False
        needed = sum(self._decodes(s) and self.blocks.needs_page(s) for s in self.running)
        return needed > self.blocks.num_free

    @staticmethod
    def _decodes(seq: Sequence) -> bool:
        """Whether a decode step takes this running sequence: not one preempted for an earlier
        one, nor one whose last token is sampled already (pending: it ends when read), nor one
        that awaits its first draft."""
        return seq.status is Status.RUNNING and not seq.reached_max_tokens and not seq.awaits_draft

    def _decode(self) -> Step | None:
        seqs = []
        for seq in list(self.running):
            if not self._decodes(seq):
                continue
            while not self.blocks.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.append(seq)
                seqs.append(seq)
        chunks = [1 + len(seq.drafts) for seq in seqs]  # the drafts' pages are taken already
        return Step(seqs, chunks, is_prefill=False) if seqs else None

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.blocks.deallocate(seq)
        seq.drafts, seq.draft_probs = [], []
        seq.awaits_draft = False  # its prefill here recomputes what the module reads
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def advance(self, step: Step, sampled: list[int | None]) -> list[Sequence]:
        """After the model ran `step`: `computed`, then `received` with its sampled tokens (None
        for chunks that end inside a prompt); returns the sequences that got one."""
        self.computed(step)
        return self.received(step, sampled)

    def computed(self, step: Step) -> None:
        """`step` ran, or is queued on the device: its chunks count as computed, and each
        sequence whose chunk reaches its last token awaits the token the step samples. A
        sequence that ended meanwhile stays as it ended (the step's row for it is dropped)."""
        for seq, chunk in zip(step.seqs, step.chunks, strict=True):
            if seq.status is Status.FINISHED:
                continue
            seq.num_computed += chunk
            self.blocks.register_computed(seq)
            seq.pending = seq.num_computed == len(seq)

    def received(self, step: Step, sampled: list[int | None]) -> list[Sequence]:
        """The tokens `step` sampled, read back (None for chunks that end inside a prompt): each
        sequence still running takes its pending one and finishes at eos, a stop token or
        max_tokens. Returns the sequences that got a token."""
        updated = []
        for seq, token in zip(step.seqs, sampled, strict=True):
            if token is None or seq.status is Status.FINISHED:  # aborted after it was queued
                continue
            seq.pending = False
            if reason := self._take(seq, [token]):
                self.finish(seq, reason)
            updated.append(seq)
        return updated

    @staticmethod
    def _take(seq: Sequence, tokens: list[int]) -> FinishReason | None:
        """seq's new tokens, up to and including one that finishes it (eos, a stop token,
        max_tokens): why it finishes, None if it goes on."""
        seq.num_new = 0
        for token in tokens:
            seq.tokens.append(token)
            seq.num_new += 1
            if token in seq.eos_ids or token in seq.params.stop_token_ids:
                return FinishReason.STOP
            if seq.reached_max_tokens:
                return FinishReason.LENGTH
        return None

    def accepted(self, step: Step, results: list[list[int] | None]) -> list[Sequence]:
        """After a speculative step: results, each sequence's accepted drafts and the token
        after them (None for chunks that end inside a prompt). Each takes the tokens as
        `received` does and keeps the KV of its chunk but its rejected drafts' (rows past its
        tokens, written over later; their pages go back with `draft_room`). Returns the
        sequences that got tokens."""
        updated = []
        for seq, chunk, tokens in zip(step.seqs, step.chunks, results, strict=True):
            seq.drafts, seq.draft_probs = [], []
            if tokens is None:
                seq.num_computed += chunk
                self.blocks.register_computed(seq)
                continue
            reason = self._take(seq, tokens)
            # the step computed the accepted drafts' KV (and the rejected ones', past them): all
            # but the newest token's, also when a token inside the run ended the sequence
            seq.num_computed = len(seq) - 1
            self.blocks.register_computed(seq)
            if reason:
                self.finish(seq, reason)
            updated.append(seq)
        return updated

    def draft_room(self, seq: Sequence, wanted: int) -> int:
        """Pages for a running sequence's tokens and the next round's drafts, up to `wanted`
        of them, as far as pages are free and max_tokens leaves room; those past are freed.
        Returns the drafts there is room for."""
        wanted = min(wanted, seq.params.max_tokens - seq.num_generated - 1)
        for count in range(wanted, 0, -1):
            if self.blocks.resize(seq, len(seq) + count):
                return count
        self.blocks.trim(seq, len(seq))
        return 0
