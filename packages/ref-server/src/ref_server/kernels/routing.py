"""The MoE router's expert choice as one operator, `ref_server::moe_route`, with a Triton
kernel on CUDA.

The math (DeepSeek-V3's noaux_tc routing), per token, from the router GEMM's fp32 logits:
scores = sigmoid(logits); choice = scores + bias; the experts split in n_group groups of
consecutive ids, each group scored by the sum of its best two choices; the topk_group best
groups kept; the k best choices among the kept groups' experts taken; their weights the
unbiased scores, divided by their sum (plus 1e-20) if norm_topk_prob, times scaling.

Slot order, shared by both implementations: slot j holds the expert of the (j+1)-th best
choice, ties going to the lower expert id; groups tie the same way (the lower group id is
kept). (torch's topk breaks ties in no documented order, so the reference sorts stably.)

NaN: a choice (or group score) that is NaN counts as -inf, below every other value and tied
with -inf (so the lower id goes first): a NaN logit or bias is taken only where fewer than k
experts of the kept groups have better choices; such an expert's weight is NaN (so are the
token's others with norm_topk_prob). A token of NaN logits gets ids 0..k-1. ±inf logits are
scores of 1 and 0, routed as any others. Whatever the values, the k ids are distinct experts of
kept groups, in [0, E).

The default implementation, on any device, is that math in torch. On CUDA one Triton kernel
(`triton_moe_route`) replaces its fifteen or so kernels: each program holds one token's
experts in registers as a [groups, experts per group] tile and runs the group ranking and the
k rounds of argmax there, reading the logits and bias once and writing k weights and ids. The
ids are the reference's wherever no two choices lie within rounding of each other (the
sigmoids may differ by an ulp); the weights agree to fp32 rounding (only the order of the
normalizing sum differs). Nothing waits for the device and the token count is no argument of
the kernel (only the grid's size), so CUDA graphs can capture it after one warm-up call, which
compiles it for the routing configuration.

There is no autograd formula. triton is imported on the first CUDA call only, so that this
module imports without it.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ref_server.kernels.pdl import launch_options

BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Most experts the kernel holds in registers (32 per thread of its 1 to 4 warps); more take the
# default implementation on CUDA too.
MAX_EXPERTS = 1024


def check_inputs(
    logits: torch.Tensor,
    bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    k: int,
    real_rows: torch.Tensor | None = None,
) -> None:
    """ValueError naming what is wrong, if anything (see `moe_route` for valid arguments)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, experts], got {logits.dim()} dims")
    if logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32, got {logits.dtype}")
    experts = logits.shape[1]
    if tuple(bias.shape) != (experts,):
        raise ValueError(
            f"bias must be [{experts}] (one per expert of logits), got {tuple(bias.shape)}"
        )
    if bias.dtype not in BIAS_DTYPES:
        raise ValueError(f"bias must be one of {BIAS_DTYPES}, got {bias.dtype}")
    if bias.device != logits.device:
        raise ValueError(
            f"logits and bias must be on one device: logits is on {logits.device}, "
            f"bias on {bias.device}"
        )
    if n_group < 1 or experts % n_group:
        raise ValueError(f"n_group ({n_group}) must divide the {experts} experts")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group ({topk_group}) must be in 1..n_group ({n_group})")
    group_size = experts // n_group
    if n_group > 1 and group_size < 2:
        raise ValueError(f"groups score their best two experts: {n_group} groups of 1 expert")
    if not 1 <= k <= topk_group * group_size:
        raise ValueError(
            f"k ({k}) must be in 1..the experts of the kept groups ({topk_group} x {group_size})"
        )
    if real_rows is not None:
        n = logits.shape[0]
        if real_rows.dtype != torch.bool or tuple(real_rows.shape) != (n,):
            raise ValueError(
                f"real_rows must be [{n}] bool (one per row of logits), got "
                f"{tuple(real_rows.shape)} {real_rows.dtype}"
            )
        if real_rows.device != logits.device:
            raise ValueError(
                f"logits and real_rows must be on one device: logits is on {logits.device}, "
                f"real_rows on {real_rows.device}"
            )


def _nan_last(values: torch.Tensor) -> torch.Tensor:
    return torch.where(values.isnan(), float("-inf"), values)


def _descending(values: torch.Tensor) -> torch.Tensor:
    """The indices that sort each row of values in descending order, ties to the lower index."""
    return values.sort(dim=-1, descending=True, stable=True).indices


