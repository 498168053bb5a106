"""All device work of an engine: the paged cache, the model's forward step, sampling.

`run(step)` prepares the step's `StepBatch` and runs it as one batch or, with two-batch overlap,
as two microbatches whose expert-parallel exchanges overlap each other's compute
(overlap_sched). Every rank of an expert-parallel instance takes the same decision each step,
including a rank without sequences (`idle`), which still runs every exchange.
"""

from __future__ import annotations

import torch

from overlap_sched.gating import Thresholds, agree, wants_overlap
from overlap_sched.split import split_decode, split_prefill
from ref_server.engine.scheduler import SchedulerConfig, Step
from ref_server.model.cache import PagedKVCache
from ref_server.model.cuda_graphs import DecodeGraphs
from ref_server.model.sampling import sample
from ref_server.model.step import StepBatch

TWO_BATCH_MODES = ("auto", "on", "off")


class ModelRunner:
    def __init__(
        self,
        model,
        config: SchedulerConfig,
        cache_dtype=torch.bfloat16,
        two_batch: str = "auto",
        thresholds: Thresholds | None = None,
    ) -> None:
        """two_batch: "auto" (two microbatches for expert-parallel models, whose exchanges
        they overlap), "on" or "off"; thresholds: the tokens per rank below which a step runs
        one batch (default `Thresholds()`: 64 decode, 512 prefill)."""
        if two_batch not in TWO_BATCH_MODES:
            raise ValueError(f"two_batch must be one of {TWO_BATCH_MODES}, got {two_batch!r}")
        self.model = model
        self.device = model.embed_tokens.weight.device
        self.cache = PagedKVCache(
            model.args, config.num_blocks, config.block_size, cache_dtype, self.device
        )
        self.two_batch = two_batch == "on" or (two_batch == "auto" and bool(model.expert_parallel))
        self.thresholds = thresholds or Thresholds()
        self.group = model.expert_parallel.group if model.expert_parallel else None
        self.decode_graphs = None
        if self.device.type == "cuda" and not model.expert_parallel:
            self.decode_graphs = DecodeGraphs(
                model,
                self.cache,
                max_batch=config.max_num_seqs,
                max_blocks=-(-config.max_model_len // config.block_size),
                two_batch_from=self.thresholds.decode if self.two_batch else None,
            )

    def prepare(self, step: Step) -> StepBatch:
        ids, context = [], []
        for seq, chunk in zip(step.seqs, step.chunks, strict=True):
            ids += seq.tokens[seq.num_computed : seq.num_computed + chunk]
            context.append(seq.num_computed + chunk)
        width = max(len(seq.block_table) for seq in step.seqs)
        rows = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in step.seqs]
        table = torch.tensor(rows, dtype=torch.int32)
        return StepBatch(torch.tensor(ids, device=self.device), list(step.chunks), context, table)

    @torch.no_grad()
    def run(self, step: Step) -> list[int | None]:
        """The token sampled for each sequence whose chunk reaches its last token (None for
        chunks that end inside the tokens still to compute)."""
        batch = self.prepare(step)
        if self.decode_graphs and batch.is_decode:
            logits = self.decode_graphs(batch)
        else:
            logits = self.model.forward_step(batch, self.cache, self._split(batch))
        sampled = [None] * len(step.seqs)
        done = [
            row
            for row, (seq, chunk) in enumerate(zip(step.seqs, step.chunks, strict=True))
            if seq.num_computed + chunk == len(seq)
        ]
        if done:
            seqs = [step.seqs[row] for row in done]
            tokens = sample(logits[done], [s.params for s in seqs], [len(s) for s in seqs])
            for row, token in zip(done, tokens, strict=True):
                sampled[row] = token
        return sampled

    def _split(self, batch: StepBatch):
        """How to cut the batch in two, or None for one batch, as every rank agreed."""
        if not self.two_batch:  # the same on every rank: no need to ask the others
            return None
        mode = "decode" if batch.is_decode else "prefill"
        wants = wants_overlap(batch.num_tokens, mode, self.thresholds)
        if agree(wants, mode, self.group) is None:
            return None
        if mode == "decode":
            return split_decode(batch.context_lens)
        return split_prefill(batch.query_lens, batch.context_lens)

    @torch.no_grad()
    def idle(self) -> None:
        """A step without sequences: an expert-parallel rank's share of its peers' step, in the
        schedule they agreed."""
        schedule = agree(False, None, self.group) if self.two_batch else None
        self.model.idle_step(self.cache, schedule)

    def read_page(self, block: int) -> torch.Tensor:
        """One page of every layer, `[layers, page_size, 576]` in the cache dtype (CPU)."""
        return torch.stack([layer[block, :, 0] for layer in self.cache.layers]).cpu()

    def write_page(self, block: int, data: torch.Tensor) -> None:
        for layer, rows in zip(self.cache.layers, data, strict=True):
            layer[block, :, 0] = rows.to(layer.device)
