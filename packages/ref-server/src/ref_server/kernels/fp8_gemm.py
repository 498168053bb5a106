"""The block-scaled FP8 GEMM as one operator, `ref_server::fp8_block_gemm`, in three layouts.

Operands as DeepSeek-V3 keeps them: activations e4m3 with one fp32 scale per token and 128
channels, weights e4m3 with one fp32 scale per 128 x 128 block. Each product is x @ w^T with
fp32 accumulation: for each 128-channel block kb, acc += (x_block @ w_block^T) * x_scale[row, kb]
* w_scale[n // 128, kb]. The layouts:

- dense: x `[..., m, k]` against w `[n, k]` (a linear layer);
- batched: x `[e, m, k]` against w `[e, n, k]`, optionally with `counts` `[e]` int32, the rows
  of each expert that hold tokens (the decode layout: the low-latency dispatch receives into
  `[e, max_rows, hidden]` with per-expert counts; the shapes stay fixed for CUDA graphs);
- grouped: x `[m, k]` with rows grouped by expert, group g ending at `offsets[g]` (`[e]` int32,
  cumulative, torch._grouped_mm's convention), against w `[e, n, k]` (prefill).

Implementations: the default one, on any device, is the reference (both operands dequantized to
fp32, then torch.matmul or torch._grouped_mm). On CUDA, one Triton kernel serves all three
layouts (`triton_block_gemm`): each program takes one 64- or 128-row tile of one expert and one
128-column tile of the output, works out on the device which expert and rows its tile covers,
and runs the same main loop (wgmma on e4m3, one fp32 rescale per 128 channels); where the
output has too few tiles for the SMs (decode), programs split k and their fp32 partial sums
are added after. Nothing waits for the device and no size depends on device values, so the
operator can be captured in a CUDA graph (after one warm-up call, which compiles the kernel).
The same kernel also computes SwiGLU's gate and up products with the activation in its
epilogue (`triton_block_gemm`'s swiglu_inter, for `expert_swiglu`). Two more implementations
serve on Hopper: torch's own `torch._scaled_mm` takes these scales for the dense layout (1x128
by 128x128 blockwise scaling, cuBLASLt 12.9 and later), and CUTLASS's grouped kernel
(`cutlass_gemm`, built on first use) takes every layout into bf16. `backend` names one
("triton", "scaled_mm", "cutlass"), which runs where it takes the arguments (the Triton kernel
elsewhere), or "auto": `pick_backend`'s choice, from benchmarks/bench_fp8_gemm.py's
measurements.

k need not be a multiple of 128 (the last block is partial, its scale covering what there is).
Rows past a batched expert's count, or past offsets[-1] in the grouped layout, come out
unspecified. Offsets must be non-decreasing (unchecked: that would take a device sync); counts
and offsets of any value make the kernel read and write within its tensors only.

triton is imported on the first CUDA call only, so that this module imports without it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ref_server.kernels import activation, cutlass_gemm
from ref_server.kernels.fp8_cast import dequantize_activations, dequantize_blocks
from ref_server.kernels.pdl import launch_options

BLOCK = 128  # the scales' block: 128 channels of a token, 128 x 128 of a weight
FP8 = torch.float8_e4m3fn
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
UNSCALED_DTYPES = (torch.bfloat16, torch.float16)  # operands the kernel also takes unscaled
BACKENDS = ("auto", "triton", "scaled_mm", "cutlass")
# On the H200 (bench_fp8_gemm.py, 2026-12-02) cuBLASLt's blockwise GEMM beat the Triton kernel
# on V3's projections from 512 rows (1.2-1.6x at 4096 and more) and lost at 128 (decode).
SCALED_MM_MIN_ROWS = 512


def blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


class Layout(NamedTuple):
    """What `check_inputs` found: kind "dense", "batched" or "grouped"; x as a matrix
    `[rows, k]`, w as `[groups, n, k]`; group_rows, each expert's rows (batched) or their
    average (grouped, dense: all rows); out_shape, the result's shape."""

    kind: str
    rows: int
    n: int
    k: int
    groups: int
    group_rows: int
    out_shape: tuple[int, ...]


