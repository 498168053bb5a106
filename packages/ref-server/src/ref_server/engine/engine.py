"""One engine: a scheduler, a block manager and a model runner, stepped together.

engine = Engine(model, SchedulerConfig(num_blocks=256))
engine.add(prompt_ids, SamplingParams(max_tokens=32))
while engine.has_work():
    for seq in engine.step(): ...   # each got a new token (seq.finish_reason when done)

With overlapped steps (`overlap_steps="on"`), each step is queued on the device before the
previous step's tokens are read, so the host's part of a step (schedule, prepare, read,
advance) runs while the device computes. A step takes the tokens the host has not read yet
from the device; `step` returns the sequences that got the previous step's tokens. A sequence
that ends at eos or a stop token is known one step late: the step queued meanwhile computes a
row for it that is dropped, and its pages are reused once that step is done. One that ends at
max_tokens is known ahead and not scheduled again.

With speculative decoding (`draft_tokens` k > 0, a model with its MTP module), each step
verifies the drafts of every decoding sequence (`ModelRunner.verify`), the sequences take their
accepted drafts and one more token (a stop or max_tokens inside the run ends it there), the
pages that hold only rejected drafts go back, and the module drafts the next round's tokens
(`ModelRunner.draft`); `step` returns the sequences that got tokens (`seq.num_new` of them).
Between a prefill instance and a decode instance, the prompt's last hidden state moves with
the pages: the prefill instance's module reads the prompt (its held pages get the module's
rows) and keeps that hidden state in the last token's page; a sequence the decode instance
starts awaits its first draft (`seq.awaits_draft`), which the next step's module makes from
it, and is verified from the step after.
"""

from __future__ import annotations

import torch

from ref_server.engine.model_runner import LaunchedStep, ModelRunner
from ref_server.engine.scheduler import Scheduler, SchedulerConfig, Step
from ref_server.engine.sequence import Sequence, Status
from ref_server.model.expert_rebalance import Moved
from ref_server.model.sampling import SamplingParams
from ref_server.model.speculative import SpeculativeStats, check_draft_tokens

OVERLAP_STEPS_MODES = ("auto", "on", "off")


def overlap_refusal(model, eplb) -> str | None:
    """Why an engine of `model` (balancing its experts with `eplb`) cannot overlap its steps;
    None: it can."""
    if model.expert_parallel:
        return "not with expert parallelism: the ranks agree on each step, after the last one's end"
    if eplb:
        return "not with expert balancing: it moves experts after each step, from the step's loads"
    return None


def speculation_refusal(model, overlap_steps: str) -> str | None:
    """Why an engine of `model` cannot decode speculatively; None: it can."""
    if model.mtp is None:
        return "the model has no MTP module (num_nextn_predict_layers 0)"
    if overlap_steps == "on":
        return "not with overlapped steps: a round's drafts come from its verified tokens"
    return None


