"""One engine: a scheduler, a block manager and a model runner, stepped together.

engine = Engine(model, SchedulerConfig(num_blocks=256))
engine.add(prompt_ids, SamplingParams(max_tokens=32))
while engine.has_work():
    for seq in engine.step(): ...   # each got a new token (seq.finish_reason when done)
"""

from __future__ import annotations

from collections import deque

import torch

from ref_server.engine.model_runner import ModelRunner
from ref_server.engine.scheduler import QueueFull, Scheduler, SchedulerConfig
from ref_server.engine.sequence import FinishReason, Sequence, Status
from ref_server.model.sampling import SamplingParams


class Engine:
    def __init__(self, model, config: SchedulerConfig) -> None:
        self.model = model
        self.scheduler = Scheduler(config)
        self.runner = ModelRunner(model, config)
        args = model.args
        self.eos_ids = frozenset({args.eos_token_id} - {None})
        self.idle = False  # the last step found nothing it could run
        self.prefilled: deque[tuple[Sequence, list]] = deque()  # waiting for free pages

    def _sequence(self, prompt, params, request_id, hold_pages=False) -> Sequence:
        vocab = self.model.args.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        seq = Sequence(prompt, params, eos_ids=self.eos_ids, hold_pages=hold_pages)
        if request_id is not None:
            seq.request_id = request_id
        return seq

    def add(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        hold_pages: bool = False,
    ) -> Sequence:
        """Queue a request. hold_pages: keep its KV pages after it finishes, for `pages` and
        `release` (a prefill instance hands them to a decode instance)."""
        seq = self._sequence(prompt, params, request_id, hold_pages)
        self.scheduler.add(seq)
        return seq

    def held_blocks(self, request_id: str) -> list[int]:
        """The cache blocks of a held sequence's computed pages, in order (KeyError if none)."""
        seq = self.scheduler.held[request_id]
        return seq.block_table[: -(-seq.num_computed // self.scheduler.config.block_size)]

    def pages(self, request_id: str) -> list[torch.Tensor]:
        """A held sequence's computed pages, each `[layers, page_size, 576]` (CPU)."""
        return [self.runner.read_page(block) for block in self.held_blocks(request_id)]

    def release(self, request_id: str) -> bool:
        return self.scheduler.release(request_id)

    def add_prefilled(
        self, prompt: list[int], first_token: int, params: SamplingParams, request_id: str, pages
    ) -> Sequence:
        """Continue a request prefilled elsewhere: its prompt's KV comes as `pages` (a list of
        `[layers, page_size, 576]`), its first token is sampled already. It joins when pages are
        free (in arrival order); pages found in this instance's prefix cache are not written."""
        seq = self._sequence(prompt, params, request_id)
        seq.tokens.append(first_token)
        self.scheduler.check_length(seq)
        if len(self.prefilled) >= self.scheduler.config.max_waiting:
            raise QueueFull(f"{len(self.prefilled)} prefilled requests wait for KV pages already")
        self.prefilled.append((seq, pages))
        self._admit_prefilled()
        return seq

    def _admit_prefilled(self) -> None:
        while self.prefilled and self.scheduler.blocks.can_allocate(self.prefilled[0][0]):
            seq, pages = self.prefilled.popleft()
            for index in self.scheduler.add_computed(seq, len(seq.prompt)):
                self.runner.write_page(seq.block_table[index], pages[index])

    def abort(self, request_id: str) -> Sequence | None:
        for seq, pages in self.prefilled:
            if seq.request_id == request_id:
                self.prefilled.remove((seq, pages))
                seq.status, seq.finish_reason = Status.FINISHED, FinishReason.ABORT
                return seq
        return self.scheduler.abort(request_id)

    def queued_prefill_flops(self) -> float:
        """The prefill work this engine has yet to run: waiting prompts and unfinished chunks."""
        scheduler, args = self.scheduler, self.model.args
        queued = [*scheduler.waiting, *(s for s in scheduler.running if s.num_uncomputed > 1)]
        return sum(args.prefill_flops(s.num_uncomputed, s.num_computed) for s in queued)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.prefilled)

    def step(self) -> list[Sequence]:
        """Schedule, run the model, advance: the sequences that got a token this step."""
        self._admit_prefilled()
        step = self.scheduler.schedule()
        self.idle = step is None
        if step is None:
            if self.model.expert_parallel:  # the peers' MoE layers exchange with this rank anyway
                self.runner.idle()
            blocked = self.scheduler.held or self.prefilled
            if self.has_work() and not blocked:  # add() admits what fits an empty cache
                raise RuntimeError("the scheduler found nothing to run while requests wait")
            return []  # waiting for held pages to be released
        return self.scheduler.advance(step, self.runner.run(step))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion (tests and offline use)."""
        seqs = [self.add(p, params) for p in prompts]
        while self.has_work():
            self.step()
        return [seq.completion for seq in seqs]
