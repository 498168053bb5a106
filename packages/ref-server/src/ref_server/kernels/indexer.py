"""DeepSeek-V3.2's lightning indexer: its logits over the cached keys, and the top-k of them that
sparse attention then attends to.

For a query token t with index heads h (V3.2: 64 of dim 128), e4m3 queries q[t, h] and fp32
weights w[t, h] (the softmax scale, 1/sqrt(heads) and q's quantization scale folded in), and
e4m3 keys k[s] with one fp32 scale each:

    logits[t, s] = k_scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])

over the keys t may see, -inf elsewhere. Two forms:
- `index_logits(q [t, h, d], weights [t, h], k [n, d], k_scale [n], ks [t], ke [t])` -> fp32
  `[t, n]`: query i sees the contiguous keys [ks[i], ke[i]) (prefill: the sequences of a step
  packed on one axis, each query its sequence's keys up to itself).
- `index_logits_paged(q [b, s_q, h, d], weights [b, s_q, h], k_cache [pages, page_size, d],
  k_scale [pages, page_size], block_table [b, max_pages], seqlens [b])` -> fp32
  `[b, s_q, max_pages * page_size]` (decode): the key cache is two tensors paged as the latent
  cache is, e4m3 values and fp32 scales; seqlens counts each sequence's cached tokens, its s_q
  new ones included, which are the queries: query i of sequence j sees positions
  [0, seqlens[j] - s_q + i].
Ranges are clipped to the keys there are (a sequence shorter than s_q leaves its first queries
all -inf), so no value is checked on the host and both can be captured in a CUDA graph; the
block table is read only for positions a query sees.

`index_topk(logits, k)` picks each row's k largest logits (int32 positions, -1 where fewer are
finite), and `cache_slots` turns decode's positions into the cache slots (page * page_size +
offset) that sparse MLA reads.

Implementations: plain torch in fp32 on any device, the keys in chunks so that no intermediate
outgrows 2^26 values (`_reference_*`), and on CUDA where Triton is installed (unless
REF_SERVER_INDEXER_TRITON=0; =1 insists on it) one Triton kernel (`_logits_kernel`): a program
takes a few query tokens of a sequence (up to 128 token-heads: at V3.2's 64 heads, two) and walks
its share of the key axis in tiles of 128 keys, each tile one FP8 `tl.dot` of the keys against
all the tokens' heads, then ReLU, the weighted sum over heads and the keys' scales. triton is
imported on the first call that launches it. NOTES.md has its measurements. On Hopper its FP8
dots keep fewer bits than fp32, so its logits differ from the exact ones by up to
`logits_error_bound` (a few in 10^5 of the terms' magnitudes): near-ties in `index_topk` may then
pick other keys than an exact computation would.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch

from ref_server.kernels.pdl import launch_options

FP8 = torch.float8_e4m3fn
SWITCH = "REF_SERVER_INDEXER_TRITON"
REFERENCE_CHUNK_VALUES = 1 << 26  # the reference's largest intermediate, in fp32 values
BLOCK_N = 128  # keys a tile
MAX_DOT_ROWS = 128  # token-heads (the dot's columns) a program takes, where s_q has as many
TARGET_PROGRAMS = 4096  # a program walks more tiles of keys only where there are more than these


def triton_by_environment() -> bool:
    """Whether CUDA tensors take the Triton kernel: REF_SERVER_INDEXER_TRITON "1" yes, "0" no,
    unset where Triton is installed; ValueError naming the variable on anything else."""
    value = os.environ.get(SWITCH)
    if value is None:
        return importlib.util.find_spec("triton") is not None
    if value not in ("0", "1"):
        raise ValueError(f"{SWITCH} must be 0 or 1, got {value!r}")
    return value == "1"


# ---- argument checks, shared by every implementation ----


def _check(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple) -> None:
    """ValueError naming the argument unless it has this dtype and shape (None: any size)."""
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    if tensor.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(tensor.shape, shape, strict=True)
    ):
        wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must be {wanted}, got {list(tensor.shape)}")


def _check_devices(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all arguments must be on one device, got {devices}")


def check_ragged(q, weights, k, k_scale, ks, ke) -> None:
    """ValueError naming the argument unless q e4m3 [t, h, d], weights fp32 [t, h], k e4m3
    [n, d], k_scale fp32 [n], ks and ke int32 [t]."""
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, dim], got {list(q.shape)}")
    t, h, d = q.shape
    _check("q", q, FP8, (t, h, d))
    _check("weights", weights, torch.float32, (t, h))
    _check("k", k, FP8, (None, d))
    _check("k_scale", k_scale, torch.float32, (k.shape[0],))
    _check("ks", ks, torch.int32, (t,))
    _check("ke", ke, torch.int32, (t,))
    _check_devices(q=q, weights=weights, k=k, k_scale=k_scale, ks=ks, ke=ke)


def check_paged(q, weights, k_cache, k_scale, block_table, seqlens) -> None:
    """ValueError naming the argument unless q e4m3 [b, s_q, h, d], weights fp32 [b, s_q, h],
    k_cache e4m3 [pages, page_size, d], k_scale fp32 [pages, page_size], block_table int32
    [b, max_pages], seqlens int32 [b]."""
    if q.dim() != 4:
        raise ValueError(f"q must be [batch, s_q, heads, dim], got {list(q.shape)}")
    b, s_q, h, d = q.shape
    _check("q", q, FP8, (b, s_q, h, d))
    _check("weights", weights, torch.float32, (b, s_q, h))
    _check("k_cache", k_cache, FP8, (None, None, d))
    _check("k_scale", k_scale, torch.float32, tuple(k_cache.shape[:2]))
    _check("block_table", block_table, torch.int32, (b, None))
    _check("seqlens", seqlens, torch.int32, (b,))
    _check_devices(
        q=q, weights=weights, k_cache=k_cache, k_scale=k_scale, block_table=block_table,
        seqlens=seqlens,
    )  # fmt: skip


def paged_width(k_cache: torch.Tensor, block_table: torch.Tensor) -> int:
    """The paged logits' last dimension: every position the block table can hold."""
    return block_table.shape[1] * k_cache.shape[1]


