import math

import pytest
import torch

from mla_kernels.fp8_layout import dequantize_fp8
from mla_kernels.testing import NAN_BYTE, DecodeCase, decode_case


def float64_attention(case: DecodeCase, softmax_scale: float, causal: bool):
    """Token by token in float64, straight from the definition: the independent oracle. A
    token on a page past the block table, or whose entry lies outside the cache, is not
    attended."""
    q = case.q.double().cpu()
    cache = case.k_cache.cpu()
    # The FP8 layout is read as value * scale rounded to the queries' dtype.
    dtype = case.q.dtype
    cache = dequantize_fp8(cache).to(dtype).double() if case.is_fp8_kvcache else cache.double()
    num_blocks, page_size, h_kv = cache.shape[:3]
    b, s_q, h_q, _ = q.shape
    out = torch.zeros(b, s_q, h_q, 512, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64)
    for i, n in enumerate(case.cache_seqlens.tolist()):
        pages = case.block_table[i].tolist()
        blocks = [pages[t // page_size] if t // page_size < len(pages) else -1 for t in range(n)]
        for s in range(s_q):
            visible = n - s_q + s + 1 if causal else n
            attended = [t for t in range(max(visible, 0)) if 0 <= blocks[t] < num_blocks]
            if not attended:
                continue
            tokens = torch.stack(
                [cache[blocks[t], t % page_size] for t in attended]
            )  # [attended, h_kv, 576]
            for h in range(h_q):
                kv = tokens[:, h // (h_q // h_kv)]
                scores = kv @ q[i, s, h] * softmax_scale
                lse[i, h, s] = torch.logsumexp(scores, 0)
                out[i, s, h] = torch.softmax(scores, 0) @ kv[:, :512]
    return out, lse


@pytest.fixture
def oracle():
    return float64_attention


def float64_sparse_attention(q, tokens, indices, softmax_scale, is_fp8_kvcache):
    """Row by row in float64 from the definition: q `[n, h_q, 576]` attends the rows of tokens
    `[num_slots, 576 or 656]` that indices `[n, topk]` name (an FP8 token read as value * scale
    rounded to q's dtype). Returns out `[n, h_q, 512]`, max_logits and lse `[n, h_q]`."""
    cache = dequantize_fp8(tokens).to(q.dtype) if is_fp8_kvcache else tokens
    cache = cache.cpu().double()
    n, h_q, _ = q.shape
    out = torch.zeros(n, h_q, 512, dtype=torch.float64)
    max_logits = torch.full((n, h_q), -math.inf, dtype=torch.float64)
    lse = torch.full((n, h_q), math.inf, dtype=torch.float64)
    for row, chosen in enumerate(indices.tolist()):
        attended = [slot for slot in chosen if 0 <= slot < cache.shape[0]]
        if not attended:
            continue
        kv = cache[attended]  # [attended, 576]
        scores = q[row].cpu().double() @ kv.T * softmax_scale  # [h_q, attended]
        max_logits[row] = scores.max(dim=-1).values
        lse[row] = torch.logsumexp(scores, dim=-1)
        out[row] = torch.softmax(scores, dim=-1) @ kv[:, :512]
    return out, max_logits, lse


@pytest.fixture
def sparse_oracle():
    return float64_sparse_attention


def case_with_missing_blocks(s_q, h_q, is_fp8_kvcache, device, generator) -> DecodeCase:
    """Four sequences, pages of 64, whose tokens are partly or wholly without a cache block: a
    -1 entry inside the first, an entry past the cache at the second's last page, the third
    40 tokens longer than the table, the fourth all -1. Block 0, where a -1 entry taken as a
    slot would read, holds NaN."""
    case = decode_case(
        [300, 200, 320, 70], s_q, h_q, is_fp8_kvcache=is_fp8_kvcache, device=device,
        generator=generator,
    )  # fmt: skip
    table, cache = case.block_table, case.k_cache
    num_blocks, page_size = cache.shape[:2]
    if (table == 0).any():  # move block 0 to a spare one
        spare = next(b for b in range(num_blocks) if not (table == b).any())
        cache[spare] = cache[0]
        table[table == 0] = spare
    cache[0].view(torch.uint8).fill_(NAN_BYTE)
    table[0, 1] = -1
    table[1, 3] = num_blocks + 7
    case.cache_seqlens[2] = table.shape[1] * page_size + 40
    table[3] = -1
    return case


@pytest.fixture
def missing_blocks_case():
    return case_with_missing_blocks


def fresh_generator(device: str) -> torch.Generator:
    """Fresh random inputs every run; the seed is printed so a failing run can be repeated."""
    seed = int(torch.randint(0, 2**31, ()))
    print(f"generator seed {seed}")
    return torch.Generator(device=device).manual_seed(seed)


@pytest.fixture
def generator():
    return fresh_generator("cpu")


@pytest.fixture
def cuda_generator():
    return fresh_generator("cuda")
