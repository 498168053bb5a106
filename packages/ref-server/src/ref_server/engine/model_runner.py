"""All device work of an engine: the paged cache, the model's forward step, sampling.

`run(step)` prepares the step's `StepBatch` and runs it as one batch or, with two-batch overlap,
as two microbatches whose expert-parallel exchanges overlap each other's compute
(overlap_sched), or replays it from CUDA graphs (a decode step whole, a prefill step of one
rank piecewise around its attention). The ranks of an expert-parallel
instance must run the same kind of step at the same time: each step they agree on a `StepPlan`
(`plan`, one all_gather), and a rank without sequences (`idle`) takes its share of it. A decode
step's exchanges go through ep_comm's low-latency mode, which graphs can capture; prefill's
through its normal mode. After every expert-parallel step the ranks check together that no
exchange failed (`ExpertParallel.raise_if_failed`) before any token leaves; then, with `eplb`,
the expert balancer counts the step and moves experts (`ExpertBalancer`).

`run` is `launch` then `read`. An engine that overlaps its steps launches the next step before
it reads the previous one: a launch with `read_later` queues its sampled tokens' copy to the
host behind it, so that `read` waits for that step alone, and a token the host has not read yet
(the sequence's `pending` one) is taken from the previous step's tokens on the device.

Speculative decoding with the MTP module (`ref_server.model.speculative`) runs `verify` instead
of `run`: the model over every new token (a sequence's newest one and its drafts) and the
acceptance of the drafts; then, once the scheduler has taken the tokens, `draft` runs the module
over the kept tokens' hidden states and drafts the next round's tokens. After a prefill step
both run eagerly over the step's tokens; after a decode step through `SpeculativeSteps`, in its
shapes fixed per batch size (the decode kernel over each sequence's newest token and its
drafts), replayed from CUDA graphs where one rank steps one batch on CUDA, unless
REF_SERVER_MTP_GRAPHS=0 (greedy drafting; sampled requests draft eagerly in the same shapes,
or in draft graphs that sample with REF_SERVER_MTP_SAMPLED_GRAPHS=1).
A prefill instance's prompt
keeps its last hidden state in its last token's page (`PagedKVCache.prompt_hidden`), where a
decode instance's `draft` reads it after the transfer. Expert-parallel ranks plan a verify step
as any step (a decode step's as a decode: two microbatches split between sequences or one, the
exchanges' mode; `verify(None)` is a rank's share without sequences), and agree on the number
of module steps (a rank that drafts fewer runs idle ones).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.distributed as dist

from overlap_sched.gating import MODES, Thresholds, wants_overlap
from overlap_sched.split import split_decode, split_prefill
from ref_server.engine.expert_balancer import EplbConfig, ExpertBalancer
from ref_server.engine.scheduler import SchedulerConfig, Step
from ref_server.engine.sequence import Sequence
from ref_server.model.cache import PagedKVCache
from ref_server.model.cuda_graphs import DecodeGraphs
from ref_server.model.expert_parallel import group_of, ranks_of
from ref_server.model.expert_rebalance import Moved, regroup_experts
from ref_server.model.prefill_graphs import PrefillGraphs
from ref_server.model.sampling import sample_on_device
from ref_server.model.speculative import accept, draft
from ref_server.model.speculative_graphs import SpeculativeSteps
from ref_server.model.step import StepBatch

TWO_BATCH_MODES = ("auto", "on", "off")
IDLE = -1  # a rank's vote without sequences; else the index of its batch's mode in MODES
MTP_GRAPHS = "REF_SERVER_MTP_GRAPHS"  # capture speculative decoding's steps on CUDA: auto, 1, 0
MTP_GRAPHS_MODES = ("auto", "1", "0")
MTP_SAMPLED_GRAPHS = "REF_SERVER_MTP_SAMPLED_GRAPHS"  # 1: draft graphs that sample too; 0: not


def mtp_graphs_by_environment() -> str:
    """REF_SERVER_MTP_GRAPHS: "auto" (unset) captures speculative decoding's steps where one
    rank steps one batch, "1" asks for them anywhere (refused where they cannot be), "0" runs
    them eagerly; ValueError naming the variable on anything else."""
    value = os.environ.get(MTP_GRAPHS, "auto")
    if value not in MTP_GRAPHS_MODES:
        raise ValueError(f"{MTP_GRAPHS} must be auto, 1 or 0, got {value!r}")
    return value


def mtp_sampled_graphs_by_environment() -> bool:
    """REF_SERVER_MTP_SAMPLED_GRAPHS=1: where speculative steps are captured, the draft step
    is captured sampling too (sampled requests replay it); 0 (unset): they draft eagerly."""
    value = os.environ.get(MTP_SAMPLED_GRAPHS, "0")
    if value not in ("1", "0"):
        raise ValueError(f"{MTP_SAMPLED_GRAPHS} must be 1 or 0, got {value!r}")
    return value == "1"


@dataclass(frozen=True)
class StepPlan:
    """What every rank of an instance runs this step."""

    schedule: str  # "decode" when every rank with sequences decodes, else "prefill"
    two_batch: bool  # two microbatches overlapped
    low_latency: bool  # the MoE exchanges go through ep_comm's low-latency mode
    bucket: int | None  # the decode graph every rank replays; None: an eager step


@dataclass
class LaunchedStep:
    """A step queued on the device, and what it samples."""

    step: Step
    sampling: list[int]  # the rows of step.seqs that sample (their chunk reaches their end)
    tokens: torch.Tensor | None  # `[len(sampling)]` int64 on the device; None: none samples
    host: torch.Tensor | None = None  # `copy_to_host`'s pinned copy of tokens
    done: torch.cuda.Event | None = None  # recorded behind the step and that copy

    @cached_property
    def rows(self) -> dict[Sequence, int]:
        """Each sampling sequence's row in `tokens`."""
        return {self.step.seqs[row]: i for i, row in enumerate(self.sampling)}

    def copy_to_host(self) -> None:
        """On CUDA: queue the tokens' copy to pinned host memory (which torch allocates for a
        non-blocking copy from the device) and an event behind the step, so that `read` waits
        for this step alone, not for those queued after it."""
        if self.tokens is not None:
            self.host = self.tokens.to("cpu", non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()

    def read(self) -> list[int]:
        """The tokens on the host, once the step is done (without `copy_to_host`: once every
        step queued so far is, or at once where nothing samples)."""
        if self.done is not None:
            self.done.synchronize()
        if self.tokens is None:
            return []
        return (self.tokens if self.host is None else self.host).tolist()


@dataclass
class VerifiedStep:
    """A speculative step's outcome: each sequence's accepted drafts and the token after them
    (None for chunks that end inside a prompt), and what `ModelRunner.draft` reads next."""

    step: Step
    accepted: list[list[int] | None]
    hidden: torch.Tensor  # the model's output hidden state of each new token, and padding rows
    ends: list[int]  # where each sequence's rows end in hidden
    starts: list[int]  # each sequence's computed tokens before the step

    @cached_property
    def _places(self) -> dict[Sequence, tuple[int, int]]:
        """Each sequence's first row in hidden, and its computed tokens before the step."""
        step = self.step
        return {
            seq: (end - chunk, start)
            for seq, chunk, end, start in zip(
                step.seqs, step.chunks, self.ends, self.starts, strict=True
            )
        }

    def module_input(self, seq: Sequence) -> tuple[list[int], torch.Tensor]:
        """What the MTP module reads of a sequence of the step once the scheduler took its
        tokens: the token after each newly kept one, and their hidden states `[kept, hidden]`."""
        first, start = self._places[seq]
        kept = seq.num_computed - start
        return seq.tokens[start + 1 : start + kept + 1], self.hidden[first : first + kept]


class ModelRunner:
    def __init__(
        self,
        model,
        config: SchedulerConfig,
        cache_dtype=torch.bfloat16,
        two_batch: str = "auto",
        thresholds: Thresholds | None = None,
        eplb: EplbConfig | None = None,
        prefill_graph_tokens: int = 8192,
        draft_tokens: int = 0,
    ) -> None:
        """two_batch: "auto" (two microbatches for expert-parallel models, whose exchanges
        they overlap), "on" or "off"; thresholds: the tokens per rank below which a step runs
        one batch (default `Thresholds()`: 64 decode, 512 prefill); eplb: balance the experts
        of a model built with expert slots (`ExpertBalancer`); prefill_graph_tokens: the most
        new tokens of a one-batch prefill step replayed from `PrefillGraphs` (CUDA, one rank;
        at most max_num_batched_tokens; 0: none); draft_tokens: K of speculative decoding
        (`verify` and `draft`; 0: none), whose steps replace decode and prefill graphs."""
        if two_batch not in TWO_BATCH_MODES:
            raise ValueError(f"two_batch must be one of {TWO_BATCH_MODES}, got {two_batch!r}")
        self.model = model
        self.config = config
        self.device = model.embed_tokens.weight.device
        self.cache = PagedKVCache(
            model.args, config.num_blocks, config.block_size, cache_dtype, self.device
        )
        self.expert_parallel = model.expert_parallel
        self.two_batch = two_batch == "on" or (two_batch == "auto" and bool(self.expert_parallel))
        self.thresholds = thresholds or Thresholds()
        if self.expert_parallel:  # a decode microbatch holds at most max_num_seqs tokens
            self.expert_parallel.use_low_latency(
                config.max_num_seqs, model.args.num_experts_per_tok
            )
        self.speculative = None
        if draft_tokens:
            mode, sampled_graphs = mtp_graphs_by_environment(), mtp_sampled_graphs_by_environment()
            one_batch = not (self.expert_parallel or self.two_batch)
            if mode == "1" and not one_batch:
                raise ValueError(
                    f"{MTP_GRAPHS}=1 captures one rank's speculative steps as one batch: not "
                    "with expert parallelism or two-batch overlap"
                )
            graphs = mode == "1" or (mode == "auto" and one_batch)
            self.speculative = SpeculativeSteps(
                model,
                self.cache,
                draft_tokens,
                max_batch=config.max_num_seqs,
                max_blocks=-(-config.max_model_len // config.block_size),
                capture_graphs=graphs and self.device.type == "cuda",
                sampled_graphs=sampled_graphs,
            )
        self.decode_graphs = self._capture_decode_graphs()
        self.prefill_graphs = None
        tokens = min(prefill_graph_tokens, config.max_num_batched_tokens)
        eligible = not (self.expert_parallel or model.args.is_sparse or draft_tokens)
        if self.device.type == "cuda" and eligible and tokens > 0:
            self.prefill_graphs = PrefillGraphs(model, self.cache, max_tokens=tokens)
        self.expert_balancer = ExpertBalancer(model, eplb) if eplb else None

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The instance's ranks (None: one rank)."""
        return group_of(self.expert_parallel)

    @property
    def ranks(self) -> int:
        return ranks_of(self.expert_parallel)

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        """Graphs of decode steps on CUDA; for an expert-parallel model only when its exchange
        goes low-latency through ep_comm's cuda backend (up to its T sequences)."""
        ep, config = self.expert_parallel, self.config
        if self.device.type != "cuda" or self.speculative is not None:
            return None
        if ep and not (ep.low_latency and ep.capturable):
            return None
        max_batch = config.max_num_seqs
        if ep:
            max_batch = min(max_batch, ep.max_decode_tokens)
        return DecodeGraphs(
            self.model,
            self.cache,
            max_batch=max_batch,
            max_blocks=-(-config.max_model_len // config.block_size),
            two_batch_from=self.thresholds.decode if self.two_batch else None,
        )

    def prepare(self, step: Step, previous: LaunchedStep | None = None) -> StepBatch:
        """The step's `StepBatch`. A sequence's pending token (sampled by `previous`, the step
        launched before this one, and not read yet) is taken from previous.tokens on the device."""
        ids, context, pending = [], [], []
        for seq, chunk in zip(step.seqs, step.chunks, strict=True):
            ids += seq.tokens[seq.num_computed : seq.num_computed + chunk]
            ids += seq.drafts  # speculative decoding's: chunk counts them
            if seq.pending:  # its chunk is that one token
                pending.append((len(ids), previous.rows[seq]))
                ids.append(0)
            context.append(seq.num_computed + chunk)
        width = max(len(seq.block_table) for seq in step.seqs)
        rows = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in step.seqs]
        # Through numpy: torch.tensor of nested lists took 0.14 ms at 128 sequences, numpy 0.04.
        # ids stay on the CPU unless some are pending: a graph's inputs take them in its one
        # copy, an eager step in its own
        table = torch.from_numpy(np.array(rows, dtype=np.int32))
        ids = np.array(ids, dtype=np.int64)
        input_ids = self._with_pending(ids, pending, previous) if pending else torch.from_numpy(ids)
        return StepBatch(input_ids, list(step.chunks), context, table)

    def _with_pending(self, ids: np.ndarray, pending: list[tuple[int, int]], previous):
        """ids on the device, each pending (index, row) filled with previous.tokens[row] there:
        the host never waits for the previous step."""
        at, rows = np.array(pending, dtype=np.int64).T
        host = torch.from_numpy(np.concatenate([ids, at, rows]))
        if self.device.type == "cuda":  # a copy from pageable memory would wait for the device
            host = host.pin_memory()
        ids, at, rows = host.to(self.device, non_blocking=True).split([len(ids), len(at), len(at)])
        return ids.index_copy(0, at, previous.tokens[rows])

    @torch.no_grad()
    def run(self, step: Step) -> list[int | None]:
        """The token sampled for each sequence whose chunk reaches its last token (None for
        chunks that end inside the tokens still to compute). EPCommError, on every rank, when
        an exchange of the step failed: then nothing was sampled."""
        return self.read(self.launch(step))

    @torch.no_grad()
    def launch(
        self, step: Step, previous: LaunchedStep | None = None, read_later: bool = False
    ) -> LaunchedStep:
        """Queue `step` on the device and return without waiting for it. previous: the step
        launched before, if its tokens are not read yet (`prepare`); read_later: the next step
        will be launched before this one is read (`LaunchedStep.copy_to_host`). EPCommError as
        `run`."""
        batch = self.prepare(step, previous)
        plan = self.plan(batch)
        if plan.bucket:
            logits = self.decode_graphs(batch, plan.bucket)
        elif self._prefill_graphs_take(batch, plan):
            logits = self.prefill_graphs(batch)
        else:
            split = self._split(batch) if plan.two_batch else None
            logits = self.model.forward_step(batch, self.cache, split, plan.low_latency)
        launched = self._sample(step, logits)
        if read_later and self.device.type == "cuda":
            launched.copy_to_host()
        self._check_exchange()
        self._step_done()
        return launched

    @torch.no_grad()
    def verify(
        self, step: Step | None, forced_acceptance: float | None = None
    ) -> VerifiedStep | None:
        """Run `step` (each decoding sequence's chunk: its newest token and its drafts) as the
        ranks planned it (`plan`: two microbatches, the exchanges' mode) and accept the drafts
        (`accept`; forced_acceptance: its benchmark hook). None for step None: this rank's
        share of its peers' step, if any runs one. A runner built with draft_tokens: a decode
        step runs through `SpeculativeSteps`, a prefill step over its tokens as they come."""
        batch = None if step is None else self.prepare(step)
        width = None if step is None or step.is_prefill else self.speculative.width
        plan = self.plan(batch, width)
        if batch is None:
            if plan is not None:
                schedule = plan.schedule if plan.two_batch else None
                self.model.idle_step(self.cache, schedule, low_latency=plan.low_latency)
            return None
        split = self._split(batch, width is not None) if plan.two_batch else None
        if width is None:
            logits, hidden = self.model.every_row_step(
                batch, self.cache, split=split, low_latency=plan.low_latency
            )
            ends = np.cumsum(step.chunks).tolist()
        else:
            logits, hidden = self.speculative.verify(batch, split, plan.low_latency)
            ends = [(i + 1) * width for i in range(len(step.seqs))]
        # the sequences whose chunk reaches their newest token, and the row of that token
        taking = {
            i: end - len(seq.drafts) - 1
            for i, (seq, chunk, end) in enumerate(zip(step.seqs, step.chunks, ends, strict=True))
            if seq.num_computed + chunk - len(seq.drafts) == len(seq)
        }
        accepted = [None] * len(step.seqs)
        if taking:
            seqs = [step.seqs[i] for i in taking]
            results = accept(
                logits, list(taking.values()), [s.drafts for s in seqs],
                [s.draft_probs for s in seqs], [s.params for s in seqs], [len(s) for s in seqs],
                forced_acceptance,
            )  # fmt: skip
            for i, tokens in zip(taking, results, strict=True):
                accepted[i] = tokens
        # a prefill instance's prompts, for the decode instance
        handed = {
            self._prompt_block(step.seqs[i]): row
            for i, row in taking.items()
            if step.seqs[i].hold_pages
        }
        if handed:
            self.cache.prompt_hidden[list(handed)] = hidden[list(handed.values())].float()
        return VerifiedStep(step, accepted, hidden, ends, [seq.num_computed for seq in step.seqs])

    def _prompt_block(self, seq: Sequence) -> int:
        """The block of the page that holds seq's prompt's last token."""
        return seq.block_table[(len(seq.prompt) - 1) // self.cache.page_size]

    @torch.no_grad()
    def draft(self, verified: VerifiedStep | None, counts: dict[Sequence, int]) -> None:
        """After the scheduler took a verified step's tokens: the MTP module reads, for each
        sequence in counts, the hidden states it has not read yet with the token after each,
        and drafts counts[seq] tokens into seq.drafts. Those are a verified sequence's newly
        kept tokens' (from the step), or for one that awaits its first draft, its prompt's
        last token's (from that token's page). After a decode step, or for sequences that only
        await their first draft, the module runs through `SpeculativeSteps` (K steps, its
        shapes), after a prefill step over the step's tokens. The ranks of an expert-parallel
        instance run as many module steps as the one that needs the most, then check the
        step's exchanges together (EPCommError as `run`)."""
        decode = verified is None or not verified.step.is_prefill
        needed = 0
        if counts:  # one a draft, one at least
            needed = self.speculative.draft_tokens if decode else max(1, *counts.values())
        steps = max(vote[0] for vote in self._all_gather([needed]))
        if counts:
            seqs = list(counts)
            batch, hidden = self._module_input(verified, seqs)
            params, wanted = [s.params for s in seqs], [counts[s] for s in seqs]
            if decode:
                drafts, probs = self.speculative.draft(batch, hidden, params, wanted)
            else:
                drafts, probs = draft(self.model, self.cache, batch, hidden, params, wanted, steps)
            for seq, tokens, q in zip(seqs, drafts, probs, strict=True):
                seq.drafts, seq.draft_probs = tokens, q
        else:
            for _ in range(steps):
                self.model.idle_step(self.cache, mtp=True)
        self._check_exchange()
        self._step_done()

    def _module_input(self, verified: VerifiedStep | None, seqs: list[Sequence]):
        """The module's `StepBatch` of `seqs` and the hidden states it reads `[n, hidden]`."""
        new, hidden = [], []
        dtype = self.model.embed_tokens.weight.dtype
        for seq in seqs:
            if seq.awaits_draft:
                seq.awaits_draft = False
                tokens = seq.tokens[seq.num_computed :]
                states = self.cache.prompt_hidden[[self._prompt_block(seq)]].to(dtype)
            else:
                tokens, states = verified.module_input(seq)
            new.append(tokens)
            hidden.append(states)
        width = max(len(seq.block_table) for seq in seqs)
        table = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]
        batch = StepBatch(
            torch.tensor([t for n in new for t in n]),
            [len(n) for n in new],
            [seq.num_computed for seq in seqs],
            torch.tensor(table, dtype=torch.int32),
        )
        return batch, torch.cat(hidden)

    def read(self, launched: LaunchedStep) -> list[int | None]:
        """`run`'s tokens of a launched step."""
        sampled = [None] * len(launched.step.seqs)
        for row, token in zip(launched.sampling, launched.read(), strict=True):
            sampled[row] = token
        return sampled

    @torch.no_grad()
    def idle(self) -> None:
        """A step without sequences: an expert-parallel rank's share of its peers' step, as
        they planned it (nothing when no rank has sequences)."""
        plan = self.plan(None)
        if plan is None:
            return
        if plan.bucket:
            self.decode_graphs.idle(plan.bucket)
        else:
            schedule = plan.schedule if plan.two_batch else None
            self.model.idle_step(self.cache, schedule, low_latency=plan.low_latency)
        self._check_exchange()
        self._step_done()

    def _prefill_graphs_take(self, batch: StepBatch, plan: StepPlan) -> bool:
        graphs = self.prefill_graphs
        fits = graphs is not None and batch.num_tokens <= graphs.max_tokens
        return fits and not (batch.is_decode or plan.two_batch)

    def _step_done(self) -> None:
        """After a step every rank ran and no exchange failed."""
        if self.expert_balancer:
            self.expert_balancer.step_done()

    def plan(self, batch: StepBatch | None, s_q: int | None = None) -> StepPlan | None:
        """How every rank runs this step, from one all_gather of each rank's (mode, tokens,
        whether it wants two microbatches); batch None: this rank has no sequences; s_q: the
        rows a sequence of a speculative decode step brings to the decode kernel (a decode, of
        len(seqs) * s_q tokens), None: the batch's own kind. None when no rank has any. Two
        microbatches run only if every rank with sequences wants them in the same mode; a
        decode graph replays when every rank decodes within the captured sizes (the bucket of
        the largest batch)."""
        vote = [IDLE, 0, 0]
        if batch is not None:
            mode = "decode" if s_q or batch.is_decode else "prefill"
            tokens = len(batch.query_lens) * s_q if s_q else batch.num_tokens
            wants = self.two_batch and wants_overlap(tokens, mode, self.thresholds)
            wants = wants and not (s_q and len(batch.query_lens) == 1)  # split between sequences
            vote = [MODES.index(mode), tokens, int(wants)]
        votes = [v for v in self._all_gather(vote) if v[0] != IDLE]
        if not votes:
            return None
        modes = {MODES[v[0]] for v in votes}
        schedule = "decode" if modes == {"decode"} else "prefill"
        two_batch = len(modes) == 1 and all(v[2] for v in votes)
        tokens = max(v[1] for v in votes)
        ep, graphs = self.expert_parallel, self.decode_graphs
        low_latency = schedule == "decode" and bool(ep) and ep.low_latency_fits(tokens)
        bucket = None
        if schedule == "decode" and graphs and tokens <= graphs.buckets[-1]:
            bucket = graphs.bucket(tokens)
        return StepPlan(schedule, two_batch, low_latency, bucket)

    def _all_gather(self, vote: list[int]) -> list[list[int]]:
        if self.group is None:
            return [vote]
        on_cuda = dist.get_backend(self.group) == dist.Backend.NCCL
        mine = torch.tensor(vote, device=self.device if on_cuda else "cpu")
        every = [torch.empty_like(mine) for _ in range(self.group.size())]
        dist.all_gather(every, mine, group=self.group)
        return torch.stack(every).tolist()

    def _split(self, batch: StepBatch, between_sequences: bool = False):
        if batch.is_decode or between_sequences:
            return split_decode(batch.context_lens)
        return split_prefill(batch.query_lens, batch.context_lens)

    def _sample(self, step: Step, logits: torch.Tensor) -> LaunchedStep:
        sampling = [
            row
            for row, (seq, chunk) in enumerate(zip(step.seqs, step.chunks, strict=True))
            if seq.num_computed + chunk == len(seq)
        ]
        if not sampling:  # chunks inside prompts only
            return LaunchedStep(step, sampling, None)
        seqs = [step.seqs[row] for row in sampling]
        rows = logits if len(sampling) == len(logits) else logits[sampling]  # decode: every row
        tokens = sample_on_device(rows, [s.params for s in seqs], [len(s) for s in seqs])
        return LaunchedStep(step, sampling, tokens)

    def _check_exchange(self) -> None:
        """Every rank raises EPCommError if an exchange of this step failed on any rank."""
        if self.expert_parallel:
            self.expert_parallel.raise_if_failed()

    def rebuild_exchange(self) -> None:
        """After a failed exchange: a new ep_comm buffer (every rank together), and the decode
        graphs, which replayed the old one, captured anew."""
        self.decode_graphs = None
        self.expert_parallel.reset()
        self.decode_graphs = self._capture_decode_graphs()

    def leave_group(self) -> None:
        """Drop the instance's group and buffer (some ranks are lost), decode graphs with them."""
        self.decode_graphs = None
        self.expert_parallel.leave()

    def regroup(self, group: dist.ProcessGroup, sources: list[int | None]) -> Moved | None:
        """After `leave_group` (or on a rank joining a running instance): the exchange over
        `group`, whose rank i was rank sources[i] before (None: a joining rank), the experts
        placed over it where its ranks changed (`regroup_experts`; None when they did not),
        the decode graphs captured anew. Every rank of group together."""
        ep, balancer = self.expert_parallel, self.expert_balancer
        if sources == list(range(ep.rank_and_size[1])):
            ep.regroup(group, ep.num_experts)
            moved = None
        else:
            load = balancer.before_regroup() if balancer else None
            moved = regroup_experts(self.model, sources, group, load)
        self.decode_graphs = self._capture_decode_graphs()
        return moved

    def read_page(self, block: int) -> torch.Tensor:
        """One page's bytes (`PagedKVCache.read_page`: every layer's latent rows, and a sparse
        model's index keys)."""
        return self.cache.read_page(block)

    def write_page(self, block: int, data: torch.Tensor) -> None:
        self.cache.write_page(block, data)
