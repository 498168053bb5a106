import math

import pytest
import torch

from mla_kernels.fp8_layout import dequantize_fp8
from mla_kernels.testing import DecodeCase


def float64_attention(case: DecodeCase, softmax_scale: float, causal: bool):
    """Token by token in float64, straight from the definition: the independent oracle."""
    q = case.q.double().cpu()
    cache = case.k_cache.cpu()
    # The FP8 layout is read as value * scale rounded to the queries' dtype.
    dtype = case.q.dtype
    cache = dequantize_fp8(cache).to(dtype).double() if case.is_fp8_kvcache else cache.double()
    page_size, h_kv = cache.shape[1], cache.shape[2]
    b, s_q, h_q, _ = q.shape
    out = torch.zeros(b, s_q, h_q, 512, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64)
    for i, n in enumerate(case.cache_seqlens.tolist()):
        pages = case.block_table[i].cpu().long()
        for s in range(s_q):
            visible = n - s_q + s + 1 if causal else n
            if visible <= 0:
                continue
            tokens = torch.stack(
                [cache[pages[t // page_size], t % page_size] for t in range(visible)]
            )  # [visible, h_kv, 576]
            for h in range(h_q):
                kv = tokens[:, h // (h_q // h_kv)]
                scores = kv @ q[i, s, h] * softmax_scale
                lse[i, h, s] = torch.logsumexp(scores, 0)
                out[i, s, h] = torch.softmax(scores, 0) @ kv[:, :512]
    return out, lse


@pytest.fixture
def oracle():
    return float64_attention


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
