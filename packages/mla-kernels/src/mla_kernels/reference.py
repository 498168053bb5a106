"""Plain-torch MLA decode attention: the CPU path and the tests' reference.

All math runs in float32 on whatever device the inputs live on, with no host synchronization,
so the same code also serves GPUs without the sm_90a kernel (and CUDA-graph capture there).
"""

from __future__ import annotations

import torch

from mla_kernels.fp8_layout import dequantize_fp8

HEAD_DIM = 576
HEAD_DIM_V = 512


def gather_kv(
    k_cache: torch.Tensor, block_table: torch.Tensor, is_fp8_kvcache: bool, dtype: torch.dtype
) -> torch.Tensor:
    """Every sequence's pages laid end to end: float32 `[b, max_blocks * page_size, h_kv, 576]`.

    An FP8 cache is read as its values times their scales, rounded to `dtype` (the queries'),
    as the kernel reads it. Entries of `block_table` may hold anything; those outside the cache
    are clamped to a valid page here and their tokens masked by the caller.
    """
    num_blocks, page_size, h_kv, _ = k_cache.shape
    # Only the pages the table names are converted, not the whole cache.
    pages = k_cache[block_table.long().clamp(0, num_blocks - 1)]  # [b, blocks, page, h_kv, w]
    pages = dequantize_fp8(pages).to(dtype).float() if is_fp8_kvcache else pages.float()
    b, max_blocks = block_table.shape
    return pages.reshape(b, max_blocks * page_size, h_kv, HEAD_DIM)


def mla_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    is_fp8_kvcache: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over its sequence's cached tokens.

    q `[b, s_q, h_q, 576]`; the first 512 columns of each cached token are V. Query heads
    `[i * h_q / h_kv, (i + 1) * h_q / h_kv)` attend to KV head i. With `causal`, query s sees
    the first `seqlen - s_q + s + 1` tokens (aligned bottom-right). A token whose block-table
    entry lies outside the cache is not attended; a query row that sees no token gets out = 0
    and lse = +inf. Returns out `[b, s_q, h_q, 512]` in q's dtype and the
    natural-log sum of exponentials lse float32 `[b, h_q, s_q]`.
    """
    b, s_q, h_q, _ = q.shape
    kv = gather_kv(k_cache, block_table, is_fp8_kvcache, q.dtype)  # [b, n, h_kv, 576]
    n, h_kv = kv.shape[1], kv.shape[2]
    q_grouped = q.float().view(b, s_q, h_kv, h_q // h_kv, HEAD_DIM)

    positions = torch.arange(n, device=q.device)
    seqlens = cache_seqlens.to(device=q.device, dtype=torch.long)
    num_blocks, page_size = k_cache.shape[:2]
    in_cache = (block_table >= 0) & (block_table < num_blocks)  # [b, max_blocks]
    stored = (positions.view(1, n) < seqlens.view(b, 1)) & in_cache[:, positions // page_size]
    visible = stored.view(b, 1, n).expand(b, s_q, n)
    if causal:
        last = seqlens.view(b, 1) - s_q + torch.arange(s_q, device=q.device).view(1, s_q)
        visible = visible & (positions.view(1, 1, n) <= last.view(b, s_q, 1))
    visible = visible.view(b, 1, 1, s_q, n)

    scores = torch.einsum("bsgkd,bngd->bgksn", q_grouped, kv) * softmax_scale
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [b, h_kv, h_q / h_kv, s_q]
    seen = visible.any(dim=-1)
    probs = torch.exp(scores - torch.where(seen, lse, 0.0).unsqueeze(-1))
    # Slots past a sequence's end may hold NaN; 0 * NaN would leak into the sum.
    values = torch.where(stored.view(b, n, 1, 1), kv[..., :HEAD_DIM_V], 0.0)
    out = torch.einsum("bgksn,bngd->bsgkd", probs, values).reshape(b, s_q, h_q, HEAD_DIM_V)
    lse = torch.where(seen, lse, float("inf")).reshape(b, h_q, s_q)
    return out.to(q.dtype), lse


SPARSE_CHUNK_FLOATS = 1 << 26  # the gathered tokens of one chunk of rows: 256 MiB in float32


def sparse_attention(
    q: torch.Tensor,
    tokens: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    is_fp8_kvcache: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of each query row over the tokens its indices name.

    q `[n, h_q, 576]`; tokens `[num_slots, 576]` in q's dtype, or `[num_slots, 656]` in the FP8
    layout (read as value * scale rounded to q's dtype); indices int `[n, topk]`, slots into
    tokens, any entry outside `[0, num_slots)` not attended. The math runs in float32, or in
    float64 for a float64 q, over chunks of rows whose gathered tokens hold about
    `SPARSE_CHUNK_FLOATS` values (a prefill's rows would take n · topk · 576 at once). Returns
    out `[n, h_q, 512]` (q's dtype), and float32 (float64) max_logits `[n, h_q]` (the largest
    scaled score) and lse `[n, h_q]` (natural log); a row that attends no token gets out = 0,
    max_logits = -inf and lse = +inf.
    """
    rows = max(1, SPARSE_CHUNK_FLOATS // (max(1, indices.shape[1]) * HEAD_DIM))
    parts = [
        _sparse_rows(q[i : i + rows], tokens, indices[i : i + rows], softmax_scale, is_fp8_kvcache)
        for i in range(0, max(1, q.shape[0]), rows)
    ]
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(pieces) for pieces in zip(*parts, strict=True))


def _sparse_rows(q, tokens, indices, softmax_scale, is_fp8_kvcache):
    num_slots = tokens.shape[0]
    compute = torch.promote_types(q.dtype, torch.float32)
    valid = (indices >= 0) & (indices < num_slots)  # [n, topk]
    source = tokens.view(torch.uint8) if is_fp8_kvcache else tokens
    gathered = source[torch.where(valid, indices, 0).long()]  # [n, topk, width]
    kv = dequantize_fp8(gathered).to(q.dtype) if is_fp8_kvcache else gathered
    # Unattended slots may hold NaN, and 0 * NaN would reach the sum.
    kv = torch.where(valid.unsqueeze(-1), kv.to(compute), 0.0)
    scores = torch.einsum("nhd,ntd->nht", q.to(compute), kv) * softmax_scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [n, h_q]
    max_logits = scores.amax(dim=-1)
    seen = valid.any(dim=-1, keepdim=True)  # [n, 1]
    probs = torch.exp(scores - torch.where(seen, lse, 0.0).unsqueeze(-1))
    out = torch.einsum("nht,ntd->nhd", probs, kv[..., :HEAD_DIM_V])
    return out.to(q.dtype), max_logits, torch.where(seen, lse, float("inf"))