class Engine:
    def __init__(
        self,
        model,
        config: SchedulerConfig,
        overlap_steps: str = "auto",
        draft_tokens: int = 0,
        forced_acceptance: float | None = None,
        **runner_options,
    ) -> None:
        """overlap_steps: "on" queues each step before the previous step's tokens are read (one
        rank, no expert balancing); "auto" is "off" until that has been measured on a GPU.
        draft_tokens: 1-3 for speculative decoding with the model's MTP module, 0 for none;
        forced_acceptance: `accept`'s benchmark hook (the text is then not the model's).
        runner_options: `ModelRunner`'s (cache_dtype, two_batch, thresholds, eplb)."""
        if overlap_steps not in OVERLAP_STEPS_MODES:
            raise ValueError(
                f"overlap_steps must be one of {OVERLAP_STEPS_MODES}, got {overlap_steps!r}"
            )
        refusal = overlap_refusal(model, runner_options.get("eplb"))
        if overlap_steps == "on" and refusal:
            raise ValueError(f"overlap_steps on: {refusal}")
        if draft_tokens:
            check_draft_tokens(draft_tokens)
            if refusal := speculation_refusal(model, overlap_steps):
                raise ValueError(f"speculative decoding: {refusal}")
        self.draft_tokens = draft_tokens
        self.forced_acceptance = forced_acceptance
        self.speculative_stats = SpeculativeStats()
        self.overlap_steps = overlap_steps == "on"
        self.model = model
        self.scheduler = Scheduler(config)
        self.runner = ModelRunner(model, config, draft_tokens=draft_tokens, **runner_options)
        args = model.args
        self.eos_ids = frozenset({args.eos_token_id} - {None})
        self.idle = False  # the last step found nothing it could run
        self.in_flight: LaunchedStep | None = None  # queued on the device, its tokens not read

    def _sequence(self, prompt, params, request_id, hold_pages=False, cache_salt=b"") -> Sequence:
        vocab = self.model.args.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if request_id is not None and self.scheduler.knows(request_id):
            raise ValueError(f"request id {request_id!r} is in use here")
        seq = Sequence(
            prompt, params, eos_ids=self.eos_ids, hold_pages=hold_pages, cache_salt=cache_salt
        )
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
        cache_salt: bytes = b"",
    ) -> Sequence:
        """Queue a request. hold_pages: keep its KV pages after it finishes, for `pages` and
        `release` (a prefill instance hands them to a decode instance)."""
        seq = self._sequence(prompt, params, request_id, hold_pages, cache_salt)
        self.scheduler.add(seq)
        return seq

    def held_blocks(self, request_id: str) -> list[int]:
        """The cache blocks of a held sequence's computed pages, in order (KeyError if none)."""
        seq = self.scheduler.held[request_id]
        return seq.block_table[: -(-seq.num_computed // self.scheduler.config.block_size)]

    def pages(self, request_id: str, start: int = 0, stop: int | None = None) -> list[torch.Tensor]:
        """A held sequence's computed pages `start:stop`, as bytes (`ModelRunner.read_page`)."""
        return [self.runner.read_page(b) for b in self.held_blocks(request_id)[start:stop]]

    def release(self, request_id: str) -> bool:
        return self.scheduler.release(request_id)

    def reserve(
        self,
        prompt: list[int],
        first_token: int,
        params: SamplingParams,
        request_id: str,
        cache_salt: bytes = b"",
    ) -> list[tuple[int, int]]:
        """Pages for a request prefilled elsewhere (its first token sampled already), sharing
        pages found in this instance's prefix cache: the (page index, block) pairs whose KV
        the caller must write before `start`. QueueFull when there is no room now."""
        seq = self._sequence(prompt, params, request_id, cache_salt=cache_salt)
        seq.tokens.append(first_token)
        # the page of the prompt's last token brings the hidden state of the first draft, which
        # writes the module's row there: never a cached page another sequence may share
        shareable = len(prompt) - 1 if self.draft_tokens else None
        indices = self.scheduler.reserve(seq, len(prompt), shareable)
        return [(index, seq.block_table[index]) for index in indices]

    def start(self, request_id: str) -> Sequence:
        """A reserved request whose KV is written joins the running batch (speculating: it
        awaits its first draft)."""
        seq = self.scheduler.reserved[request_id]
        seq = self.scheduler.start(request_id, len(seq.prompt))
        seq.awaits_draft = bool(self.draft_tokens)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        return self.scheduler.abort(request_id)

    def queued_prefill_flops(self) -> float:
        """The prefill work this engine has yet to run: waiting prompts and unfinished chunks."""
        scheduler, args = self.scheduler, self.model.args
        queued = [*scheduler.waiting, *(s for s in scheduler.running if s.num_uncomputed > 1)]
        return sum(args.prefill_flops(s.num_uncomputed, s.num_computed) for s in queued)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    def step(self) -> list[Sequence]:
        """Schedule, run the model, advance: the sequences that got a token this step. With
        overlapped steps: schedule, queue the step, read the previous one's tokens while it
        runs, advance; the sequences that got those."""
        if self.in_flight and self.scheduler.short_of_pages():
            return self._read_in_flight()  # the next step preempts knowing who finished
        step = self.scheduler.schedule()
        if self.draft_tokens:
            awaiting = [seq for seq in self.scheduler.running if seq.awaits_draft]
            self.idle = step is None and not awaiting
            return self._nothing_to_run() if self.idle else self._speculative_step(step, awaiting)
        self.idle = step is None and self.in_flight is None
        if step is None:
            return self._read_in_flight() if self.in_flight else self._nothing_to_run()
        if not self.overlap_steps:
            return self.scheduler.advance(step, self.runner.run(step))
        launched = self.runner.launch(step, self.in_flight, read_later=True)
        self.scheduler.blocks.step_launched()
        updated = self._read_in_flight() if self.in_flight else []
        self.scheduler.computed(step)
        self.in_flight = launched
        return updated

    def _speculative_step(self, step: Step | None, awaiting: list[Sequence]) -> list[Sequence]:
        """Verify `step` (None: nothing to verify here; an expert-parallel rank takes its share
        of its peers'), then draft the next round for its running sequences and for those
        `awaiting` their first draft."""
        verified = self.runner.verify(step, self.forced_acceptance)
        updated, counts = [], {}
        if step is not None:
            stats = self.speculative_stats
            for seq, tokens in zip(step.seqs, verified.accepted, strict=True):
                if seq.drafts:
                    stats.rounds += 1
                    stats.drafted += len(seq.drafts)
                    stats.accepted += len(tokens) - 1
            updated = self.scheduler.accepted(step, verified.accepted)
            for seq, tokens in zip(step.seqs, verified.accepted, strict=True):
                running = seq.status is Status.RUNNING
                if running and tokens is not None:
                    counts[seq] = self.scheduler.draft_room(seq, self.draft_tokens)
                elif running or seq.request_id in self.scheduler.held:
                    counts[seq] = 0  # a chunk inside its prompt; a held prompt's pages move on
        for seq in awaiting:
            counts[seq] = self.scheduler.draft_room(seq, self.draft_tokens)
        self.runner.draft(verified, counts)
        return updated

    def _read_in_flight(self) -> list[Sequence]:
        """The step in flight's tokens, waited for and taken by its sequences."""
        launched, self.in_flight = self.in_flight, None
        sampled = self.runner.read(launched)
        self.scheduler.blocks.step_done()
        return self.scheduler.received(launched.step, sampled)

    def _nothing_to_run(self) -> list[Sequence]:
        if self.model.expert_parallel:  # the peers' MoE layers exchange with this rank anyway
            if self.draft_tokens:
                self._speculative_step(None, [])
            else:
                self.runner.idle()
        blocked = self.scheduler.held or self.scheduler.reserved
        if self.has_work() and not blocked:  # add() admits what fits an empty cache
            raise RuntimeError("the scheduler found nothing to run while requests wait")
        return []  # waiting for held or reserved pages to be freed

    def rebuild_exchange(self) -> list[Sequence]:
        """After an expert-parallel exchange failed (`ep_comm.EPCommError` from `step`, on
        every rank): rebuild it, every rank together. The failed step's sequences cannot go
        on (their pages hold what it computed): they are aborted and returned."""
        aborted = [self.abort(seq.request_id) for seq in list(self.scheduler.running)]
        self.runner.rebuild_exchange()
        return aborted

    def leave_group(self) -> None:
        """Drop the instance's process group (some of its ranks are lost): see `regroup`."""
        self.runner.leave_group()

    def regroup(self, group, sources: list[int | None]) -> Moved | None:
        """Go on over `group`, the ranks left or those with a joining one, rank i having been
        rank sources[i] (None: joining): the experts re-placed over them (what moved; None
        when the ranks did not change). The sequences keep their state: a step that failed
        had not changed it, and runs again."""
        return self.runner.regroup(group, sources)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion (tests and offline use)."""
        seqs = [self.add(p, params) for p in prompts]
        while self.has_work():
            self.step()
        return [seq.completion for seq in seqs]
