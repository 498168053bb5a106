"""The Mixture-of-Experts MLP: DeepSeek's router, the routed experts, the shared experts.

Each MoE layer is a list of operations (`MoE.operation`) so that two-batch overlap can run one
microbatch's dispatch and combine while the other computes; `MoE.forward` runs them in order.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from overlap_sched import State, run
from ref_server.kernels.activation import silu_mul
from ref_server.kernels.expert_gemm import expert_gemm
from ref_server.kernels.expert_sort import moe_sort_by_expert_and_gather
from ref_server.kernels.expert_swiglu import expert_swiglu, fused_by_environment
from ref_server.kernels.moe import moe_weighted_sum
from ref_server.kernels.routing import moe_route
from ref_server.model.args import ModelArgs
from ref_server.model.expert_location import ExpertLocation
from ref_server.model.expert_parallel import Dispatched, Packed
from ref_server.model.layers import MLP, RowParts


class Gate(nn.Module):
    """Sigmoid scores; the choice adds a per-expert bias and keeps the topk_group groups with the
    best two-expert sums; weights are the unbiased scores, normalized, times the scaling (all
    of it `ref_server::moe_route`, one Triton kernel on CUDA)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(args.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[n, hidden]` to weights `[n, k]` fp32 and expert ids `[n, k]` int64, the best
        choice first."""
        return self.select(self.logits(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x `[n, hidden]` to the router's logits `[n, experts]` fp32 (before the sigmoid).
        Half-precision operands are exact in fp32, so on CUDA a half-precision GEMM with fp32
        accumulation and output (`mm.dtype`, which only CUDA has) gives what an fp32 GEMM
        would, but for the order of the sums, at tensor-core speed."""
        w = self.weight
        if x.is_cuda and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16):
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        return F.linear(x.float(), w.float())

    def select(self, logits: torch.Tensor, real_rows: torch.Tensor | None = None):
        """logits `[n, experts]` fp32 to weights `[n, k]` fp32 and expert ids `[n, k]` int64;
        real_rows `[n]` bool: rows where it is False get ids -1 (no expert) and weights 0."""
        a = self.args
        return moe_route(
            logits,
            self.e_score_correction_bias,
            a.n_group,
            a.topk_group,
            a.num_experts_per_tok,
            a.norm_topk_prob,
            a.routed_scaling_factor,
            real_rows,
        )


class RoutedExperts(nn.Module):
    """What the layouts of a rank's routed experts share: the rows of each expert gathered for
    grouped GEMMs (`grouped`) or given in fixed-shape blocks (`packed`), around `mlp`, each
    expert's SwiGLU MLP, which `Experts` (bf16 or fp32) and `FP8Experts` define. With
    `fused_swiglu` (REF_SERVER_FUSED_SWIGLU=1 when they are built), mlp computes gate, up and
    silu(gate) * up in one operator (`expert_swiglu`), whose result is the same."""

    # Whether `packed` takes a low-latency dispatch's FP8 rows (values, scales) as they arrive.
    takes_fp8_rows = False

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.fused_swiglu = fused_by_environment()

    def mlp(self, x: torch.Tensor, offsets=None, counts=None) -> torch.Tensor:
        """Rows through their experts: x `[m, hidden]` grouped by expert, group g ending at row
        offsets[g] (`[e]` int32), or x `[e, rows, hidden]` with offsets None, of which only
        the first counts[e] rows (`[e]` int32, if given) need be right. Out: x's shape."""
        raise NotImplementedError

    def grouped(self, x, ids, weights) -> torch.Tensor:
        """x `[n, hidden]`; ids `[n, k]` local expert ids (-1: on another rank), weights `[n, k]`:
        each token's weighted sum of its experts' outputs, in x's dtype, through `mlp` over the
        rows sorted by expert (`moe_sort_by_expert_and_gather`, stable), with nothing that waits
        for the GPU: rows for other ranks' experts (-1) sort after every group, which mlp leaves
        unwritten, and `moe_weighted_sum` sums each token's k outputs in fp32 in slot order,
        skipping those (their rows are -1)."""
        _, offsets, rows, sorted_x = moe_sort_by_expert_and_gather(ids, self.num_experts, x)
        return moe_weighted_sum(self.mlp(sorted_x, offsets), rows, weights.float())

    def packed(self, x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        """x `[e, rows, hidden]`, row i of expert e a token for it: each row through its
        expert, unweighted (a low-latency combine weighs them). The shapes are fixed (what CUDA
        graphs need); counts `[e]` int32, each expert's valid rows, lets the GEMMs skip the
        others."""
        return self.mlp(x, counts=counts)


class Experts(RoutedExperts):
    """This rank's routed experts, stacked (SwiGLU MLPs): gate_up_proj `[e, 2 * inter, hidden]`
    (each expert's gate_proj rows, then its up_proj rows: `gate_up_parts`), down_proj
    `[e, hidden, inter]`."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__(num_experts)
        self.gate_up_parts = RowParts({"gate_proj": inter, "up_proj": inter})
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x `[n, hidden]`; ids `[n, k]` local expert ids (-1: on another rank), weights `[n, k]`:
        each token's weighted sum of its experts' outputs. Grouped GEMMs for bf16 on the GPU."""
        if x.is_cuda and x.dtype == torch.bfloat16:
            return self.grouped(x, ids, weights)
        return self.looped(x, ids, weights)

    def looped(self, x, ids, weights) -> torch.Tensor:
        """An expert at a time; each token's outputs summed in slot order as on the GPU, so
        which slot serves a choice leaves the sum alone."""
        n, k = ids.shape
        choices = ids.flatten()
        y = x.new_zeros(n * k, x.shape[1])
        for e in choices[choices >= 0].unique().tolist():
            rows = (choices == e).nonzero().squeeze(1)
            gate, up = F.linear(x[rows // k], self.gate_up_proj[e]).chunk(2, dim=-1)
            y[rows] = F.linear(F.silu(gate) * up, self.down_proj[e])
        rows = torch.arange(n * k, device=x.device).view(n, k).masked_fill(ids < 0, -1)
        return moe_weighted_sum(y, rows, weights.float())

    def mlp(self, x: torch.Tensor, offsets=None, counts=None) -> torch.Tensor:
        w, inter = self.gate_up_proj, self.down_proj.shape[-1]
        if self.fused_swiglu:
            hidden = expert_swiglu(x, None, w, None, inter, offsets, counts, x.dtype)
        else:
            hidden = silu_mul(*expert_gemm(x, w, offsets, counts).chunk(2, dim=-1))
        return expert_gemm(hidden, self.down_proj, offsets, counts)


class MoE(nn.Module):
    """Routed experts (this rank's share of them) plus shared experts. With `expert_parallel`,
    tokens travel to the ranks holding their experts through ep_comm and back.

    As operations (state in: mlp_in `[n, hidden]`, normalized; out: mlp_out, the routed
    experts' output, and mlp_out_shared, the shared experts', which the next norm adds in its
    kernel, `Block`): gate,
    select_experts, dispatch_a (sends), dispatch_b (receives), experts, combine_a (sends back),
    shared_experts, combine_b (receives), output. The two sends return ep_comm's event, or in
    the low-latency mode (state key `low_latency`, decode) its receive hook; the executor waits
    on the event, or calls the hook, where the receiving op reads what was sent.
    """

    def __init__(self, args: ModelArgs, expert_parallel=None, num_physical: int | None = None):
        """num_physical: the layer's expert slots when the instance balances its experts (an
        `ExpertLocation`, at least one slot per expert); None: one slot per expert, fixed."""
        super().__init__()
        self.args = args
        self.expert_parallel = expert_parallel
        rank, size = (0, 1) if expert_parallel is None else expert_parallel.rank_and_size
        slots = (num_physical or args.n_routed_experts) // size
        self.first_slot = rank * slots
        self.location = None
        if num_physical is not None:
            self.location = ExpertLocation(args.n_routed_experts, num_physical, size)
        self.gate = Gate(args)
        self.experts = Experts(slots, args.hidden_size, args.moe_intermediate_size)
        shared = args.moe_intermediate_size * args.n_shared_experts
        self.shared_experts = MLP(args.hidden_size, shared) if args.n_shared_experts else None

    def slot_experts(self) -> list[int]:
        """The logical expert each of this rank's expert slots holds."""
        first, last = self.first_slot, self.first_slot + self.experts.num_experts
        if self.location is None:
            return list(range(first, last))
        return self.location.physical_to_logical[first:last].tolist()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = State(mlp_in=x.reshape(-1, x.shape[-1]))
        run([self.operation(name) for name in OPERATIONS], state)
        shared = state.pop("mlp_out_shared", None)
        out = state.mlp_out if shared is None else state.mlp_out + shared
        return out.view(x.shape)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (the router keeps it when the experts are FP8)."""
        return self.gate.weight.dtype

    def operation(self, name: str):
        return getattr(self, "op_" + name)

    def op_gate(self, state) -> None:
        state.router_logits = self.gate.logits(state.mlp_in)

    def op_select_experts(self, state) -> None:
        """Each choice to one replica of its expert when the layer balances its experts,
        counted here or where the low-latency dispatch receives it. A CUDA graph's padding
        rows (`StepMetadata.real_rows`) go nowhere (-1): no expert computes them."""
        step = state.step if "step" in state else None  # MoE.forward runs without one
        real = None if step is None else step.real_rows
        weights, ids = self.gate.select(state.pop("router_logits"), real)
        if self.location is not None:
            ids = self.location.to_physical(ids)
            if "low_latency" not in state:
                self.location.count(ids)
        state.topk_weights, state.topk_ids = weights, ids

    def op_dispatch_a(self, state):
        x, weights, ids = state.mlp_in, state.pop("topk_weights"), state.pop("topk_ids")
        if self.expert_parallel is None:
            state.dispatched = Dispatched(x, ids, weights, None)
            return None
        if "low_latency" in state:
            received = None if self.location is None else self.location.received
            state.dispatched, hook = self.expert_parallel.low_latency_dispatch(
                x, ids, weights, use_fp8=self.experts.takes_fp8_rows, recv_stats=received
            )
            return hook
        worst = state.num_worst_tokens if "num_worst_tokens" in state else 0
        state.dispatched, event = self.expert_parallel.dispatch(x, ids, weights, worst)
        return event

    def op_dispatch_b(self, state) -> None:
        state.received = state.pop("dispatched")

    def op_experts(self, state) -> None:
        received = state.pop("received")
        if isinstance(received, Packed):
            if isinstance(received.x, tuple):  # FP8 rows, for experts that take them
                out = self.experts.packed(received.x, received.count, self.dtype)
            else:
                out = self.experts.packed(received.x.to(self.dtype), received.count)
        else:
            out = self.experts(received.x.to(self.dtype), received.ids, received.weights)
        state.expert_out = (out, received)

    def op_combine_a(self, state):
        out, received = state.pop("expert_out")
        if self.expert_parallel is None:
            state.combined = out
            return None
        if isinstance(received, Packed):
            state.combined, hook = self.expert_parallel.low_latency_combine(
                out, received.ids, received.weights, received.handle
            )
            return hook
        state.combined, event = self.expert_parallel.combine(out, received.handle)
        return event

    def op_shared_experts(self, state) -> None:
        """On CUDA without expert parallelism, on a stream of their own, joined in `output`.
        That stream waits for the main one as it is when this op runs: in the decode schedule
        (`transformer.SCHEDULES`, CUDA graphs) before `experts`, so their kernels run beside
        the routed experts' (at small batches a chain of short kernels each, more waiting than
        working); in the prefill schedule and `MoE.forward`, after them. With expert
        parallelism the schedules overlap them with the communication."""
        x = state.pop("mlp_in")
        if self.shared_experts is None:
            state.shared_out = None
            return
        if not x.is_cuda or self.expert_parallel is not None:
            state.shared_out = self.shared_experts(x)
            return
        side = side_stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            state.shared_out = self.shared_experts(x)
            done = torch.cuda.Event()  # this microbatch's work only, not a later one's
            done.record(side)
        state.shared_done, state.shared_in = done, x  # x lives until the side stream joins

    def op_combine_b(self, state) -> None:
        state.routed_out = state.pop("combined")

    def op_output(self, state) -> None:
        if "shared_done" in state:
            x = state.pop("shared_in")
            torch.cuda.current_stream(x.device).wait_event(state.pop("shared_done"))
        state.mlp_out, shared = state.pop("routed_out").to(self.dtype), state.pop("shared_out")
        if shared is not None:
            state.mlp_out_shared = shared


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The shared experts' stream on a device (one for every layer: each waits for the main
    stream before it starts, and the main stream for it in `op_output`). Their output, made on
    this stream, is read on the main stream by the next norm without `record_stream`: safe
    because this stream allocates only after waiting for the main stream, which has by then
    queued that read."""
    return torch.cuda.Stream(device)


# The order one batch runs them in.
OPERATIONS = (
    "gate",
    "select_experts",
    "dispatch_a",
    "dispatch_b",
    "experts",
    "combine_a",
    "shared_experts",
    "combine_b",
    "output",
)
