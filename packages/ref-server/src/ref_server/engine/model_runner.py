"""All device work of an engine: the paged cache, the model's forward step, sampling.

`run(step)` is the seam where two-batch overlap (overlap-sched) will split a step into two
microbatches; today it runs the step as one batch.
"""

from __future__ import annotations

import torch

from ref_server.engine.scheduler import SchedulerConfig, Step
from ref_server.model.cache import PagedKVCache, StepBatch
from ref_server.model.cuda_graphs import DecodeGraphs
from ref_server.model.sampling import sample


class ModelRunner:
    def __init__(self, model, config: SchedulerConfig, cache_dtype=torch.bfloat16) -> None:
        self.model = model
        self.device = model.embed_tokens.weight.device
        self.cache = PagedKVCache(
            model.args, config.num_blocks, config.block_size, cache_dtype, self.device
        )
        self.decode_graphs = None
        if self.device.type == "cuda" and not model.expert_parallel:
            self.decode_graphs = DecodeGraphs(
                model,
                self.cache,
                max_batch=config.max_num_seqs,
                max_blocks=-(-config.max_model_len // config.block_size),
            )

    def _batch(self, step: Step) -> StepBatch:
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
        batch = self._batch(step)
        if self.decode_graphs and batch.is_decode:
            logits = self.decode_graphs(batch)
        else:
            logits = self.model.forward_step(batch, self.cache)
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

    @torch.no_grad()
    def idle(self) -> None:
        """A step without sequences: an expert-parallel rank's share of its peers' step."""
        self.model.idle_step()

    def read_page(self, block: int) -> torch.Tensor:
        """One page of every layer, `[layers, page_size, 576]` in the cache dtype (CPU)."""
        return torch.stack([layer[block, :, 0] for layer in self.cache.layers]).cpu()

    def write_page(self, block: int, data: torch.Tensor) -> None:
        for layer, rows in zip(self.cache.layers, data, strict=True):
            layer[block, :, 0] = rows.to(layer.device)
