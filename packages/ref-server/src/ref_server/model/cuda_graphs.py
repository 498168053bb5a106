"""Decode steps replayed from CUDA graphs.

Run eagerly, a decode step is bound by the host: a V2-Lite step launches about 2,700 kernels,
most of them microseconds long. `DecodeGraphs` captures `Transformer.run_step` once per
batch-size bucket and replays it. A batch is padded to the next bucket. Its padding rows are
position 0 of the cache's padding block, so they write only there and read only there, and
`real_rows` marks them (no expert computes or counts them).

Buckets of at least `two_batch_from` sequences are captured as two microbatches of half the
bucket each, overlapped in the decode schedule. An expert-parallel model is captured when its
exchange can be: through ep_comm's low-latency mode on its cuda backend when the model's
`ExpertParallel` has it (every bucket within its T), else the normal mode on the cuda backend
with a fixed number of received rows. Then every rank must replay the same bucket at the same
time (`__call__`'s `bucket`, `idle`).

    graphs = DecodeGraphs(model, cache, max_batch=64)
    logits = graphs(batch)  # a decode StepBatch of at most 64 sequences; [b, vocab] float32
"""

from __future__ import annotations

import torch

from ref_server.model.cache import PagedKVCache
from ref_server.model.static_inputs import StaticInputs
from ref_server.model.step import StepBatch, StepMetadata


def buckets(max_batch: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then every 16 up to max_batch (inclusive)."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch, 16)) + [max_batch]


def capture(run, device: torch.device, pool=None):
    """A CUDA graph of `run()` on `device` (in the memory pool `pool`, None: a new one) and what
    it returns, run once eagerly before, so that lazy initializations (cuBLAS workspaces, rope
    tables) stay outside the graph."""
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs need the cache on a CUDA device, not {device}")
    with torch.no_grad():
        run()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool):
            out = run()
    return graph, out


class StaticBlockTable:
    """The block table `[rows, max_blocks]` int32 (`tensor`) that a captured step reads, filled
    for each replay; on CUDA from a step's table on the host through a pinned mirror, in one
    asynchronous copy. Rows not filled yet hold the padding block."""

    def __init__(self, rows: int, max_blocks: int, padding_block: int, device) -> None:
        self.padding_block = padding_block
        self.tensor = torch.full(
            (rows, max_blocks), padding_block, dtype=torch.int32, device=device
        )
        self._host = None
        if self.tensor.is_cuda:  # a call's rows, contiguous, for one asynchronous copy
            self._host = torch.empty(rows * max_blocks, dtype=torch.int32).pin_memory()
            self._copied = torch.cuda.Event()  # the last copy out of _host

    def fill(self, n: int, size: int, table: torch.Tensor) -> None:
        """Rows :n from `table` `[n, width]` (CPU or device), rows n:size the padding block.
        Entries past a sequence's blocks are never read: stale ones from earlier calls stay."""
        width, pad = table.shape[1], self.padding_block
        static = self.tensor[:size, :width]
        if self._host is None or table.device.type != "cpu":
            static[n:] = pad
            static[:n] = table
            return
        self._copied.synchronize()
        staged = self._host[: size * width].view(size, width)
        rows = staged.numpy()  # numpy's writes skip torch's dispatch, the host's step time
        rows[:n] = table.numpy()
        rows[n:] = pad
        static.copy_(staged, non_blocking=True)
        self._copied.record(torch.cuda.current_stream(static.device))