# ---- the reference: plain torch in fp32 ----


def _weighted_relu(q, weights, keys, scales) -> torch.Tensor:
    """fp32 `[..., tokens, keys]`: scales * sum_h weights * relu(q . keys), for q `[..., tokens,
    h, d]`, weights `[..., tokens, h]`, keys `[..., keys, d]` and scales `[..., keys]`."""
    scores = torch.einsum("...thd,...kd->...thk", q.float(), keys.float()).relu_()
    return torch.einsum("...thk,...th->...tk", scores, weights) * scales[..., None, :]


def _chunk(rows: int, width: int) -> int:
    return max(1, min(width, REFERENCE_CHUNK_VALUES // max(rows, 1)))


def _reference_ragged(q, weights, k, k_scale, ks, ke) -> torch.Tensor:
    t, h, _ = q.shape
    n = k.shape[0]
    logits = torch.empty(t, n, dtype=torch.float32, device=q.device)
    step = _chunk(t * h, n)
    for start in range(0, n, step):
        positions = torch.arange(start, min(start + step, n), device=q.device)
        block = _weighted_relu(q, weights, k[positions], k_scale[positions])
        seen = (positions >= ks[:, None]) & (positions < ke[:, None])
        logits[:, positions] = block.masked_fill(~seen, float("-inf"))
    return logits


def _reference_paged(q, weights, k_cache, k_scale, block_table, seqlens) -> torch.Tensor:
    b, s_q, h, _ = q.shape
    page_size = k_cache.shape[1]
    width = paged_width(k_cache, block_table)
    logits = torch.empty(b, s_q, width, dtype=torch.float32, device=q.device)
    ends = seqlens[:, None] - s_q + 1 + torch.arange(s_q, device=q.device)  # [b, s_q]
    step = _chunk(b * s_q * h, width)
    for start in range(0, width, step):
        positions = torch.arange(start, min(start + step, width), device=q.device)
        seen = positions < ends[..., None]  # [b, s_q, chunk]
        # pages no query sees may hold anything (padding): read page 0 there instead
        pages = block_table[:, positions // page_size].masked_fill(~seen.any(1), 0).long()
        offsets = positions % page_size
        block = _weighted_relu(q, weights, k_cache[pages, offsets], k_scale[pages, offsets])
        logits[..., positions] = block.masked_fill(~seen, float("-inf"))
    return logits


# ---- the operators ----


@torch.library.custom_op("ref_server::index_logits", mutates_args=())
def index_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
) -> torch.Tensor:
    """The indexer's logits `[t, n]` fp32 of q e4m3 `[t, h, d]` with weights fp32 `[t, h]` over
    keys k e4m3 `[n, d]` with scales fp32 `[n]`, query i seeing keys [ks[i], ke[i]) (int32
    `[t]` each), -inf elsewhere (module docstring). ValueError naming a wrong argument.

    This body is the reference, on any device."""
    check_ragged(q, weights, k, k_scale, ks, ke)
    return _reference_ragged(q, weights, k, k_scale, ks, ke)


@index_logits.register_fake
def _(q, weights, k, k_scale, ks, ke):
    check_ragged(q, weights, k, k_scale, ks, ke)
    return q.new_empty((q.shape[0], k.shape[0]), dtype=torch.float32)


@index_logits.register_kernel("cuda")
def _(q, weights, k, k_scale, ks, ke):
    if triton_by_environment():
        return triton_index_logits(q, weights, k, k_scale, ks, ke)
    check_ragged(q, weights, k, k_scale, ks, ke)
    return _reference_ragged(q, weights, k, k_scale, ks, ke)


@torch.library.custom_op("ref_server::index_logits_paged", mutates_args=())
def index_logits_paged(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    k_scale: torch.Tensor,
    block_table: torch.Tensor,
    seqlens: torch.Tensor,
) -> torch.Tensor:
    """The indexer's logits `[b, s_q, max_pages * page_size]` fp32 of q e4m3 `[b, s_q, h, d]`
    with weights fp32 `[b, s_q, h]` over the paged keys k_cache e4m3 `[pages, page_size, d]`
    with scales fp32 `[pages, page_size]`, through block_table int32 `[b, max_pages]`; seqlens
    int32 `[b]` counts each sequence's tokens, its s_q queries last; -inf past each query's
    position (module docstring). ValueError naming a wrong argument.

    This body is the reference, on any device."""
    check_paged(q, weights, k_cache, k_scale, block_table, seqlens)
    return _reference_paged(q, weights, k_cache, k_scale, block_table, seqlens)


@index_logits_paged.register_fake
def _(q, weights, k_cache, k_scale, block_table, seqlens):
    check_paged(q, weights, k_cache, k_scale, block_table, seqlens)
    b, s_q = q.shape[:2]
    return q.new_empty((b, s_q, paged_width(k_cache, block_table)), dtype=torch.float32)


@index_logits_paged.register_kernel("cuda")
def _(q, weights, k_cache, k_scale, block_table, seqlens):
    if triton_by_environment():
        return triton_index_logits_paged(q, weights, k_cache, k_scale, block_table, seqlens)
    check_paged(q, weights, k_cache, k_scale, block_table, seqlens)
    return _reference_paged(q, weights, k_cache, k_scale, block_table, seqlens)


# Hopper's FP8 tensor cores add each 32 products of a dot to the running sum aligned to the
# largest and truncated to 13 fraction bits (an e8m13 accumulator; DeepSeek-V3's report, 3.3.2:
# "around 14 bits"), so a logit's error follows its terms' magnitudes, not its value. Those
# truncations, of both signs over 4 steps and 64 heads, came to about 2^-16 of the magnitudes at
# most on an H100 (an emulation of that accumulator reproduces its errors; worst of 140,000
# logits 2^-15.9): 2^-13 leaves a 7-fold margin, and is far less than a head, a key or a scale
# gone wrong moves a logit by.
FP8_DOT_UNIT = 2.0**-13
FP32_UNIT = 2.0**-24


def _magnitude(x: torch.Tensor) -> torch.Tensor:
    """|x| of e4m3 values, exactly (the sign bit cleared), on any device."""
    return (x.view(torch.uint8) & 0x7F).view(FP8)


def logits_error_bound(logits_op, q, weights, keys, k_scale, *ranges) -> torch.Tensor:
    """fp32, as logits_op's logits: how far the Triton kernel's logits may be from the exact
    ones, each: FP8_DOT_UNIT of its terms' magnitude, k_scale[s] * sum_h |w[t, h]| *
    sum_d |q[t, h, d] k[s, d]| (logits_op, `index_logits` or `index_logits_paged`, of the
    arguments' absolute values, whose ReLU then changes nothing; on CUDA with
    REF_SERVER_INDEXER_TRITON=0, or their references `_reference_*`), plus fp32's worst rounding
    of the sums over dim and heads; -inf where the logits are. ranges: logits_op's last
    arguments (ks, ke or block_table, seqlens)."""
    magnitudes = logits_op(_magnitude(q), weights.abs(), _magnitude(keys), k_scale.abs(), *ranges)
    heads, dim = q.shape[-2:]
    return magnitudes * (FP8_DOT_UNIT + (dim + heads) * FP32_UNIT)


def index_topk(logits: torch.Tensor, k: int = 2048) -> torch.Tensor:
    """int32 `[..., k]`: the positions of the k largest logits of each row of logits fp32
    `[..., width]`, in no particular order; -1 in the places past the row's finite logits (rows
    with fewer than k, or narrower than k). Among equal logits at the k-th place any may be
    taken. torch.topk does the selection."""
    if logits.dim() == 0 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be fp32 [..., width], got {logits.dtype} {logits.shape}")
    if k < 1:
        raise ValueError(f"k must be positive, got {k}")
    width = logits.shape[-1]
    values, positions = logits.topk(min(k, width), dim=-1, sorted=False)
    positions = positions.int().masked_fill_(values == float("-inf"), -1)
    return torch.nn.functional.pad(positions, (0, k - positions.shape[-1]), value=-1)


def cache_slots(positions: torch.Tensor, block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """int32 slots `[b, ...]` (page * page_size + offset, as sparse MLA's indices take them) of
    positions int32 `[b, ...]` in each sequence, through block_table int32 `[b, max_pages]`;
    -1 stays -1."""
    if positions.dtype != torch.int32 or positions.dim() == 0:
        raise ValueError(f"positions must be int32 [b, ...], got {positions.dtype}")
    _check("block_table", block_table, torch.int32, (positions.shape[0], None))
    if page_size < 1:
        raise ValueError(f"page_size must be positive, got {page_size}")
    flat = positions.reshape(positions.shape[0], -1)
    valid = flat >= 0
    pages = block_table.gather(1, torch.where(valid, flat // page_size, 0).long())
    slots = torch.where(valid, pages * page_size + flat % page_size, -1)
    return slots.view(positions.shape)


# ---- the Triton kernel ----


def triton_index_logits(q, weights, k, k_scale, ks, ke) -> torch.Tensor:
    """`index_logits` through the Triton kernel, on CUDA (or on the CPU under
    TRITON_INTERPRET=1)."""
    check_ragged(q, weights, k, k_scale, ks, ke)
    t, h, d = q.shape
    logits = torch.empty(t, k.shape[0], dtype=torch.float32, device=q.device)
    _launch(q.view(1, t, h, d), weights, k, k_scale, None, None, ks, ke, 1, logits)
    return logits


def triton_index_logits_paged(q, weights, k_cache, k_scale, block_table, seqlens) -> torch.Tensor:
    """`index_logits_paged` through the Triton kernel, on CUDA (or on the CPU under
    TRITON_INTERPRET=1)."""
    check_paged(q, weights, k_cache, k_scale, block_table, seqlens)
    b, s_q = q.shape[:2]
    width = paged_width(k_cache, block_table)
    logits = torch.empty(b, s_q, width, dtype=torch.float32, device=q.device)
    page_size = k_cache.shape[1]
    keys, scales = k_cache.flatten(0, 1), k_scale.flatten(0, 1)
    _launch(q, weights, keys, scales, block_table, seqlens, None, None, page_size, logits)
    return logits


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _launch(q, weights, keys, scales, block_table, seqlens, ks, ke, page_size, logits) -> None:
    """One launch of `_logits_kernel`: q `[b, s_q, h, d]`, logits `[b * s_q, width]`; paged
    (block_table and seqlens given) or ragged (ks and ke given, b = 1)."""
    b, s_q, heads, dim = q.shape
    width = logits.shape[-1]
    if logits.numel() == 0:
        return
    paged = block_table is not None
    max_pages = block_table.shape[1] if paged else 0
    if paged:
        ks = ke = seqlens  # the kernel takes some tensor for the arguments it does not read
    else:
        block_table = seqlens = ks
    q, weights, keys, scales, block_table, seqlens, ks, ke = (
        x.contiguous() for x in (q, weights, keys, scales, block_table, seqlens, ks, ke)
    )
    heads_p2 = _pow2(heads)
    # token-heads: at least 16 (tl.dot's least), at most MAX_DOT_ROWS where s_q has them
    q_tokens = max(1, 16 // heads_p2, min(_pow2(s_q), MAX_DOT_ROWS // heads_p2))
    q_blocks = -(-s_q // q_tokens)
    tiles = -(-width // BLOCK_N)
    tiles_a_program = _pow2(max(1, b * q_blocks * tiles // TARGET_PROGRAMS))
    grid = (b * q_blocks, -(-tiles // tiles_a_program))
    kernel = _triton_kernel()
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        kernel[grid](
            q, weights, keys, scales, block_table, max_pages, seqlens, ks, ke,
            logits, s_q, heads, dim, width, keys.shape[0], page_size, PAGED=paged,
            HEADS=heads_p2, DIM=max(32, _pow2(dim)), Q_TOKENS=q_tokens, BLOCK_N=BLOCK_N,
            TILES_A_PROGRAM=tiles_a_program, num_warps=4 if q_tokens * heads_p2 <= 128 else 8,
            **launch_options(q.device),
        )  # fmt: skip


tl = None  # triton.language, once _triton_kernel() has imported it


@functools.cache
def _triton_kernel():
    """The compiled `_logits_kernel`: triton is imported here, on first use. Sizes are not
    specialized on (a decode batch or context first seen after the warm-up would compile
    again)."""
    global tl
    import triton
    import triton.language as tl

    return triton.jit(
        _logits_kernel,
        do_not_specialize=["max_pages", "s_q", "width", "key_rows"],
    )


def _logits_kernel(
    q,  # e4m3 [b, s_q, heads, dim] contiguous
    weights,  # fp32 [b, s_q, heads] contiguous
    keys,  # e4m3 [key_rows, dim] contiguous; paged: page p's slot o at row p * page_size + o
    scales,  # fp32 [key_rows]
    block_table,  # int32 [b, max_pages] contiguous (paged only)
    max_pages,
    seqlens,  # int32 [b] (paged only)
    starts,  # int32 [s_q]: each query's first key (ragged only, b = 1)
    ends,  # int32 [s_q]: past each query's last key (ragged only)
    logits,  # fp32 [b * s_q, width] contiguous
    s_q,
    heads,
    dim,
    width,
    key_rows,
    page_size,
    PAGED: tl.constexpr,
    HEADS: tl.constexpr,  # heads rounded up to a power of two
    DIM: tl.constexpr,  # dim rounded up to a power of two, at least 32
    Q_TOKENS: tl.constexpr,  # query tokens a program
    BLOCK_N: tl.constexpr,  # keys a tile
    TILES_A_PROGRAM: tl.constexpr,  # a power of two
    PDL: tl.constexpr,  # programmatic dependent launch (pdl.py)
):
    if PDL:  # wait for the kernel before (pdl.py), then let the next one be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    batch = tl.program_id(0) // tl.cdiv(s_q, Q_TOKENS)
    first_token = tl.program_id(0) % tl.cdiv(s_q, Q_TOKENS) * Q_TOKENS
    tokens = first_token + tl.arange(0, Q_TOKENS)  # within the sequence
    token_ok = tokens < s_q
    rows = (batch * s_q + tokens).to(tl.int64)
    if PAGED:
        lo = tl.zeros([Q_TOKENS], tl.int32)
        hi = tl.load(seqlens + batch) - s_q + 1 + tokens
    else:
        lo = tl.maximum(tl.load(starts + tokens, mask=token_ok, other=0), 0)
        hi = tl.load(ends + tokens, mask=token_ok, other=0)
    hi = tl.where(token_ok, tl.maximum(tl.minimum(hi, width), 0), 0)
    lo = tl.where(token_ok, lo, width)
    first_seen = tl.min(lo, 0) // BLOCK_N  # the program's first and last tiles with a key seen
    last_seen = tl.cdiv(tl.max(hi, 0), BLOCK_N)

    # all heads of the program's tokens: the columns of each tile's dot
    dot_rows = tl.arange(0, Q_TOKENS * HEADS)
    head = dot_rows % HEADS
    dot_tokens = first_token + dot_rows // HEADS
    row_ok = (head < heads) & (dot_tokens < s_q)
    q_rows = (batch * s_q + dot_tokens).to(tl.int64) * heads + head
    channels = tl.arange(0, DIM)
    q_tile = tl.load(
        q + q_rows[:, None] * dim + channels[None, :],
        mask=row_ok[:, None] & (channels < dim)[None, :],
        other=0.0,
    )
    w = tl.load(weights + q_rows, mask=row_ok, other=0.0)

    q_t = tl.trans(q_tile)  # the keys are the dot's rows: the sum over heads stays in a thread
    # A constexpr bound: Triton 3.6's interpreter takes no tensor for one (with numpy 2.4).
    for i in tl.range(TILES_A_PROGRAM, num_stages=3):
        tile = tl.program_id(1) * TILES_A_PROGRAM + i
        positions = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        # A prefill's causal ranges leave many tiles unseen by all of a program's queries: it
        # skips them. Decode seldom has such tiles, and its loop, without the branch, is
        # software-pipelined.
        any_seen = True if PAGED else (tile >= first_seen) & (tile < last_seen)
        if any_seen:
            wanted = (positions >= tl.min(lo, 0)) & (positions < tl.max(hi, 0))
            if PAGED:
                page = tl.load(
                    block_table + batch * max_pages + positions // page_size, mask=wanted, other=0
                )
                key_ids = page.to(tl.int64) * page_size + positions % page_size
            else:
                key_ids = positions.to(tl.int64)
            wanted &= (key_ids >= 0) & (key_ids < key_rows)  # whatever the block table holds
            k_tile = tl.load(
                keys + key_ids[:, None] * dim + channels[None, :],
                mask=wanted[:, None] & (channels < dim)[None, :],
                other=0.0,
            )
            k_scale = tl.load(scales + key_ids, mask=wanted, other=0.0)
            scores = tl.dot(k_tile, q_t)  # [BLOCK_N, Q_TOKENS * HEADS] fp32
            scores = tl.maximum(scores, 0.0) * w[None, :]
            tile_logits = tl.trans(tl.sum(tl.reshape(scores, (BLOCK_N, Q_TOKENS, HEADS)), 2))
            tile_logits *= k_scale[None, :]
            seen = (positions[None, :] >= lo[:, None]) & (positions[None, :] < hi[:, None])
            tile_logits = tl.where(seen, tile_logits, float("-inf"))
        else:  # a tile no query of the program sees (prefill)
            tile_logits = tl.full([Q_TOKENS, BLOCK_N], float("-inf"), tl.float32)
        tl.store(
            logits + rows[:, None] * width + positions[None, :],
            tile_logits,
            mask=token_ok[:, None] & (positions < width)[None, :],
        )
