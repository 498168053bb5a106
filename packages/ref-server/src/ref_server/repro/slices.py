"""DeepSeek-V3-shaped slices on the device at hand: one GPU's per-part times (`LayerTimes`) at a
phase's layout, through the model's own op list, timed by overlap_sched's `Recorder`.

A slice is one dense and one MoE layer of DeepSeek-V3 (`--slice v3`), of DeepSeek-V3.2
(`--slice v3.2`: V3 with the lightning indexer and sparse attention over its top 2,048 tokens)
or of a V3-shaped model small enough for a CPU (`--slice tiny`: V3's routing, 256 experts top-8,
tiny widths; `--slice v3.2-tiny`: the same with an indexer of 4 heads picking 8 tokens), built
as rank 0 of the layout: its MoE layer holds the expert slots one GPU holds (prefill EP32: 9 of
288; decode EP144: 2). `LayoutExchange` stands in for the other ranks: its dispatch hands the
experts the rows perfectly even routing sends one GPU (`per_rank_work`, copies of the
microbatch's own tokens, each slot the same count), its combine hands one row a token back.
Nothing crosses a wire, so dispatch and combine cost nothing here; the projection takes their
times from `communication`. Prefill runs the normal mode's ops on prompts of the layout's
length; decode runs the low-latency mode's (FP8 rows with FP8 experts) over a context of the
given KV length a request, one new token each or, for MTP's verify step, the newest token and
its drafts (the model's own verify: a chunk of new tokens a request, every row's logits).

Each op's time is CUDA events around it on the compute stream (the host's clock on the CPU),
over eager steps, the median of `reps` steps after two untimed ones. On CUDA the host runs
ahead: the stream first sleeps (`torch.cuda._sleep`) while the host enqueues the whole step,
then the kernels run back to back, so the events measure the GPU, not Python's launches (which
made small decode microbatches' parts host times). The untimed steps load every kernel (a
first launch loads its module, which can wait for the sleeping stream) and lengthen the sleep
until it outlasts the enqueueing; a timed step whose sleep ended first (a host sync inside it) is
reported as such in the run's note, its parts then upper bounds.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch

import mla_kernels
import ref_server.model as M
from overlap_sched import Recorder
from ref_server.kernels.fp8_cast import quantize_activations
from ref_server.kernels.indexer import triton_by_environment
from ref_server.model import StepBatch
from ref_server.model.args import attended_pairs
from ref_server.model.expert_parallel import Dispatched, Packed
from ref_server.model.sampling import SamplingParams, sample
from ref_server.repro.projection import LayerTimes
from ref_server.repro.schedule import OPS_OF_ITEM
from ref_server.repro.shapes import OperatingPoint, V3Dims, per_rank_work
from ref_server.repro.terms import Device

PROMPT = 4096  # profile-data's prompts: 4K
# The tiny preset's widths with V3's routing: 256 experts, top-8 from 4 of 8 groups; its V3.2
# twin has the v3.2-tiny preset's indexer.
TINY = dataclasses.replace(
    M.PRESETS["tiny"], n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4
)
SLICES = {
    "v3": M.PRESETS["v3"],
    "v3.2": M.PRESETS["v3.2"],
    "tiny": TINY,
    "v3.2-tiny": dataclasses.replace(TINY, index_topk=8, index_n_heads=4),
}


def slice_args(name: str) -> M.ModelArgs:
    """One dense and one MoE layer of the named slice's model."""
    if name not in SLICES:
        raise ValueError(f"unknown slice {name!r}; slices: {', '.join(SLICES)}")
    return dataclasses.replace(SLICES[name], num_hidden_layers=2, first_k_dense_replace=1)


def dims_of(args: M.ModelArgs) -> V3Dims:
    """The projection's dimensions of a model, its full depth as V3 (61 layers, 3 dense)."""
    return V3Dims(
        hidden_size=args.hidden_size,
        n_routed_experts=args.n_routed_experts,
        n_shared_experts=args.n_shared_experts,
        num_experts_per_tok=args.num_experts_per_tok,
        kv_lora_rank=args.kv_lora_rank,
        qk_rope_head_dim=args.qk_rope_head_dim,
        index_topk=args.index_topk,
        index_head_dim=args.index_head_dim,
    )


