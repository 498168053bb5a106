"""Speculative decoding's verify and draft steps in shapes fixed per batch size: CUDA graphs.

With the MTP module drafting K tokens a round (`ref_server.model.speculative`), each decode step
of a speculative engine is two steps, each of one shape for a given number of sequences:

- verify: the model over each sequence's newest token and its drafts, as K + 1 rows a sequence
  (its group) through the MLA decode kernel at s_q = K + 1 (causal within the group);
- draft: the module over the rows that the verify step kept, each with the token after it (a
  group of K + 1 rows again), which drafts the first token from each group's last row; then
  K - 1 times over its own output, a row a sequence, each time drafting the next token.

A sequence with fewer rows (fewer drafts, fewer kept rows) has them at the end of its group:
the decode kernel aligns its causal mask with a sequence's last token, and a group's last row is
then always its sequence's newest. The rows before them are padding, as are a bucket's padding
sequences and the later draft steps of a sequence that wants fewer than K drafts: they write
only into the cache's padding block, no expert computes them (`StepMetadata.real_rows`) and
their outputs are not read.

`SpeculativeSteps` fills static inputs for each call and runs the steps over them: replayed
from CUDA graphs captured per batch-size bucket (`capture_graphs`; drafting greedily, the
argmax on the device, and with `sampled_graphs` also by sampling, each row's parameters and
draw keys in `StaticSampling`), or eagerly at the batch's own size (drafting by
`speculative.propose`: sampled requests without sampled graphs, and tests' stand-ins for the
module; the verify step also in two overlapped microbatches split between sequences, and
through expert-parallel exchanges, which the graphs do not capture).

    steps = SpeculativeSteps(model, cache, draft_tokens=2, max_batch=64, capture_graphs=True)
    logits, hidden = steps.verify(batch)  # sequence i's rows end at (i + 1) * steps.width
    drafts, probs = steps.draft(kept, hidden_of_kept, params, counts)
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from ref_server.model import sampling, speculative
from ref_server.model.cache import PagedKVCache
from ref_server.model.cuda_graphs import StaticBlockTable, buckets, capture
from ref_server.model.sampling import SamplingParams
from ref_server.model.static_inputs import StaticInputs
from ref_server.model.step import StepBatch, StepMetadata


class StaticSampling:
    """What a draft graph that samples reads, filled for each replay: each row's temperature,
    top-k, top-p and whether it is greedy `[rows]`, and the keys of its drafts' draws
    `[K, rows]`; and what it writes: the q each draft was drawn from `[K, rows, vocab]`
    float32. Draws as `speculative.propose`'s, row for row."""

    def __init__(self, rows: int, draft_tokens: int, vocab: int, device) -> None:
        self.vocab = vocab
        self.temperature = torch.ones(rows, device=device)
        self.top_k = torch.full((rows,), vocab, dtype=torch.int64, device=device)
        self.top_p = torch.ones(rows, device=device)
        self.greedy = torch.ones(rows, dtype=torch.bool, device=device)
        self.keys = torch.zeros(draft_tokens, rows, dtype=torch.int64, device=device)
        self.q = torch.zeros(draft_tokens, rows, vocab, device=device)

    def fill(self, params: list[SamplingParams], newest: list[int]) -> None:
        """Rows of sequences sampled with params, whose newest tokens are at positions newest;
        the rows past them keep what they held (padding: their drafts are not read)."""
        n = len(params)
        for static, row in (
            (self.temperature, [1.0 if p.greedy else p.temperature for p in params]),
            (self.top_k, [p.top_k or self.vocab for p in params]),
            (self.top_p, [p.top_p for p in params]),
            (self.greedy, [p.greedy for p in params]),
        ):
            static[:n].copy_(torch.tensor(row, dtype=static.dtype), non_blocking=True)
        keys = [
            [
                speculative.draw_key(p, at + 1 + j, speculative.DRAFT)
                for p, at in zip(params, newest, strict=True)
            ]
            for j in range(len(self.keys))
        ]
        self.keys[:, :n].copy_(torch.tensor(keys, dtype=torch.int64), non_blocking=True)

    def choose(self, filtered: bool):
        """`SpeculativeSteps.run_draft`'s choose: the j-th draft of each row, its q into
        self.q; filtered: top-k and top-p applied (as `propose` does when any sampled row of
        the step asks for them)."""

        def choose(logits: torch.Tensor, j: int) -> torch.Tensor:
            rows = logits.shape[0]
            top = (self.top_k[:rows], self.top_p[:rows]) if filtered else ()
            q = sampling.scores(logits, self.temperature[:rows], *top).softmax(dim=-1)
            self.q[j, :rows].copy_(q)
            drawn = speculative.draws(q, self.keys[j, :rows])
            return torch.where(self.greedy[:rows], logits.argmax(dim=-1), drawn)

        return choose


