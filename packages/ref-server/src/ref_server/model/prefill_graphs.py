"""Prefill steps replayed piecewise from CUDA graphs.

Run eagerly, a prefill step of a few thousand tokens is bound by the host: on the H200
machine a V2-Lite step launches about 2,500 kernels in 60-100 ms, against 12 ms of kernels
at 512 tokens and 46 ms at 4,096. All of a step but attention depends only on its token
count, so `PrefillGraphs` captures, for each bucket of token counts, the step's ops between
attention cores as CUDA graphs ("pieces"), and runs each layer's attention core (`attn.core`:
the gather and decompression of every sequence's context, the variable-length attention,
o_proj) and the head eagerly between them, with the real batch's lengths.

A batch is padded to the next bucket with rows of token 0 at position 0, which write the
cache's padding block; their attention output is zero (`Attention.core`), and `real_rows`
keeps them from expert counts. Between a piece and an eager part, tensors pass through
buffers shared by every layer and bucket (`max_tokens` rows each), written by a copy at the
end of each piece and after each eager part: one buffer per state key, not one per layer.

One rank only: an expert-parallel dispatch sizes its prefill buffers on the host.

    graphs = PrefillGraphs(model, cache, max_tokens=8192)
    logits = graphs(batch)  # a StepBatch of at most 8192 new tokens; [b, vocab] float32
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from overlap_sched import State, Yield, run
from ref_server.model.cache import PagedKVCache
from ref_server.model.static_inputs import StaticInputs
from ref_server.model.step import StepBatch, StepMetadata

EAGER_OPS = (".attn.core", "head")  # what depends on the batch's lengths, not its token count


def buckets(max_tokens: int) -> list[int]:
    """The captured token counts: 256, 512, 1024, then every 512 up to 4096 and every 1024
    above, up to max_tokens (inclusive): a step pads by at most half above 1024 tokens and a
    quarter above 2048."""
    sizes = [n for n in (256, 512, 1024) if n < max_tokens]
    sizes += range(1536, min(max_tokens, 4096 + 1), 512)
    sizes += range(5120, max_tokens, 1024)
    return sorted({*[n for n in sizes if n < max_tokens], max_tokens})


def is_eager(name: str) -> bool:
    return name.endswith(EAGER_OPS)


@dataclass
class Piece:
    """Consecutive ops of a step: a graph's (replayed) or eager ones (run each call). An eager
    piece pops `inputs` (state keys) and writes `outputs`, which pass through shared buffers."""

    ops: list
    eager: bool
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)


def cut(ops: list) -> list[Piece]:
    """A one-batch op list (`Transformer.operations`) as alternating graph and eager pieces."""
    pieces: list[Piece] = []
    for op in ops:
        if isinstance(op, Yield):
            continue
        eager = is_eager(op.name)
        if not pieces or pieces[-1].eager != eager:
            pieces.append(Piece([], eager))
        pieces[-1].ops.append(op)
    return pieces


def _values(state: State) -> dict:
    keys = state.keys()
    return {key: getattr(state, key) for key in keys}


class PrefillGraphs:
    def __init__(self, model, cache: PagedKVCache, max_tokens: int = 8192, sizes=None) -> None:
        """max_tokens: the most new tokens a captured step takes; sizes: the buckets to capture
        instead of `buckets(max_tokens)`."""
        if model.args.is_sparse:
            raise ValueError(
                "prefill graphs do not take DeepSeek-V3.2's sparse attention yet (its padding "
                "rows and the indexer's state between pieces): its prefill runs eagerly"
            )
        if cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the cache on a CUDA device, not {cache.device}")
        if model.expert_parallel is not None:
            raise ValueError(
                "prefill graphs run one rank: an expert-parallel prefill sizes its exchange on "
                "the host"
            )
        self.buckets = sorted(set(sizes)) if sizes else buckets(max_tokens)
        if self.buckets[0] < 1:
            raise ValueError(f"token counts must be >= 1, got {self.buckets[0]}")
        self.model, self.cache = model, cache
        self.max_tokens = n = self.buckets[-1]
        device, pad = cache.device, cache.padding_block * cache.page_size
        self.inputs = StaticInputs(n, device, pad)
        self.pieces = cut(model.operations(cache, "prefill"))
        self.shared: dict[str, torch.Tensor] = {}  # state key -> [max_tokens, ...] buffer
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        with torch.no_grad():
            pool = None
            for size in reversed(self.buckets):  # the largest first: the others fit its pool
                self._run_whole(size)
                self.graphs[size] = self._capture(size, pool)
                pool = self.graphs[size][0].pool()

    def _capture_step(self, size: int) -> StepMetadata:
        """A step of `size` tokens over the static inputs, one sequence whose context is the
        padding block's first row (what a capture's eager parts read)."""
        device, pad = self.cache.device, self.cache.padding_block * self.cache.page_size
        ends = torch.tensor([0, size], dtype=torch.int32, device=device)
        return StepMetadata(
            is_decode=False,
            positions=self.inputs.positions[:size],
            slot_mapping=self.inputs.slot_mapping[:size],
            block_table=torch.full(
                (1, 1), self.cache.padding_block, dtype=torch.int32, device=device
            ),
            last_rows=torch.tensor([size - 1], device=device),
            query_lens=[size],
            context_lens=[size],
            context_rows=torch.full((size,), pad, dtype=torch.long, device=device),
            cu_seqlens_q=ends,
            cu_seqlens_k=ends,
            real_rows=self.inputs.real_rows[:size],
        )

    def _run_whole(self, size: int) -> None:
        """One eager step of `size` tokens before its capture, so that Triton compiles and
        tunes outside the graphs. The first one (the largest) also learns which keys each
        eager piece pops and writes, and makes a shared buffer for each."""
        state = State(num_tokens=size, step=self._capture_step(size))
        state.input_ids = self.inputs.input_ids[:size]
        learn = not self.shared
        for piece in self.pieces:
            seen = _values(state) if learn else {}
            run(piece.ops, state)
            if piece.eager and learn:
                now = _values(state)
                piece.inputs = sorted(seen.keys() - now.keys())
                piece.outputs = sorted(now.keys() - seen.keys())
                passed = {key: seen[key] for key in piece.inputs}
                if piece is not self.pieces[-1]:
                    passed |= {key: now[key] for key in piece.outputs}
                for key, value in passed.items():
                    self._share(key, value)
        torch.cuda.synchronize(self.cache.device)

    def _share(self, key: str, value) -> None:
        if not isinstance(value, torch.Tensor) or value.shape[:1] != (self.max_tokens,):
            raise ValueError(f"prefill graphs pass token rows between pieces; {key!r} is not")
        if key not in self.shared:
            self.shared[key] = torch.empty_like(value)

    def _capture(self, size: int, pool) -> list[torch.cuda.CUDAGraph]:
        state = State(num_tokens=size, step=self._capture_step(size))
        state.input_ids = self.inputs.input_ids[:size]
        graphs = []
        for i, piece in enumerate(self.pieces):
            if piece.eager:
                self._run_eager(piece, size, state.step)
                for key in piece.outputs if i + 1 < len(self.pieces) else ():
                    setattr(state, key, self.shared[key][:size])
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                run(piece.ops, state)
                for key in self.pieces[i + 1].inputs if i + 1 < len(self.pieces) else ():
                    self.shared[key][:size].copy_(state.pop(key))
            pool = graph.pool()
            graphs.append(graph)
        return graphs

    def _run_eager(self, piece: Piece, size: int, step: StepMetadata) -> State:
        """An eager piece on the shared buffers' first `size` rows, the real step's lengths;
        what it writes copied to the shared buffers (the state, after the last piece)."""
        state = State(num_tokens=step.num_tokens, step=step)
        for key in piece.inputs:
            setattr(state, key, self.shared[key][:size])
        run(piece.ops, state)
        if piece is not self.pieces[-1]:
            for key in piece.outputs:
                self.shared[key][:size].copy_(state.pop(key))
        return state

    def bucket(self, num_tokens: int) -> int:
        """The captured token count a step of num_tokens new tokens runs in."""
        if num_tokens > self.max_tokens:
            raise ValueError(f"{num_tokens} tokens exceed the captured {self.max_tokens}")
        return next(size for size in self.buckets if size >= num_tokens)

    def __call__(self, batch: StepBatch) -> torch.Tensor:
        """Logits `[b, vocab]` float32 of each sequence's last new token, as
        `Transformer.forward_step(batch, cache)` gives them (a fresh tensor)."""
        if batch.is_decode:
            raise ValueError("PrefillGraphs runs prefill steps; decode ones replay DecodeGraphs")
        n = batch.num_tokens
        size = self.bucket(n)
        step = batch.metadata(self.cache)
        page = self.cache.page_size  # the CPU's rows: one copy, where the step's are on the GPU
        self.inputs.fill(n, size, batch.input_ids, batch.positions, batch.slot_mapping(page))
        graphs = iter(self.graphs[size])
        for piece in self.pieces:
            if piece.eager:
                state = self._run_eager(piece, size, step)
            else:
                next(graphs).replay()
        return state.logits
