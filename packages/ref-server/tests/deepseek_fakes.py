"""Stand-ins for DeepSeek's libraries in plain torch, for CPU tests of the adapters: FlashMLA's,
DeepGEMM's and DeepEP's Python signatures (FlashMLA 1.0.0, DeepGEMM 2.6.1, DeepEP 2.1.0's V1
`Buffer`) with the checks their implementations make on the arguments (shapes, dtypes,
layouts, the scale formats of the sm90 recipe) as assertions, and their math in float64. Each
records its calls in `module.calls`. Rows a GEMM does not compute come out NaN (the real
kernels leave them unspecified), so a caller that reads one fails its comparison."""

from __future__ import annotations

import importlib.machinery
import math
from types import ModuleType, SimpleNamespace

import torch

FP8 = torch.float8_e4m3fn
BLOCK = 128
PAGE = 64  # FlashMLA's dense decode takes pages of 64 tokens only


def _module(name: str) -> ModuleType:
    """An empty module that `importlib.util.find_spec` finds once it is in sys.modules."""
    module = ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.calls = []
    return module


def flash_mla() -> ModuleType:
    """FlashMLA 1.0.0's dense decode: `get_mla_metadata` hands out an empty schedule that the
    first `flash_mla_with_kvcache` call fills and later calls must match."""
    module = _module("flash_mla")

    class FlashMLASchedMeta:
        config = None

    def get_mla_metadata(*args, **kwargs):
        module.calls.append(("get_mla_metadata",))
        return FlashMLASchedMeta(), None

    def flash_mla_with_kvcache(
        q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
        num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
    ):  # fmt: skip
        meta = tile_scheduler_metadata
        assert isinstance(meta, FlashMLASchedMeta) and num_splits is None
        assert not is_fp8_kvcache and indices is None
        b, s_q, h_q, d = q.shape
        assert s_q == 1 and d == 576 and head_dim_v == 512
        assert q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype
        assert q.stride(-1) == 1 and k_cache.stride(-1) == 1
        assert k_cache.dim() == 4 and k_cache.shape[1] == PAGE and k_cache.shape[3] == d
        assert k_cache.shape[2] == 1, "MLA's one KV head"
        assert cache_seqlens.dtype == torch.int32 and block_table.dtype == torch.int32
        assert tuple(cache_seqlens.shape) == (b,) and block_table.shape[0] == b
        config = (b, s_q, h_q, k_cache.shape[1], k_cache.shape[2], causal)
        assert meta.config in (None, config), "a schedule reused with other arguments"
        meta.config = config
        module.calls.append(("flash_mla_with_kvcache", tuple(q.shape), tuple(k_cache.shape)))
        scale = d**-0.5 if softmax_scale is None else softmax_scale
        out = q.new_empty(b, s_q, h_q, head_dim_v)
        lse = q.new_empty(b, h_q, s_q, dtype=torch.float32)
        for i in range(b):
            n = int(cache_seqlens[i])
            pages = block_table[i, : -(-n // PAGE)].long()
            kv = k_cache[pages].reshape(-1, d)[:n].double()  # one KV head
            scores = q[i, 0].double() @ kv.T * scale  # [h_q, n]
            out[i, 0] = (scores.softmax(-1) @ kv[:, :head_dim_v]).to(q.dtype)
            lse[i, :, 0] = scores.logsumexp(-1).float()
        return out, lse

    module.get_mla_metadata = get_mla_metadata
    module.flash_mla_with_kvcache = flash_mla_with_kvcache
    return module


def _dequantized(values: torch.Tensor, scales: torch.Tensor, rows_per_scale: int):
    """e4m3 `[rows, k]` times fp32 scales, one per `rows_per_scale` rows and 128 columns."""
    rows, k = values.shape
    wide = scales.double().repeat_interleave(rows_per_scale, 0).repeat_interleave(BLOCK, 1)
    return values.double() * wide[:rows, :k]


def _check_operands(a, b, grouped: bool):
    """DeepGEMM's sm90 FP8 checks: K-major e4m3 operands, fp32 scales of the (1, 128, 128)
    recipe: a's one per row and 128 columns, b's (contiguous) one per 128 x 128 block."""
    (x, sfa), (w, sfw) = a, b
    assert x.dtype == FP8 and w.dtype == FP8, "FP8 operands"
    assert x.stride(-1) == 1 and w.stride(-1) == 1, "sm90 takes K-major operands only"
    assert sfa.dtype == torch.float32 and sfw.dtype == torch.float32, "sm90: fp32 scales"
    k = x.shape[-1]
    assert w.shape[-1] == k
    assert tuple(sfa.shape) == (*x.shape[:-1], math.ceil(k / BLOCK))
    assert tuple(sfw.shape) == (*w.shape[:-2], math.ceil(w.shape[-2] / BLOCK), math.ceil(k / BLOCK))
    assert sfw.is_contiguous(), "sm90 takes contiguous weight scales"
    assert w.shape[-2] % 8 == 0, "n must be a multiple of 8"
    if grouped:
        assert w.dim() == 3


def deep_gemm(alignment: int = 128) -> ModuleType:
    """DeepGEMM 2.6.1's FP8 GEMMs (sm90): `fp8_gemm_nt`, `m_grouped_fp8_gemm_nt_contiguous`
    (its psum layout: group g's rows start at the previous group's end rounded up to
    `alignment` and end at grouped_layout[g]) and `m_grouped_fp8_gemm_nt_masked`."""
    module = _module("deep_gemm")

    def get_mk_alignment_for_contiguous_layout():
        return alignment

    def fp8_gemm_nt(a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, **kw):
        assert c is None and recipe is None and recipe_a is None and recipe_b is None
        _check_operands(a, b, grouped=False)
        (x, sfa), (w, sfw) = a, b
        assert x.dim() == 2 and d.dtype == torch.bfloat16 and d.stride(-1) == 1
        assert tuple(d.shape) == (x.shape[0], w.shape[0])
        module.calls.append(("fp8_gemm_nt", tuple(x.shape), tuple(w.shape)))
        d.copy_(_dequantized(x, sfa, 1) @ _dequantized(w, sfw, BLOCK).T)

    def m_grouped_fp8_gemm_nt_contiguous(
        a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="nk",
        disable_ue8m0_cast=False, use_psum_layout=False, ensure_zero_padding=True,
        expected_m_for_psum_layout=None,
    ):  # fmt: skip
        assert use_psum_layout, "this stand-in has the psum layout only"
        _check_operands(a, b, grouped=True)
        (x, sfa), (w, sfw) = a, b
        m, groups = x.shape[0], w.shape[0]
        assert d.dtype == torch.bfloat16 and tuple(d.shape) == (m, w.shape[1])
        assert grouped_layout.dtype == torch.int32 and tuple(grouped_layout.shape) == (groups,)
        assert expected_m_for_psum_layout is None or expected_m_for_psum_layout > 0
        module.calls.append(("m_grouped_fp8_gemm_nt_contiguous", tuple(x.shape), groups))
        d.fill_(float("nan"))
        end = 0
        for g, psum in enumerate(grouped_layout.tolist()):
            start = -(-end // alignment) * alignment
            assert start <= psum <= m, f"group {g}: rows [{start}, {psum}) outside [0, {m})"
            rows = slice(start, psum)
            d[rows] = _dequantized(x[rows], sfa[rows], 1) @ _dequantized(w[g], sfw[g], BLOCK).T
            end = psum

    def m_grouped_fp8_gemm_nt_masked(
        a, b, d, masked_m, expected_m, recipe=None, recipe_a=None, recipe_b=None, **kw
    ):
        _check_operands(a, b, grouped=True)
        (x, sfa), (w, sfw) = a, b
        groups, rows = x.shape[:2]
        assert d.dtype == torch.bfloat16 and tuple(d.shape) == (groups, rows, w.shape[1])
        assert masked_m.dtype == torch.int32 and tuple(masked_m.shape) == (groups,)
        assert isinstance(expected_m, int) and expected_m > 0 and rows > 0
        module.calls.append(("m_grouped_fp8_gemm_nt_masked", tuple(x.shape), expected_m))
        d.fill_(float("nan"))
        for g, count in enumerate(masked_m.tolist()):
            assert 0 <= count <= rows
            mine = _dequantized(x[g, :count], sfa[g, :count], 1)
            d[g, :count] = mine @ _dequantized(w[g], sfw[g], BLOCK).T

    module.get_mk_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout
    module.fp8_gemm_nt = fp8_gemm_nt
    module.m_grouped_fp8_gemm_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous
    module.m_grouped_fp8_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked
    return module


# DeepEP's recommended configs exist for these rank counts only.
DEEP_EP_RANKS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)


def deep_ep() -> ModuleType:
    """DeepEP 2.1.0's V1 `Buffer`: its constructor, its size hints (made-up sizes, each
    distinct) and `destroy`; every buffer built lands in `module.buffers`. It moves no rows."""
    module = _module("deep_ep")
    module.buffers = []

    def config(num_ranks: int, nvl_chunk: int):
        assert num_ranks in DEEP_EP_RANKS, f"Unsupported number of EP ranks: {num_ranks}"
        return SimpleNamespace(
            get_nvl_buffer_size_hint=lambda hidden_bytes, ranks: nvl_chunk * hidden_bytes * ranks
        )

    class Buffer:
        def __init__(
            self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
            num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
            explicitly_destroy=False, enable_shrink=False, comm=None,
        ):  # fmt: skip
            self.group, self.num_nvl_bytes, self.num_rdma_bytes = (
                group,
                num_nvl_bytes,
                num_rdma_bytes,
            )
            self.low_latency_mode, self.num_qps_per_rank = low_latency_mode, num_qps_per_rank
            self.explicitly_destroy, self.destroyed = explicitly_destroy, False
            module.buffers.append(self)

        @staticmethod
        def get_dispatch_config(num_ranks):
            return config(num_ranks, 3)

        @staticmethod
        def get_combine_config(num_ranks):
            return config(num_ranks, 5)

        @staticmethod
        def get_low_latency_rdma_size_hint(tokens, hidden, num_ranks, num_experts):
            return 7 * tokens * hidden * num_ranks + num_experts

        def destroy(self):
            assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
            assert not self.destroyed
            self.destroyed = True

    module.Buffer = Buffer
    return module