class LayoutExchange:
    """Rank 0 of `point`'s layout without the other ranks: what the model's MoE layer asks of
    `ExpertParallel` (see module docstring)."""

    def __init__(self, point: OperatingPoint, args: M.ModelArgs) -> None:
        work = per_rank_work(dims_of(args), point)
        self.rank_and_size = (0, point.gpus)
        self.local = work.local_experts
        # rows each slot receives per microbatch
        self.rows_per_slot = round(work.rows_per_physical_expert / point.microbatches)
        self.k = args.num_experts_per_tok

    def _received(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for the slots in turn (slot i mod local), copies of x's tokens in turn."""
        rows = self.rows_per_slot * self.local
        index = torch.arange(rows, device=x.device)
        return x[index % x.shape[0]], index % self.local

    def dispatch(self, x, ids, weights, num_worst_tokens=0):
        received, slots = self._received(x)
        local_ids = torch.full((len(slots), self.k), -1, dtype=torch.long, device=x.device)
        local_ids[:, 0] = slots
        local_weights = torch.zeros(local_ids.shape, dtype=torch.float32, device=x.device)
        local_weights[:, 0] = 1.0
        return Dispatched(received, local_ids, local_weights, x.shape[0]), None

    def combine(self, partial, handle):
        return partial[torch.arange(handle, device=partial.device) % partial.shape[0]], None

    def low_latency_dispatch(self, x, ids, weights, use_fp8=False, recv_stats=None):
        received, slots = self._received(x)
        blocks = received[slots.argsort(stable=True)].view(self.local, self.rows_per_slot, -1)
        count = torch.full((self.local,), self.rows_per_slot, dtype=torch.int32, device=x.device)
        packed_x = quantize_activations(blocks) if use_fp8 else blocks
        return Packed(packed_x, count, x.shape[0], ids, weights), _nothing

    def low_latency_combine(self, out, ids, weights, handle):
        flat = out.flatten(0, 1)
        return flat[torch.arange(handle, device=out.device) % flat.shape[0]], _nothing


def _nothing() -> None:
    return None


@dataclass
class Slice:
    """A slice model, its cache and one microbatch for one phase's layout."""

    model: object
    cache: M.PagedKVCache
    batch: StepBatch

    @classmethod
    def build(
        cls,
        point,
        args,
        device,
        weight_dtype=None,
        context: int = PROMPT,
        seed: int = 0,
        kernels: str = "ours",
        query_len: int = 1,
    ):
        """Rank 0 of `point`: for prefill, a microbatch of prompts of `context` tokens (the
        microbatch's tokens, at most one partial prompt); for decode, a microbatch of requests
        whose first new token attends `context` tokens, `query_len` new tokens each (1: a
        decode step; drafts + 1: a verify step). kernels: the model's
        (`ref_server.kernel_choice`; the exchange is `LayoutExchange`'s whatever they are)."""
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        exchange = LayoutExchange(point, args)
        model = M.from_args(
            args,
            seed=seed,
            dtype=dtype,
            device=device,
            weight_dtype=weight_dtype,
            num_physical_experts=point.physical_experts,
            exchange=exchange,
            kernels=kernels,
        )
        tokens = point.tokens_per_gpu // point.microbatches
        page = 64
        if point.phase == "prefill":
            lens = [context] * (tokens // context) + (
                [tokens % context] if tokens % context else []
            )
            queries, contexts = lens, lens
        else:
            requests = tokens // query_len
            queries, contexts = [query_len] * requests, [context + query_len - 1] * requests
        pages = [-(-c // page) for c in contexts]
        cache = M.PagedKVCache(args, sum(pages), page, torch.bfloat16, device)
        table = torch.zeros(len(pages), max(pages), dtype=torch.int32)
        first = 0
        for row, count in enumerate(pages):
            table[row, :count] = torch.arange(first, first + count)
            first += count
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(2, args.vocab_size, (sum(queries),), generator=g).to(device)
        return cls(model, cache, StepBatch(ids, queries, contexts, table))

    def attention_work(self) -> tuple[float, float]:
        """One layer's attention over the microbatch as the model runs it: FLOPs
        (`ModelArgs.attention_flops`, absorbed where it attends over the latent cache: decode,
        and every step of a sparse model) and the cache bytes it reads at least once (each
        sequence's context rows or, sparse, each query's picked rows and every index key of
        its sequence's context)."""
        args, batch, cache = self.model.args, self.batch, self.cache
        lens = list(zip(batch.query_lens, batch.context_lens, strict=True))
        absorbed = batch.is_decode or args.is_sparse
        flops = sum(args.attention_flops(q, c - q, absorbed) for q, c in lens)
        latent_row = cache.layers[0][0, 0].nbytes
        if not args.is_sparse:
            return flops / args.num_hidden_layers, sum(batch.context_lens) * latent_row
        picked = sum(attended_pairs(q, c - q, args.index_topk) for q, c in lens)
        keys = cache.index_keys[0]
        index_row = keys.values[0, 0].nbytes + keys.scales[0, 0].nbytes
        read = picked * latent_row + sum(batch.context_lens) * index_row
        return flops / args.num_hidden_layers, read


@dataclass(frozen=True)
class Measurement:
    """A slice's measured parts, where they were measured, and its attention's work
    (`Slice.attention_work`)."""

    times: LayerTimes
    device: Device
    attention_flops: float
    attention_kv_bytes: float


def measure(
    point: OperatingPoint,
    slice_name: str,
    device: str,
    weight_dtype: str | None = None,
    reps: int = 5,
    context: int = PROMPT,
    kernels: str = "ours",
    query_len: int = 1,
) -> Measurement:
    """One microbatch's per-part times of `point` on `device` through `kernels` (see module
    docstring); context and query_len as `Slice.build`'s."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    args = slice_args(slice_name)
    where = torch.device(device)
    part = Slice.build(
        point, args, where, weight_dtype, context, kernels=kernels, query_len=query_len
    )
    model, batch = part.model, part.batch
    schedule = point.phase
    every_row = query_len > 1
    inputs = [(batch.input_ids, batch.metadata(part.cache, every_row=every_row))]
    # the sampler draws a token for each row of logits, at the position it would take
    positions = (batch.positions + 1).tolist() if every_row else batch.context_lens
    params = [SamplingParams(temperature=0.8, seed=0)] * len(positions)
    steps, ahead = [], HostAhead(where)
    with torch.no_grad():
        for rep in range(reps + 2):
            recorder = Recorder(cuda=where.type == "cuda")
            with ahead:
                logits = model.run_step(
                    inputs,
                    part.cache,
                    schedule,
                    recorder=recorder,
                    low_latency=point.phase == "decode",
                )
            seconds = _op_seconds(recorder)
            seconds["sampling"] = _timed(where, sample, logits, params, positions)
            if rep >= 2:
                steps.append(seconds)
                ahead.count()
    medians = {name: statistics.median(step[name] for step in steps) for name in steps[0]}
    gpu = torch.cuda.get_device_name(where) if where.type == "cuda" else "cpu"
    requests = len(batch.query_lens)
    if point.phase == "prefill":
        shape = f"{batch.num_tokens} tokens a microbatch in prompts of {context:,}"
    elif every_row:
        shape = (
            f"a verify step: {requests} requests a microbatch of {query_len} new tokens each "
            f"after {context - 1:,}"
        )
    else:
        shape = f"{requests} requests a microbatch at KV {context:,}"
    run = (
        f"{slice_name} slice (hidden {args.hidden_size}), rank 0 of {point.phase} "
        f"EP{point.gpus}, {shape}, "
        f"{weight_dtype or ('bf16' if where.type == 'cuda' else 'float32')} weights, "
        f"median of {reps} eager steps on {gpu}{ahead.note()}; kernels "
        f"{model.kernels.describe()}{_sparse_kernels(args, where)}"
    )
    flops, kv_bytes = part.attention_work()
    times = LayerTimes.measured(run, **_items(medians))
    return Measurement(times, Device(where.type, gpu), flops, kv_bytes)


def _sparse_kernels(args: M.ModelArgs, device: torch.device) -> str:
    """What V3.2's attention ran through: the sparse MLA backend and the indexer's logits."""
    if not args.is_sparse:
        return ""
    indexer = "Triton" if device.type == "cuda" and triton_by_environment() else "torch reference"
    return (
        f", sparse attention through mla_kernels' {mla_kernels.sparse_backend(device)} backend, "
        f"indexer logits through its {indexer}"
    )


class HostAhead:
    """On CUDA, a context in which the stream sleeps while the host enqueues (module
    docstring); elsewhere nothing. `hidden`: whether the last step's enqueueing ended while
    the stream still slept; a step that was not doubles the sleep for the next."""

    def __init__(self, device: torch.device, cycles: int = 20_000_000) -> None:
        self.cuda = device.type == "cuda"
        self.cycles = cycles  # about 10 ms at the H200's 1.98 GHz
        self.hidden = True
        self.timed = self.exposed = 0

    def __enter__(self) -> HostAhead:
        if self.cuda:
            torch.cuda._sleep(self.cycles)
            self.slept = torch.cuda.Event()
            self.slept.record()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.hidden = not self.slept.query()
            if not self.hidden:
                self.cycles *= 2

    def count(self) -> None:
        """Count a timed step."""
        self.timed += 1
        self.exposed += not self.hidden

    def note(self) -> str:
        if not self.cuda:
            return ""
        if self.exposed:
            return (
                f", {self.exposed} of {self.timed} steps with the host's time exposed (a host "
                "sync or a slow enqueue): upper bounds"
            )
        return ", enqueued ahead of the GPU (launch time hidden)"


def _op_seconds(recorder: Recorder) -> dict[str, float]:
    """Seconds of each op by name ("L1.attn.core", "head", ...), summed over its calls."""
    seconds: dict[str, float] = {}
    for event in recorder.events():
        if event["cat"] == "op":
            seconds[event["name"]] = seconds.get(event["name"], 0.0) + event["dur"] / 1e6
    return seconds


def _timed(device: torch.device, fn, *args) -> float:
    """Seconds of fn(*args) on device (CUDA events there)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    fn(*args)
    return time.perf_counter() - begin


def _items(seconds: dict[str, float]) -> dict[str, float]:
    """The projection's parts from op times: layer 0 is the dense layer, layer 1 the MoE
    layer's items (`OPS_OF_ITEM`); the head and sampling once."""
    dense = sum(s for name, s in seconds.items() if name.startswith("L0."))
    moe = {name[3:]: s for name, s in seconds.items() if name.startswith("L1.")}
    items = {
        item: sum(moe[op] for op in ops)
        for item, ops in OPS_OF_ITEM.items()
        if item in LayerTimes.__dataclass_fields__
    }
    return items | {
        "dense_layer": dense,
        "head_and_sampling": seconds["head"] + seconds["sampling"],
    }