def _moe_route_reference(
    logits: torch.Tensor,
    bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    k: int,
    norm_topk_prob: bool,
    scaling: float,
    real_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k experts and their weights: logits `[n, E]` fp32 (the router GEMM's,
    before the sigmoid), bias `[E]` (e_score_correction_bias: fp32, bf16 or fp16, taken as
    fp32); E divisible by n_group, 1 <= topk_group <= n_group, 1 <= k <= topk_group * E /
    n_group; real_rows `[n]` bool or None (every row real). Out: weights `[n, k]` fp32 and
    ids `[n, k]` int64, both contiguous, slot j the (j+1)-th best choice; a row that is not
    real gets weights 0 and ids -1. See the module docstring for the math, the ties and NaN."""
    check_inputs(logits, bias, n_group, topk_group, k, real_rows)
    n, experts = logits.shape
    scores = logits.sigmoid()
    choice = _nan_last(scores + bias.float())
    order = _descending(choice)
    if topk_group < n_group:
        group_size = experts // n_group
        group_scores = choice.view(n, n_group, group_size).topk(2, dim=-1).values.sum(dim=-1)
        kept_groups = _descending(_nan_last(group_scores))[:, :topk_group]
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
        dropped = ~kept.repeat_interleave(group_size, dim=1)
        # the kept groups' experts first, still in descending order of choice (a stable sort);
        # masking the others with -inf would let them tie with kept experts of choice -inf
        order = order.gather(1, dropped.gather(1, order).byte().sort(dim=-1, stable=True).indices)
    ids = order[:, :k].contiguous()
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * scaling
    if real_rows is not None:
        padding = ~real_rows[:, None]
        weights, ids = weights.masked_fill(padding, 0.0), ids.masked_fill(padding, -1)
    return weights, ids


moe_route = torch.library.custom_op("ref_server::moe_route", _moe_route_reference, mutates_args=())


@moe_route.register_fake
def _(logits, bias, n_group, topk_group, k, norm_topk_prob, scaling, real_rows=None):
    check_inputs(logits, bias, n_group, topk_group, k, real_rows)
    n = logits.shape[0]
    return logits.new_empty(n, k), logits.new_empty(n, k, dtype=torch.int64)


@moe_route.register_kernel("cuda")
def _(logits, bias, n_group, topk_group, k, norm_topk_prob, scaling, real_rows=None):
    args = (logits, bias, n_group, topk_group, k, norm_topk_prob, scaling, real_rows)
    if logits.dim() == 2 and logits.shape[1] <= MAX_EXPERTS:
        return triton_moe_route(*args)
    return _moe_route_reference(*args)


def triton_moe_route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    k: int,
    norm_topk_prob: bool,
    scaling: float,
    real_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_route` through the Triton kernel: the same arguments, E at most MAX_EXPERTS, on
    one CUDA device (or on the CPU with TRITON_INTERPRET=1). Rows of logits may lie any stride
    apart; a last dim that is not contiguous is copied first."""
    check_inputs(logits, bias, n_group, topk_group, k, real_rows)
    n, experts = logits.shape
    if experts > MAX_EXPERTS:
        raise ValueError(f"the kernel takes at most {MAX_EXPERTS} experts, got {experts}")
    weights = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    if n == 0:
        return weights, ids
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    # with every group kept, the groups rank nothing: one group of all experts
    groups = n_group if topk_group < n_group else 1
    group_size = experts // groups
    triton, kernel = _triton_kernel()
    tile = triton.next_power_of_2(groups) * triton.next_power_of_2(group_size)
    device = torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext()
    with device:
        kernel[(n,)](
            logits,
            bias.contiguous(),
            weights,
            ids,
            real_rows,
            logits.stride(0),
            scaling,
            GROUPS=groups,
            GROUP_SIZE=group_size,
            TOPK_GROUP=topk_group,
            K=k,
            NORMALIZE=norm_topk_prob,
            HAS_REAL_ROWS=real_rows is not None,
            LIBDEVICE_EXP=logits.is_cuda,
            GROUPS_BLOCK=triton.next_power_of_2(groups),
            GROUP_BLOCK=triton.next_power_of_2(group_size),
            K_BLOCK=triton.next_power_of_2(k),
            num_warps=min(max(tile // 256, 1), 4),
            **launch_options(logits.device),
        )
    return weights, ids


tl = None  # triton.language, once _triton_kernel() has imported it


@functools.cache
def _triton_kernel():
    """(triton, the compiled `_moe_route_kernel`): triton is imported here, on first use."""
    global tl
    import triton
    import triton.language as tl

    return triton, triton.jit(_moe_route_kernel)


def _moe_route_kernel(
    logits,  # fp32 [n, GROUPS * GROUP_SIZE], token t at logits + t * logits_stride, contiguous
    bias,  # [GROUPS * GROUP_SIZE] fp32, bf16 or fp16, contiguous
    weights,  # fp32 [n, K], contiguous
    ids,  # int64 [n, K], contiguous
    real_rows,  # bool [n] (with HAS_REAL_ROWS): rows that are tokens
    logits_stride,
    scaling,  # fp32
    GROUPS: tl.constexpr,  # groups to rank (1: every group is kept)
    GROUP_SIZE: tl.constexpr,  # experts per group
    TOPK_GROUP: tl.constexpr,  # groups kept
    K: tl.constexpr,  # experts taken
    NORMALIZE: tl.constexpr,  # norm_topk_prob
    HAS_REAL_ROWS: tl.constexpr,
    # libdevice's expf (tl.exp is ex2.approx, a few ulp off for large |x|); the interpreter,
    # which has no libdevice, takes numpy's exp
    LIBDEVICE_EXP: tl.constexpr,
    GROUPS_BLOCK: tl.constexpr,  # the powers of two at or above GROUPS, GROUP_SIZE and K
    GROUP_BLOCK: tl.constexpr,
    K_BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (pdl.py)
):
    """Program t routes token t: the k best choices (score + bias) of the experts in the
    TOPK_GROUP groups of best top-two sums, ties to the lower id, NaN as -inf; their scores,
    normalized, times scaling; for a row that is no token, weights 0 and ids -1. See the
    module docstring."""
    if PDL:  # wait for the kernel before (pdl.py), then let the next one be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    group = tl.arange(0, GROUPS_BLOCK)
    member = tl.arange(0, GROUP_BLOCK)[None, :]
    expert = group[:, None] * GROUP_SIZE + member  # [GROUPS_BLOCK, GROUP_BLOCK]
    real = (group[:, None] < GROUPS) & (member < GROUP_SIZE)
    x = tl.load(logits + token * logits_stride + expert, mask=real, other=0.0)
    exp = tl.extra.cuda.libdevice.exp(-x) if LIBDEVICE_EXP else tl.exp(-x)
    scores = tl.math.div_rn(1.0, 1.0 + exp)
    choice = scores + tl.load(bias + expert, mask=real, other=0.0).to(tl.float32)
    choice = tl.where(choice == choice, choice, float("-inf"))  # NaN counts as -inf
    # Each argmax below takes, of the best values, the lowest index; it looks only at eligible
    # entries, so a value of -inf (NaN's too) still beats anything ineligible.
    eligible = real
    if GROUPS > 1:
        ranked = tl.where(real, choice, float("-inf"))
        best = tl.max(ranked, axis=1)
        first = tl.min(tl.where(ranked == best[:, None], member, GROUP_BLOCK), axis=1)
        second = tl.max(tl.where(member == first[:, None], float("-inf"), ranked), axis=1)
        group_score = best + second
        group_score = tl.where(group_score == group_score, group_score, float("-inf"))
        open_group = group < GROUPS
        kept = group < 0
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(tl.where(open_group, group_score, float("-inf")), axis=0)
            pick = tl.min(tl.where(open_group & (group_score == top), group, GROUPS_BLOCK), axis=0)
            kept = kept | (group == pick)
            open_group = open_group & (group != pick)
        eligible = real & kept[:, None]
    slot = tl.arange(0, K_BLOCK)
    routed = tl.zeros([K_BLOCK], dtype=tl.float32)
    routed_ids = tl.zeros([K_BLOCK], dtype=tl.int32)
    for j in tl.static_range(K):
        top = tl.max(tl.where(eligible, choice, float("-inf")))
        pick = tl.min(tl.where(eligible & (choice == top), expert, GROUPS_BLOCK * GROUP_BLOCK))
        taken = real & (expert == pick)  # padding columns alias the next group's ids
        score = tl.sum(tl.where(taken, scores, 0.0))  # the one score, exactly
        routed = tl.where(slot == j, score, routed)
        routed_ids = tl.where(slot == j, pick, routed_ids)
        eligible = eligible & ~taken
    if NORMALIZE:
        routed = tl.math.div_rn(routed, tl.sum(routed, axis=0) + 1e-20)
    routed = routed * scaling
    if HAS_REAL_ROWS:
        real_row = tl.load(real_rows + token)
        routed = tl.where(real_row, routed, 0.0)
        routed_ids = tl.where(real_row, routed_ids, -1)
    in_k = slot < K
    tl.store(weights + token * K + slot, routed, mask=in_k)
    tl.store(ids + token * K + slot, routed_ids.to(tl.int64), mask=in_k)