class DecodeGraphs:
    def __init__(
        self,
        model,
        cache: PagedKVCache,
        max_batch: int = 256,
        max_blocks: int | None = None,
        two_batch_from: int | None = None,
        batch_sizes: list[int] | None = None,
    ) -> None:
        """max_blocks: the widest block table a batch may bring (default: the whole cache).
        two_batch_from: the smallest bucket captured as two microbatches (None: none).
        batch_sizes: the buckets to capture instead of `buckets(max_batch)`."""
        expert_parallel = model.expert_parallel
        if expert_parallel and not expert_parallel.capturable:
            raise ValueError(
                "ep_comm's torch backend waits on the host: an expert-parallel model runs "
                "eagerly with it"
            )
        self.buckets = sorted(set(batch_sizes)) if batch_sizes else buckets(max_batch)
        if self.buckets[0] < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.buckets[0]}")
        max_batch = self.buckets[-1]
        self.low_latency = bool(expert_parallel and expert_parallel.low_latency)
        if self.low_latency and not expert_parallel.low_latency_fits(max_batch):
            raise ValueError(
                f"a bucket of {max_batch} sequences exceeds the low-latency mode's "
                f"{expert_parallel.max_decode_tokens} tokens per rank"
            )
        self.model, self.cache = model, cache
        self.max_blocks = max_blocks or cache.num_blocks
        ranks = expert_parallel.rank_and_size[1] if expert_parallel else 1
        pad = cache.padding_block
        device = cache.device
        # Every bucket's graph reads prefixes of these; `__call__` fills them.
        self.inputs = StaticInputs(max_batch, device, pad * cache.page_size)
        self.block_table = StaticBlockTable(max_batch, self.max_blocks, pad, device)
        self.two_batch = {
            b: two_batch_from is not None and b >= max(two_batch_from, 2) for b in self.buckets
        }
        self.graphs, self.logits = {}, {}
        pool = None
        normal_mode = expert_parallel and not self.low_latency
        self.num_worst_tokens = {
            b: (b - b // 2 if self.two_batch[b] else b) * ranks if normal_mode else 0
            for b in self.buckets
        }
        for b in reversed(self.buckets):  # the largest first, so the others fit in its pool

            def run(b=b):
                return model.run_step(
                    self.step_inputs(b),
                    cache,
                    "decode",
                    self.num_worst_tokens[b],
                    low_latency=self.low_latency,
                )

            self.graphs[b], self.logits[b] = capture(run, device, pool)
            pool = self.graphs[b].pool()

    def step_inputs(self, bucket: int) -> list:
        """What the bucket's graph reads: `run_step`'s (input_ids, StepMetadata) per microbatch
        over the static inputs (two halves when the bucket runs two microbatches)."""
        inputs = self.inputs
        half = bucket // 2
        rows = [slice(0, half), slice(half, bucket)] if self.two_batch[bucket] else [slice(bucket)]
        return [
            (
                inputs.input_ids[r],
                StepMetadata.decode(
                    inputs.positions[r],
                    inputs.slot_mapping[r],
                    self.block_table.tensor[r],
                    inputs.real_rows[r],
                ),
            )
            for r in rows
        ]

    def bucket(self, num_seqs: int) -> int:
        """The captured batch size a batch of num_seqs sequences runs in."""
        if num_seqs > self.buckets[-1]:
            raise ValueError(f"{num_seqs} sequences exceed the captured {self.buckets[-1]}")
        return next(size for size in self.buckets if size >= num_seqs)

    def __call__(self, batch: StepBatch, bucket: int | None = None) -> torch.Tensor:
        """Logits `[b, vocab]` float32 of a decode batch; they are overwritten by the next call.
        bucket: the captured size to replay (default: the smallest that fits)."""
        b, width = batch.block_table.shape
        if not batch.is_decode:
            raise ValueError("DecodeGraphs runs decode steps only (one new token per sequence)")
        if b > self.buckets[-1] or width > self.max_blocks:
            raise ValueError(
                f"a batch of {b} sequences and {width} blocks exceeds the captured "
                f"{self.buckets[-1]} sequences and {self.max_blocks} blocks"
            )
        bucket = bucket or self.bucket(b)
        if bucket not in self.graphs or bucket < b:
            raise ValueError(f"bucket {bucket} is not a captured size of at least {b}")
        page = self.cache.page_size
        self.inputs.fill(b, bucket, batch.input_ids, batch.positions, batch.slot_mapping(page))
        self.block_table.fill(b, bucket, batch.block_table)
        self.graphs[bucket].replay()
        return self.logits[bucket][:b]

    def idle(self, bucket: int) -> None:
        """Replay `bucket` with padding rows only: an expert-parallel rank without sequences
        while its peers replay that bucket."""
        nothing = torch.zeros(0, dtype=torch.long)
        self.inputs.fill(0, bucket, nothing, nothing, nothing)
        self.block_table.tensor[:bucket] = self.cache.padding_block
        self.graphs[bucket].replay()
