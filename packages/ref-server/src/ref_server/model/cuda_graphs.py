"""Decode steps replayed from CUDA graphs.

Run eagerly, a decode step is bound by the host: a V2-Lite step launches about 2,700 kernels,
most of them microseconds long. `DecodeGraphs` captures `Transformer.run_step` once per
batch-size bucket and replays it. A batch is padded to the next bucket. Its padding rows are
position 0 of the cache's padding block, so they write only there and read only there.

    graphs = DecodeGraphs(model, cache, max_batch=64)
    logits = graphs(batch)  # a decode StepBatch of at most 64 sequences; [b, vocab] float32
"""

from __future__ import annotations

import torch

from ref_server.model.cache import PagedKVCache, StepBatch
from ref_server.model.transformer import StepMetadata


def buckets(max_batch: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then every 16 up to max_batch (inclusive)."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch, 16)) + [max_batch]


class DecodeGraphs:
    def __init__(
        self, model, cache: PagedKVCache, max_batch: int = 256, max_blocks: int | None = None
    ) -> None:
        """max_blocks: the widest block table a batch may bring (default: the whole cache)."""
        if cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the cache on a CUDA device, not {cache.device}")
        if model.expert_parallel:
            raise ValueError("expert-parallel models run eagerly: their exchange waits on the host")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.cache = model, cache
        self.max_blocks = max_blocks or cache.num_blocks
        self.buckets = buckets(max_batch)
        heads = model.args.num_attention_heads
        pad = cache.padding_block
        device = cache.device
        # Every bucket's graph reads prefixes of these; `__call__` fills them.
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), pad * cache.page_size, device=device)
        self.block_table = torch.full(
            (max_batch, self.max_blocks), pad, dtype=torch.int32, device=device
        )
        self.graphs, self.logits = {}, {}
        pool = None
        for b in reversed(self.buckets):  # the largest first, so the others fit in its pool

            def run(b=b):
                step = StepMetadata.decode(
                    self.positions[:b], self.slot_mapping[:b], self.block_table[:b], heads
                )
                return model.run_step(self.input_ids[:b], step, cache)

            with torch.no_grad():
                run()  # lazy initializations (cuBLAS workspaces, rope tables) stay outside
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self.logits[b] = run()
            pool = graph.pool()
            self.graphs[b] = graph

    def __call__(self, batch: StepBatch) -> torch.Tensor:
        """Logits `[b, vocab]` float32 of a decode batch; they are overwritten by the next call."""
        b, width = batch.block_table.shape
        if not batch.is_decode:
            raise ValueError("DecodeGraphs runs decode steps only (one new token per sequence)")
        if b > self.buckets[-1] or width > self.max_blocks:
            raise ValueError(
                f"a batch of {b} sequences and {width} blocks exceeds the captured "
                f"{self.buckets[-1]} sequences and {self.max_blocks} blocks"
            )
        bucket = next(size for size in self.buckets if size >= b)
        pad, page = self.cache.padding_block, self.cache.page_size
        for static, rows, fill in (
            (self.input_ids, batch.input_ids, 0),
            (self.positions, batch.positions, 0),
            (self.slot_mapping, batch.slot_mapping(page), pad * page),
            (self.block_table[:, :width], batch.block_table, pad),
        ):
            static[b:bucket] = fill
            static[:b] = rows
        # Entries past a sequence's blocks are never read: stale ones from earlier calls stay.
        self.graphs[bucket].replay()
        return self.logits[bucket][:b]
