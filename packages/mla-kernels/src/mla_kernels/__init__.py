"""Paged MLA decode attention with FlashMLA's call surface.

tile_scheduler_metadata, num_splits = get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)
out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512,
                                  tile_scheduler_metadata, num_splits, causal=True)

Sparse (DeepSeek-V3.2): flash_mla_with_kvcache(..., indices=indices) and flash_mla_sparse_fwd.
"""

from mla_kernels.decode import flash_mla_with_kvcache, get_mla_metadata
from mla_kernels.extension import backend
from mla_kernels.fp8_layout import FP8_TOKEN_BYTES, dequantize_fp8, quantize_fp8
from mla_kernels.kv_cache import write_kv_cache
from mla_kernels.sparse import flash_mla_sparse_fwd, sparse_backend

__version__ = "0.1.1"

__all__ = [
    "FP8_TOKEN_BYTES",
    "backend",
    "dequantize_fp8",
    "flash_mla_sparse_fwd",
    "flash_mla_with_kvcache",
    "get_mla_metadata",
    "quantize_fp8",
    "sparse_backend",
    "write_kv_cache",
]