def check_inputs(x, x_scales, w, w_scales, offsets, counts, out_dtype, backend="auto") -> Layout:
    """The layout of valid arguments (see `block_gemm`; x_scales and w_scales None: unscaled
    half-precision operands, see `triton_block_gemm`); ValueError naming what is wrong."""
    named = dict(x_scales=x_scales, w_scales=w_scales, offsets=offsets, counts=counts)
    tensors = dict(x=x, w=w) | {name: t for name, t in named.items() if t is not None}
    for name, t in tensors.items():
        if t.device != x.device:
            raise ValueError(
                f"all tensors must be on one device: x is on {x.device}, {name} on {t.device}"
            )
    scaled = x_scales is not None or w_scales is not None
    if scaled:
        dtypes = dict(x=FP8, w=FP8, x_scales=torch.float32, w_scales=torch.float32)
        for name, dtype in dtypes.items():
            t = tensors.get(name)
            if t is None:
                raise ValueError(f"{name} is missing: FP8 operands take both scales")
            if t.dtype != dtype:
                raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    elif x.dtype not in OUT_DTYPES or w.dtype != x.dtype:
        raise ValueError(
            f"without scales, x and w must be one of {OUT_DTYPES}, got {x.dtype} and {w.dtype}"
        )
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if w.dim() not in (2, 3):
        raise ValueError(f"w must be [n, k] or [e, n, k], got shape {tuple(w.shape)}")
    if x.dim() == 0:
        raise ValueError("x must be [..., k], got a scalar")
    n, k = w.shape[-2:]
    if x.shape[-1] != k:
        raise ValueError(f"x has k = {x.shape[-1]} channels but w has k = {k}")
    if scaled:
        want = (*x.shape[:-1], blocks(k))
        if tuple(x_scales.shape) != want:
            got = tuple(x_scales.shape)
            raise ValueError(f"x_scales must be {want} (one per token and 128 channels), got {got}")
        want = (*w.shape[:-2], blocks(n), blocks(k))
        if tuple(w_scales.shape) != want:
            got = tuple(w_scales.shape)
            raise ValueError(f"w_scales must be {want} (one per 128 x 128 block), got {got}")
    rows = math.prod(x.shape[:-1])
    if w.dim() == 2:
        for name, t in (("offsets", offsets), ("counts", counts)):
            if t is not None:
                raise ValueError(f"{name} is for experts' weights [e, n, k]; w is [n, k]")
        return Layout("dense", rows, n, k, 1, rows, (*x.shape[:-1], n))
    e = w.shape[0]
    if offsets is not None:
        if counts is not None:
            raise ValueError(
                "pass offsets (x [m, k], rows grouped by expert) or counts (x [e, m, k]), not both"
            )
        if x.dim() != 2:
            raise ValueError(f"with offsets, x must be [m, k], got {tuple(x.shape)}")
        check_group_sizes("offsets", offsets, e)
        return Layout("grouped", rows, n, k, e, rows // max(e, 1), (rows, n))
    if x.dim() != 3 or x.shape[0] != e:
        raise ValueError(
            f"x must be [e, m, k] with e = {e} experts (or [m, k] with offsets), "
            f"got {tuple(x.shape)}"
        )
    if counts is not None:
        check_group_sizes("counts", counts, e)
    return Layout("batched", rows, n, k, e, x.shape[1], (e, x.shape[1], n))


def check_group_sizes(name: str, t: torch.Tensor, e: int) -> None:
    if t.dtype != torch.int32 or tuple(t.shape) != (e,):
        got = f"{tuple(t.shape)} {t.dtype}"
        raise ValueError(f"{name} must be [{e}] int32 (one per expert), got {got}")


@torch.library.custom_op("ref_server::fp8_block_gemm", mutates_args=())
def block_gemm(
    x: torch.Tensor,
    x_scales: torch.Tensor,
    w: torch.Tensor,
    w_scales: torch.Tensor,
    offsets: torch.Tensor | None,
    counts: torch.Tensor | None,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """x @ w^T in out_dtype (bf16, fp16 or fp32), fp32 accumulation. x e4m3 `[..., k]` with
    x_scales fp32 `[..., ceil(k/128)]`; w e4m3 `[n, k]` or `[e, n, k]` with w_scales fp32
    `[(e,) ceil(n/128), ceil(k/128)]`; offsets `[e]` int32 (grouped layout) or counts `[e]`
    int32 (batched layout), or neither; backend, one of BACKENDS (on CUDA). Out `[..., n]`
    (see the module docstring for the layouts).

    This body is the reference, on any device: both operands dequantized to fp32, one matmul."""
    check_inputs(x, x_scales, w, w_scales, offsets, counts, out_dtype, backend)

    a = dequantize_activations(x, x_scales)
    b = dequantize_blocks(w, w_scales).transpose(-2, -1)
    out = a @ b if offsets is None else torch._grouped_mm(a, b, offs=offsets)
    return out.to(out_dtype)


@block_gemm.register_fake
def _(x, x_scales, w, w_scales, offsets, counts, out_dtype, backend):
    layout = check_inputs(x, x_scales, w, w_scales, offsets, counts, out_dtype, backend)
    return x.new_empty(layout.out_shape, dtype=out_dtype)


@block_gemm.register_kernel("cuda")
def _(x, x_scales, w, w_scales, offsets, counts, out_dtype, backend):
    layout = check_inputs(x, x_scales, w, w_scales, offsets, counts, out_dtype, backend)
    if backend == "auto":
        backend = pick_backend(layout)
    rows, n, k = layout.rows, layout.n, layout.k
    dense = layout.kind == "dense"
    if backend == "scaled_mm" and dense and scaled_mm_takes(rows, n, k, out_dtype, x.device):
        return scaled_mm_block_gemm(x, x_scales, w, w_scales, out_dtype)
    if backend == "cutlass" and cutlass_gemm.takes(n, k, out_dtype, x.device):
        out = cutlass_gemm.cutlass_block_gemm(
            x, x_scales, w, w_scales, offsets, counts, layout.kind, layout.group_rows
        )
        return out.view(layout.out_shape)
    return triton_block_gemm(x, x_scales, w, w_scales, offsets, counts, out_dtype, layout=layout)


# From bench_fp8_gemm.py on the H200 (2026-12-03): CUTLASS's grouped kernel beat the Triton
# kernel on V3's expert shapes from 128 rows a group on average (1.2-1.5x at 4,096-16,384
# rows); below, Triton's k splits fill the SMs and it won. cuBLASLt beat both on every linear
# layer from 512 rows.
CUTLASS_MIN_GROUP_ROWS = 128


def pick_backend(layout: Layout) -> str:
    """The backend "auto" takes: cuBLASLt for linear layers (where it takes them), CUTLASS for
    rows grouped by expert (prefill) with CUTLASS_MIN_GROUP_ROWS or more a group on average,
    Triton otherwise, the batched layout included: its counts stay on the device, and blocks
    with few rows counted (decode) are what the Triton kernel's k splits serve best."""
    if layout.kind == "dense":
        return "scaled_mm"
    grouped = layout.kind == "grouped" and layout.group_rows >= CUTLASS_MIN_GROUP_ROWS
    return "cutlass" if grouped else "triton"


# torch._scaled_mm reads (1x128, 128x128) blockwise scales from torch 2.9 on, through cuBLASLt
# 12.9 or later, on sm90 only.
SCALED_MM_BLOCKWISE = (
    torch.torch_version.TorchVersion(torch.__version__) >= "2.9"
    and torch.version.cuda is not None
    and torch.torch_version.TorchVersion(torch.version.cuda) >= "12.9"
)


def scaled_mm_takes(rows: int, n: int, k: int, out_dtype: torch.dtype, device) -> bool:
    """Whether `scaled_mm_block_gemm` runs x `[rows, k]` @ w `[n, k]`^T: an sm90 device and a
    torch whose _scaled_mm has blockwise scaling, bf16 out, whole 128-channel blocks in a
    multiple of 4 (cuBLASLt pads the weight scales' k blocks to 4 otherwise; torch's strides
    do not), n a multiple of 16, rows a multiple of 4 (16-byte aligned columns of x_scales)
    and at least SCALED_MM_MIN_ROWS (below, the Triton kernel measured faster)."""
    return (
        SCALED_MM_BLOCKWISE
        and torch.device(device).type == "cuda"
        and torch.cuda.get_device_capability(device) == (9, 0)
        and out_dtype == torch.bfloat16
        and k % (4 * BLOCK) == 0
        and n % 16 == 0
        and rows % 4 == 0
        and rows >= SCALED_MM_MIN_ROWS
    )


def scaled_mm_block_gemm(x, x_scales, w, w_scales, out_dtype) -> torch.Tensor:
    """The dense layout through torch._scaled_mm (where `scaled_mm_takes`): x e4m3 `[..., k]`,
    x_scales fp32 `[..., k/128]`, w e4m3 `[n, k]`, w_scales fp32 `[ceil(n/128), k/128]`;
    out `[..., n]` in out_dtype."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    scale_a = x_scales.reshape(-1, k // BLOCK).t().contiguous().t()  # column-major, as cuBLASLt
    out = torch._scaled_mm(
        rows, w.contiguous().t(), scale_a, w_scales.contiguous().t(), out_dtype=out_dtype
    )
    return out.view(*x.shape[:-1], w.shape[0])


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration of the Triton kernel: rows and columns per tile (columns
    dividing 128, so that a tile has one weight scale per k step), warps, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


FEW_ROWS = KernelConfig(block_m=16, block_n=64, num_warps=4, num_stages=6)
DECODE = KernelConfig(block_m=64, block_n=128, num_warps=4, num_stages=4)
PREFILL = KernelConfig(block_m=128, block_n=128, num_warps=8, num_stages=4)


def pick_config(group_rows: int, scaled: bool) -> KernelConfig:
    """FEW_ROWS's 16-row tiles for half-precision experts of at most 4 rows on average (on the
    H200, V2-Lite's batch-1 down GEMM 15 % faster than with DECODE's and no longer split in k,
    batch 8's GEMMs the fastest swept or within 1 %; decode steps at batch 1-32 2-4 % shorter;
    at batch 128, 12 rows, DECODE's kept the step 0.7 % shorter; FP8 not measured), DECODE's
    64-row tiles up to 128 rows, PREFILL's otherwise. Fixed, not autotuned: a CUDA graph
    captures after one warm-up call."""
    if group_rows <= 4 and not scaled:
        return FEW_ROWS
    return DECODE if group_rows <= 128 else PREFILL


def pick_split_k(tiles: int, k_blocks: int, sms: int) -> int:
    """1 where the output tiles that hold rows fill the device's SMs; else the most ranges of
    at least 4 k blocks each (dividing them) that keep tiles x ranges within two programs per
    SM: small-m layers (decode) would leave most SMs idle otherwise."""
    if tiles >= sms:
        return 1
    fitting = [s for s in range(1, k_blocks // 4 + 1) if k_blocks % s == 0 and tiles * s <= 2 * sms]
    return max(fitting, default=1)


def check_swiglu_rows(w_rows: int, inter: int, scaled: bool) -> None:
    """ValueError unless experts' weights of w_rows rows each hold gate's inter rows first and
    up's inter rows last (in FP8 from a row that starts a 128-row scale block)."""
    if inter < 1 or 2 * inter > w_rows:
        raise ValueError(
            f"w has {w_rows} rows an expert: too few for gate's and up's {inter} rows each"
        )
    if scaled and (w_rows - inter) % BLOCK:
        raise ValueError(
            f"up's rows must start a {BLOCK}-row block of w_scales, but start at row "
            f"{w_rows - inter} of {w_rows}"
        )


def triton_block_gemm(
    x: torch.Tensor,
    x_scales: torch.Tensor | None,
    w: torch.Tensor,
    w_scales: torch.Tensor | None,
    offsets: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    config: KernelConfig | None = None,
    tma: bool | None = None,
    split_k: int | None = None,
    layout: Layout | None = None,
    swiglu_inter: int | None = None,
) -> torch.Tensor:
    """`block_gemm` through the Triton kernel, any layout, on a CUDA device (or on the CPU with
    TRITON_INTERPRET=1). With x_scales and w_scales None, x and w are bf16 or fp16 (one dtype)
    and multiplied as they are: the same kernel then serves the experts' half-precision GEMMs
    (`expert_gemm`), k in steps of 64. config: `pick_config`'s by default. tma: load x and w
    tiles through TMA descriptors (Hopper's bulk copies), the default where their alignment
    allows, or through masked pointer loads. split_k: how many ranges of k steps are summed by
    separate programs (into fp32 partial sums, then added up), `pick_split_k`'s by default.
    layout: what `check_inputs` found for these arguments, from a caller that checked them.

    swiglu_inter: SwiGLU's gate and up projections with its activation (`expert_swiglu`): each
    expert's rows of w are gate's swiglu_inter rows first and up's last (`check_swiglu_rows`),
    and out `[..., swiglu_inter]` is `silu_mul(gate, up)` of the two products, each rounded to
    out_dtype first as this kernel stores them. A program then covers half a tile's columns of
    gate and the same of up, so that it keeps block_m x block_n accumulators as without; with
    split k, the kernel that adds the partial sums applies the activation."""
    if layout is None:
        layout = check_inputs(x, x_scales, w, w_scales, offsets, counts, out_dtype)
    rows, w_rows, k, groups = layout.rows, layout.n, layout.k, layout.groups
    scaled = x_scales is not None
    swiglu = swiglu_inter is not None
    n = w_rows  # columns of out
    if swiglu:
        check_swiglu_rows(w_rows, swiglu_inter, scaled)
        n = swiglu_inter
    config = config or pick_config(layout.group_rows, scaled)
    if BLOCK % config.block_n:
        raise ValueError(f"block_n must divide {BLOCK}, got {config.block_n}")
    program_cols = config.block_n // 2 if swiglu else config.block_n  # out's, per program
    out_shape = (*layout.out_shape[:-1], n)
    out = torch.empty(rows, n, dtype=out_dtype, device=x.device)
    if rows == 0 or n == 0 or groups == 0:
        return out.view(out_shape)
    if not scaled and x.dtype not in UNSCALED_DTYPES:
        raise ValueError(f"the kernel takes unscaled operands in {UNSCALED_DTYPES}, got {x.dtype}")
    # FP8: one step per scale block; half precision: 64 channels, 128 bytes as FP8's 128
    block_k = BLOCK if scaled else BLOCK // 2
    k_blocks = -(-k // block_k)
    x = x.reshape(rows, k)
    if x.stride(1) != 1:
        x = x.contiguous()
    w = w.reshape(groups * w_rows, k).contiguous()
    if scaled:
        x_scales = x_scales.reshape(rows, blocks(k))
        w_scales = w_scales.reshape(groups, blocks(w_rows), blocks(k))
    else:  # never read: any tensor with the strides' dims
        x_scales, w_scales = x.new_empty(0, 0, dtype=torch.float32), x.new_empty(0, 0, 0)

    tile_rows = -(-rows // config.block_m)
    if layout.kind == "batched":
        tile_rows = groups * -(-layout.group_rows // config.block_m)
    elif layout.kind == "grouped":
        # Each group that holds rows may end in a partial tile, and at most `rows` groups hold
        # any: at a decode step's few rows, a tile row for every group left most programs idle.
        tile_rows += min(groups, rows)
    tile_cols = -(-n // program_cols)
    if split_k is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
        split_k = pick_split_k(tile_rows * tile_cols, k_blocks, sms)
    if k_blocks % split_k:
        raise ValueError(f"split_k must divide the {k_blocks} blocks of k, got {split_k}")
    partial = out
    if split_k > 1:  # with swiglu, each row's gate columns, then its up columns
        partial = x.new_empty(split_k, rows, 2 * n if swiglu else n, dtype=torch.float32)

    triton, kernel, sum_splits = _triton_kernels()
    size = x.element_size()
    aligned = all(t.data_ptr() % 16 == 0 for t in (x, w)) and x.stride(0) * size % 16 == 0
    whole_tiles = rows >= config.block_m and groups * w_rows >= program_cols
    fits = k >= block_k and k * size % 16 == 0 and whole_tiles
    if tma is None:
        tma = aligned and fits
    elif tma and not (aligned and fits):
        raise ValueError(
            "tma needs 16-byte aligned x and w, rows of x and w in multiples of 16 bytes and "
            "at least one k step long, and at least one whole tile of rows and of columns"
        )
    x_in, w_in = x, w
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_in = TensorDescriptor.from_tensor(x, [config.block_m, block_k])
        w_in = TensorDescriptor.from_tensor(w, [program_cols, block_k])
    sizes = offsets if offsets is not None else counts
    # the activation's exp is libdevice's on CUDA, linked without flushing subnormals to zero
    # (as `activation` compiles it: torch's formula bit for bit)
    activation = dict(SWIGLU=swiglu, LIBDEVICE=x.is_cuda, enable_reflect_ftz=False)
    kernel[(tile_rows * tile_cols * split_k,)](
        x_in,
        x_scales,
        w_in,
        w_scales,
        partial,
        sizes if sizes is not None else x_scales,
        rows,
        n,
        k,
        w_rows,
        layout.group_rows,
        groups,
        tile_rows,
        x.stride(0),
        x_scales.stride(0),
        x_scales.stride(1),
        w_scales.stride(0),
        w_scales.stride(1),
        w_scales.stride(2),
        LAYOUT=layout.kind,
        COUNTS=counts is not None,
        TMA=tma,
        SCALED=scaled,
        **activation,
        GROUPS=triton.next_power_of_2(max(groups, 2)),
        K_BLOCKS=k_blocks,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        num_warps=config.num_warps,
        **launch_options(x.device),
        num_stages=config.num_stages,
    )
    if split_k > 1:  # added in order in fp32, rounded once into out's dtype
        numel = rows * n
        sum_splits[(triton.cdiv(numel, SUM_BLOCK),)](
            partial,
            out,
            numel,
            n,
            SPLIT_K=split_k,
            **activation,
            BLOCK=SUM_BLOCK,
            **launch_options(x.device),
        )
    return out.view(out_shape)


tl = None  # triton.language, once _triton_kernels() has imported it
split_sum = None  # the jitted `_split_sum`, once _triton_kernels() has made it
SUM_BLOCK = 1024  # outputs per program of `_sum_splits_kernel`


@functools.cache
def _triton_kernels():
    """(triton, the compiled `_block_gemm_kernel` and `_sum_splits_kernel`): triton is imported
    here, on first use. Row counts are not specialized on (Triton would compile again for each
    new multiple of 16, say a decode batch size first seen after the warm-up)."""
    global tl, split_sum
    import triton
    import triton.language as tl

    activation._triton_kernels()  # which makes activation.silu_mul_tile
    split_sum = triton.jit(_split_sum)
    unspecialized = ["rows", "group_rows", "groups", "tile_rows"]
    gemm = triton.jit(_block_gemm_kernel, do_not_specialize=unspecialized)
    return triton, gemm, triton.jit(_sum_splits_kernel, do_not_specialize=["numel"])


def _split_sum(partial, index, inside, span, SPLIT_K: tl.constexpr):
    """The sum over s of partial[s * span + index] (fp32), in order."""
    total = tl.zeros(index.shape, dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        total += tl.load(partial + split * span + index, mask=inside, other=0.0)
    return total


def _sum_splits_kernel(
    partial,
    out,
    numel,
    n,  # out's columns
    SPLIT_K: tl.constexpr,
    SWIGLU: tl.constexpr,  # partial's rows hold gate's n columns, then up's n
    LIBDEVICE: tl.constexpr,  # exp as libdevice's expf (CUDA); else tl.exp (the interpreter)
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (pdl.py)
):
    """out[i] = the sum over s of partial[s, i] (fp32 [SPLIT_K, numel]), in order, in fp32,
    rounded once to out's dtype (torch.sum into a bf16 out ran as a bf16 reduction on the H200).
    With SWIGLU, out[r, c] = silu_mul of the sums of gate's partial[s, r, c] and up's
    partial[s, r, n + c] (fp32 [SPLIT_K, rows, 2 n]), each rounded to out's dtype."""
    if PDL:  # wait for the kernel before (pdl.py), then let the next one be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = index < numel
    dtype = out.dtype.element_ty
    if SWIGLU:
        gate_at = index + index // n * n  # row r's gate column c, r * 2 n + c
        span = 2 * numel.to(tl.int64)
        gate = split_sum(partial, gate_at, inside, span, SPLIT_K).to(dtype)
        up = split_sum(partial, gate_at + n, inside, span, SPLIT_K).to(dtype)
        total = activation.silu_mul_tile(gate, up, LIBDEVICE)
    else:
        total = split_sum(partial, index, inside, numel, SPLIT_K)
    tl.store(out + index, total.to(dtype), mask=inside)


def _block_gemm_kernel(
    x,  # e4m3 (unscaled: bf16, fp16) [rows, k]: pointer, or TMA descriptor of [BLOCK_M, BLOCK_K]
    x_scales,  # fp32 [rows, ceil(k/128)] (SCALED)
    w,  # as x, [groups * w_rows, k]; pointer or TMA descriptor of [COLS, BLOCK_K] tiles
    w_scales,  # fp32 [groups, ceil(w_rows/128), ceil(k/128)] (SCALED)
    out,  # [rows, n], contiguous; with SPLIT_K > 1, fp32 [SPLIT_K, rows, n] partial sums
    # (SWIGLU: [SPLIT_K, rows, 2 n], each row's gate columns, then its up columns)
    sizes,  # int32 [groups]: offsets (grouped) or counts (batched with COUNTS)
    rows,
    n,  # out's columns
    k,
    w_rows,  # rows of each expert's w: n, or (SWIGLU) gate's n first and up's n last
    group_rows,  # rows of each expert (batched)
    groups,
    tile_rows,  # row tiles launched: every program is one (row tile, column tile)
    stride_x,
    stride_xs_row,
    stride_xs_k,
    stride_ws_group,
    stride_ws_row,
    stride_ws_k,
    LAYOUT: tl.constexpr,  # "dense", "batched" or "grouped"
    COUNTS: tl.constexpr,
    TMA: tl.constexpr,
    SCALED: tl.constexpr,  # FP8 operands with their scales, or half-precision ones without
    SWIGLU: tl.constexpr,  # out = silu_mul(x @ gate^T, x @ up^T), each rounded to out's dtype
    LIBDEVICE: tl.constexpr,  # SWIGLU's exp: libdevice's expf (CUDA), or tl.exp (interpreter)
    GROUPS: tl.constexpr,  # a power of two >= groups
    K_BLOCKS: tl.constexpr,  # ceil(k / BLOCK_K); a constant, since Triton 3.6's interpreter
    # cannot loop to a run-time bound under numpy >= 2.4 (and a model has few values of k)
    BLOCK_K: tl.constexpr,  # channels per step: 128 (one scale block) when SCALED
    SPLIT_K: tl.constexpr,  # programs per output tile, each summing K_BLOCKS / SPLIT_K blocks
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # rows of w a program multiplies: with SWIGLU, half gate's, half up's
    PDL: tl.constexpr,  # programmatic dependent launch (pdl.py)
):
    if PDL:  # wait for the kernel before (pdl.py), then let the next one be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    SWIZZLE: tl.constexpr = 8  # row tiles that sweep the columns together (L2 reuse of w)
    K_STEPS: tl.constexpr = K_BLOCKS // SPLIT_K
    COLS: tl.constexpr = BLOCK_N // 2 if SWIGLU else BLOCK_N  # out's columns a program takes
    tile_cols = tl.cdiv(n, COLS)
    split = tl.program_id(0) // (tile_rows * tile_cols)
    pid = tl.program_id(0) % (tile_rows * tile_cols)
    band = pid // (SWIZZLE * tile_cols)
    height = tl.minimum(tile_rows - band * SWIZZLE, SWIZZLE)
    tile_m = band * SWIZZLE + (pid % (SWIZZLE * tile_cols)) % height
    tile_n = (pid % (SWIZZLE * tile_cols)) // height

    # This tile's expert and rows [start, end): the end bounds the expert's rows, not the tile.
    if LAYOUT == "dense":
        group = 0
        start = tile_m * BLOCK_M
        end = rows
    elif LAYOUT == "batched":
        per_group = tl.cdiv(group_rows, BLOCK_M)
        group = tile_m // per_group
        start = group * group_rows + (tile_m % per_group) * BLOCK_M
        end = group * group_rows + group_rows
        if COUNTS:
            end = group * group_rows + tl.minimum(tl.maximum(tl.load(sizes + group), 0), group_rows)
    else:  # the tiles of each group in turn, from the cumulative ends
        ids = tl.arange(0, GROUPS)
        ends = tl.load(sizes + ids, mask=ids < groups, other=0)
        begins = tl.load(sizes + ids - 1, mask=(ids > 0) & (ids < groups), other=0)
        ends = tl.minimum(tl.maximum(ends, 0), rows)
        begins = tl.minimum(tl.maximum(begins, 0), ends)
        tiles = tl.cdiv(ends - begins, BLOCK_M)
        tiles_to = tl.cumsum(tiles, 0)  # tiles of the groups up to and including each
        group = tl.sum((tiles_to <= tile_m).to(tl.int32), 0)
        mine = ids == group
        first_tile = tl.sum(tl.where(mine, tiles_to - tiles, 0), 0)
        start = tl.sum(tl.where(mine, begins, 0), 0) + (tile_m - first_tile) * BLOCK_M
        end = tl.sum(tl.where(mine, ends, 0), 0)  # 0 past the last group: nothing to do
    if start >= end:
        return

    n_start = tile_n * COLS
    row_ids = start + tl.arange(0, BLOCK_M)
    col_ids = n_start + tl.arange(0, COLS)
    k_ids = tl.arange(0, BLOCK_K)
    row_ok = row_ids < end
    col_ok = col_ids < n
    w_row = group * w_rows + n_start  # of gate's rows with SWIGLU
    x_scale_ptrs = x_scales + row_ids.to(tl.int64) * stride_xs_row
    w_scale_ptr = w_scales + group * stride_ws_group + (n_start // 128) * stride_ws_row
    if SWIGLU:  # up's rows, w_rows - n after gate's
        up_row = w_row + w_rows - n
        up_scale_ptr = w_scale_ptr + (w_rows - n) // 128 * stride_ws_row
    if not TMA:
        k_first = split * K_STEPS * BLOCK_K + k_ids
        x_ptrs = x + row_ids.to(tl.int64)[:, None] * stride_x + k_first[None, :]
        w_ptrs = w + (w_row + tl.arange(0, COLS)).to(tl.int64)[:, None] * k + k_first[None, :]
        if SWIGLU:
            up_ptrs = w + (up_row + tl.arange(0, COLS)).to(tl.int64)[:, None] * k + k_first[None, :]
    acc = tl.zeros((BLOCK_M, COLS), dtype=tl.float32)  # gate's with SWIGLU
    up = tl.zeros((BLOCK_M, COLS), dtype=tl.float32)  # up's with SWIGLU (unused without)
    for step in range(K_STEPS):
        kb = split * K_STEPS + step
        # TMA fills past x's and w's bounds with zeros; rows of the next expert that a tile
        # reads are computed and never stored.
        if TMA:
            a = x.load([start, kb * BLOCK_K])
            b = w.load([w_row, kb * BLOCK_K])
            if SWIGLU:
                b_up = w.load([up_row, kb * BLOCK_K])
        else:
            k_ok = k_ids < k - kb * BLOCK_K
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            if SWIGLU:
                b_up = tl.load(up_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                up_ptrs += BLOCK_K
        if SCALED:
            a_scale = tl.load(x_scale_ptrs + kb * stride_xs_k, mask=row_ok, other=0.0)
            b_scale = tl.load(w_scale_ptr + kb * stride_ws_k)
            acc += tl.dot(a, b.T) * (a_scale[:, None] * b_scale)
            if SWIGLU:
                up_scale = tl.load(up_scale_ptr + kb * stride_ws_k)
                up += tl.dot(a, b_up.T) * (a_scale[:, None] * up_scale)
        else:
            acc = tl.dot(a, b.T, acc)
            if SWIGLU:
                up = tl.dot(a, b_up.T, up)

    dtype = out.dtype.element_ty
    width = 2 * n if SWIGLU and SPLIT_K > 1 else n  # of out's rows
    out_ptrs = out + (split * rows + row_ids).to(tl.int64)[:, None] * width + col_ids[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if not SWIGLU:
        tl.store(out_ptrs, acc.to(dtype), mask=mask)
    elif SPLIT_K == 1:
        tl.store(
            out_ptrs,
            activation.silu_mul_tile(acc.to(dtype), up.to(dtype), LIBDEVICE),
            mask=mask,
        )
    else:  # fp32 partial sums; `_sum_splits_kernel` applies the activation
        tl.store(out_ptrs, acc, mask=mask)
        tl.store(out_ptrs + n, up, mask=mask)
