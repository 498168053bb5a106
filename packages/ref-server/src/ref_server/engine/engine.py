"""One engine: a scheduler, a block manager and a model runner, stepped together.

engine = Engine(model, SchedulerConfig(num_blocks=256))
engine.add(prompt_ids, SamplingParams(max_tokens=32))
while engine.has_work():
    for seq in engine.step(): ...   # each got a new token (seq.finish_reason when done)
"""

from __future__ import annotations

from ref_server.engine.model_runner import ModelRunner
from ref_server.engine.scheduler import Scheduler, SchedulerConfig
from ref_server.engine.sequence import Sequence, Status
from ref_server.model.generate import SamplingParams


class Engine:
    def __init__(self, model, config: SchedulerConfig) -> None:
        self.model = model
        self.scheduler = Scheduler(config)
        self.runner = ModelRunner(model, config.num_blocks, config.block_size)
        args = model.args
        self.eos_ids = frozenset({args.eos_token_id} - {None})

    def add(
        self, prompt: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Sequence:
        vocab = self.model.args.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        seq = Sequence(prompt, params, eos_ids=self.eos_ids)
        if request_id is not None:
            seq.request_id = request_id
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self.runner.release(seq)
        return seq

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Sequence]:
        """Schedule, run the model, advance: the sequences that got a token this step."""
        step = self.scheduler.schedule()
        if step is None:
            if self.has_work():  # add() admits only what fits an empty cache
                raise RuntimeError("the scheduler found nothing to run while requests wait")
            return []
        updated = self.scheduler.advance(step, self.runner.run(step))
        for seq in updated:
            if seq.status is Status.FINISHED:
                self.runner.release(seq)
        return updated

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion (tests and offline use)."""
        seqs = [self.add(p, params) for p in prompts]
        while self.has_work():
            self.step()
        return [seq.completion for seq in seqs]