class SpeculativeSteps:
    def __init__(
        self,
        model,
        cache: PagedKVCache,
        draft_tokens: int,
        max_batch: int = 256,
        max_blocks: int | None = None,
        batch_sizes: list[int] | None = None,
        capture_graphs: bool = False,
        sampled_graphs: bool = False,
    ) -> None:
        """draft_tokens: K, 1 to 3; max_batch: the most sequences a step brings; max_blocks:
        the widest block table (default: the whole cache); capture_graphs: capture both steps
        per bucket (`cuda_graphs.buckets(max_batch)`, or batch_sizes) on the cache's CUDA
        device; sampled_graphs: and the draft step sampling, with and without top-k / top-p
        (a `[K, max_batch, vocab]` float32 buffer more for the drafts' q)."""
        speculative.check_draft_tokens(draft_tokens)
        if model.mtp is None:
            raise ValueError("speculative decoding needs a model with an MTP module")
        if capture_graphs and model.expert_parallel:
            raise ValueError(
                "speculative steps' CUDA graphs capture one rank's model: not with expert "
                "parallelism"
            )
        self.model, self.cache = model, cache
        self.draft_tokens = draft_tokens
        self.width = draft_tokens + 1  # a sequence's rows in a verify step or a draft's first
        self.buckets = sorted(set(batch_sizes)) if batch_sizes else buckets(max_batch)
        if self.buckets[0] < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.buckets[0]}")
        max_batch = self.buckets[-1]
        self.max_blocks = max_blocks or cache.num_blocks
        pad, device = cache.padding_block, cache.device
        self.pad_slot = pad * cache.page_size
        rows = max_batch * self.width
        self.verify_inputs = StaticInputs(rows, device, self.pad_slot)
        # the draft's first step's rows, then those of each later one
        self.draft_inputs = StaticInputs(
            rows + max_batch * (draft_tokens - 1), device, self.pad_slot
        )
        dtype = model.embed_tokens.weight.dtype
        self.hidden = torch.zeros(rows, model.args.hidden_size, dtype=dtype, device=device)
        self.block_table = StaticBlockTable(max_batch, self.max_blocks, pad, device)
        steps = {"verify": self.run_verify, "draft": self.run_draft}
        self.sampling = None
        if capture_graphs and sampled_graphs:
            vocab = model.args.vocab_size
            self.sampling = StaticSampling(max_batch, draft_tokens, vocab, device)
            for variant, filtered in (("draft-sampled", False), ("draft-filtered", True)):
                steps[variant] = partial(self.run_draft, choose=self.sampling.choose(filtered))
        self.graphs, self.outputs = {}, {}
        pool = None
        for b in reversed(self.buckets if capture_graphs else []):  # the largest first
            for step, run in steps.items():
                key = (step, b)
                self.graphs[key], self.outputs[key] = capture(partial(run, b), device, pool)
                pool = self.graphs[key].pool()

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def verify(
        self, batch: StepBatch, split=None, low_latency: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model over a decode step's new tokens (each sequence's newest and its drafts, at
        most K + 1): logits `[b * width, vocab]` float32 and output hidden states
        `[b * width, hidden]` of rows where sequence i's end at (i + 1) * width (b: the bucket,
        or the batch's size if run eagerly); a graph's are overwritten by its next replay.
        split (an `overlap_sched.Split` between sequences) and low_latency, as
        `Transformer.forward_step`'s, run the step eagerly."""
        n = self._check(batch)
        if split is not None and split.cut:
            raise ValueError("a verify step splits between sequences, not inside one's drafts")
        replay = self.captured and split is None and not low_latency
        size = self._size(n, replay)
        ids, positions, slots, real = self._padding(size, 0)
        self._place(batch, self._rows(batch.query_lens), ids, positions, slots, real)
        self.verify_inputs.fill(len(ids), len(ids), ids, positions, slots, real)
        self.block_table.fill(n, size, batch.block_table)
        if replay:
            self.graphs["verify", size].replay()
            return self.outputs["verify", size]
        return self.run_verify(size, None if split is None else split.seqs, low_latency)

    def draft(self, batch: StepBatch, hidden: torch.Tensor, params: list, counts: list[int]):
        """`speculative.draft` after a verify step: batch, the token after each row the verify
        step kept (at most K + 1 a sequence; its newest last); hidden `[n, hidden]`, those rows'
        output hidden states; counts: drafts per sequence (0 to K). Drafts for each sequence and
        the q of each (None when greedy)."""
        n = self._check(batch)
        variant = self._draft_graph(params)
        size = self._size(n, variant is not None)
        self._fill_draft(batch, hidden, counts, size)
        if variant == "draft":
            self.graphs[variant, size].replay()
            drafted = self.outputs[variant, size]
            probs = [[None] * count for count in counts]
        elif variant is not None:
            self.sampling.fill(params, batch.context_lens)
            self.graphs[variant, size].replay()
            drafted = self.outputs[variant, size]
            probs = self._drawn_from(params, counts)
        else:
            probs = [[] for _ in range(n)]
            newest = batch.context_lens  # each sequence's newest token's position

            def propose(logits: torch.Tensor, j: int) -> torch.Tensor:
                seqs = np.flatnonzero(np.asarray(counts) > j).tolist()
                positions = [newest[i] + 1 + j for i in seqs]
                if len(seqs) == size:
                    tokens, q = speculative.propose(logits, params, positions)
                elif not seqs:
                    return torch.zeros(size, dtype=torch.int64, device=logits.device)
                else:
                    at = torch.tensor(seqs, dtype=torch.int64).to(logits.device, non_blocking=True)
                    tokens = torch.zeros(size, dtype=torch.int64, device=logits.device)
                    tokens[at], q = speculative.propose(
                        logits[at], [params[i] for i in seqs], positions
                    )
                for i, q_i in zip(seqs, q, strict=True):
                    probs[i].append(q_i)
                return tokens

            drafted = self.run_draft(size, propose)
        tokens = drafted[:, :n].T.tolist()  # read back once
        return [t[:count] for t, count in zip(tokens, counts, strict=True)], probs

    def _draft_graph(self, params: list[SamplingParams]) -> str | None:
        """The draft graph that drafts for these params, None: none (an eager draft)."""
        sampled = [p for p in params if not p.greedy]
        if not self.captured or (sampled and self.sampling is None):
            return None
        if not sampled:
            return "draft"
        return "draft-filtered" if any(p.top_k or p.top_p < 1 for p in sampled) else "draft-sampled"

    def _drawn_from(self, params: list[SamplingParams], counts: list[int]):
        """After a sampling draft graph: each draft's q (None for greedy params), copied out
        of the graph's buffer, which the next draft replay overwrites before the verify step
        that reads them may have run."""
        rows = [i for i, p in enumerate(params) if not p.greedy]
        at = torch.tensor(rows).to(self.sampling.q.device, non_blocking=True)
        kept, of_row = self.sampling.q[:, at], {row: k for k, row in enumerate(rows)}
        return [
            [None if p.greedy else kept[j, of_row[i]] for j in range(count)]
            for i, (p, count) in enumerate(zip(params, counts, strict=True))
        ]

    def run_verify(self, size: int, parts=None, low_latency: bool = False):
        """What the verify graph of `size` sequences runs, over the filled static inputs; parts:
        each microbatch's sequences, ranges (None: one of all)."""
        inputs, width = self.verify_inputs, self.width
        microbatches = []
        for seqs in parts or [range(size)]:
            rows = slice(seqs.start * width, seqs.stop * width)
            step = StepMetadata.decode(
                inputs.positions[rows], inputs.slot_mapping[rows],
                self.block_table.tensor[seqs.start : seqs.stop], inputs.real_rows[rows], width,
            )  # fmt: skip
            microbatches.append((inputs.input_ids[rows], step))
        return self.model.every_row(microbatches, self.cache, low_latency=low_latency)

    def run_draft(self, size: int, choose=None) -> torch.Tensor:
        """What the draft graph of `size` sequences runs, over the filled static inputs: the
        drafted tokens `[K, size]`. choose(logits `[size, vocab]`, j): the j-th draft of each
        sequence `[size]` on the device (default: the argmax)."""
        choose = choose or (lambda logits, j: logits.argmax(dim=-1))
        inputs, width, table = self.draft_inputs, self.width, self.block_table.tensor[:size]

        def metadata(first: int, count: int, s_q: int) -> StepMetadata:
            rows = slice(first, first + count)
            return StepMetadata.decode(
                inputs.positions[rows], inputs.slot_mapping[rows], table, inputs.real_rows[rows],
                s_q,
            )  # fmt: skip

        first = size * width
        ids = inputs.input_ids[:first]
        logits, hidden = self.model.every_row(
            [(ids, metadata(0, first, width))], self.cache, self.hidden[:first]
        )
        # each group's last row: its sequence's newest token's, which drafts the first token
        logits, hidden = logits[width - 1 :: width], hidden[width - 1 :: width]
        drafted = [choose(logits, 0)]
        for j in range(1, self.draft_tokens):
            step = metadata(first + (j - 1) * size, size, 1)
            logits, hidden = self.model.every_row([(drafted[-1], step)], self.cache, hidden)
            drafted.append(choose(logits, j))
        return torch.stack(drafted)

    def _fill_draft(self, batch: StepBatch, hidden, counts: list[int], size: int) -> None:
        """The draft's static inputs for `size` sequences: its first step's groups, then each
        later step j's row of sequence i at its newest token's position + j - 1 while it drafts
        (counts[i] > j), and the hidden states of its first step's rows."""
        ids, positions, slots, real = self._padding(size, self.draft_tokens - 1)
        rows = self._rows(batch.query_lens)
        self._place(batch, rows, ids, positions, slots, real)
        newest, table = np.asarray(batch.context_lens), batch.block_table.numpy()
        page = self.cache.page_size
        for j in range(1, self.draft_tokens):
            seqs = np.flatnonzero(np.asarray(counts) > j)
            at = newest[seqs] + j - 1
            later = size * (self.width + j - 1) + seqs
            positions[later] = at
            slots[later] = table[seqs, at // page].astype(np.int64) * page + at % page
            real[later] = True
        self.draft_inputs.fill(len(ids), len(ids), ids, positions, slots, real)
        self.block_table.fill(len(counts), size, batch.block_table)
        index = torch.from_numpy(rows).to(self.hidden.device)
        self.hidden[: size * self.width].index_copy_(0, index, hidden)

    def _check(self, batch: StepBatch) -> int:
        n, width = batch.block_table.shape
        if n > self.buckets[-1] or width > self.max_blocks:
            raise ValueError(
                f"a batch of {n} sequences and {width} blocks exceeds the {self.buckets[-1]} "
                f"sequences and {self.max_blocks} blocks of the speculative steps"
            )
        if max(batch.query_lens) > self.width:
            raise ValueError(
                f"a sequence brings {max(batch.query_lens)} tokens; a speculative decode step "
                f"takes at most {self.width} (its newest and {self.draft_tokens} drafts)"
            )
        return n

    def _size(self, n: int, from_graphs: bool) -> int:
        """How many sequences' rows a step of n sequences runs: its bucket's when replayed."""
        return next(b for b in self.buckets if b >= n) if from_graphs else n

    def _rows(self, query_lens: list[int]) -> np.ndarray:
        """Each new token's row: sequence i's tokens end its group, rows i * width to
        (i + 1) * width - 1."""
        lens = np.asarray(query_lens)
        ends = (np.arange(len(lens)) + 1) * self.width
        return np.arange(lens.sum()) + np.repeat(ends - np.cumsum(lens), lens)

    def _padding(self, size: int, later_steps: int):
        """input_ids, positions, slot_mapping and real_rows of `size` groups of padding rows
        (positions 0 to width - 1 of the padding block) and of later_steps steps of `size`
        rows more (position 0)."""
        group = np.arange(size * self.width) % self.width
        positions = np.concatenate([group, np.zeros(size * later_steps, dtype=np.int64)])
        return (
            np.zeros(len(positions), dtype=np.int64),
            positions,
            self.pad_slot + positions,
            np.zeros(len(positions), dtype=bool),
        )

    def _place(self, batch: StepBatch, rows: np.ndarray, ids, positions, slots, real) -> None:
        """The batch's tokens into their rows."""
        ids[rows] = batch.input_ids.cpu().numpy()
        positions[rows] = batch.positions.numpy()
        slots[rows] = batch.slot_mapping(self.cache.page_size).numpy()
        real[rows] = True
