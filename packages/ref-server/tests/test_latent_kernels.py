"""The new latent rows into the cache, and the rope of the queries (`ref_server::cache_latent`):
on the CPU, bit for bit what `rms_norm`, `rope`, `rope_into` and `mla_kernels.write_kv_cache`
wrote before it, with opcheck, torch.compile and argument checks; its Triton kernel through
Triton's interpreter (where triton is installed), the queries bit for bit `rope_into`'s kernel's;
on the GPU (`gpu` marker), the kernel bit for bit the operators' kernels, in a CUDA graph,
opcheck."""

from __future__ import annotations

import pytest
import torch

import mla_kernels
import ref_server.model as M
from ref_server.kernels.latent import cache_latent, triton_cache_latent
from ref_server.kernels.norm import rms_norm
from ref_server.kernels.rope import rope, rope_into, triton_rope
from ref_server.model.layers import Rope

gpu = pytest.mark.gpu
EPS = 1e-6
BLOCKS, PAGE = 6, 16
NOPE, LATENT = 128, 512  # a query head's nope columns (then its 64 rope columns); the latent's
# (kv, kv_a_layernorm's weight) dtypes: the GPU model's, the CPU model's, mixed ones
DTYPES = [
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.bfloat16),
]


def problem(n, dtype, weight_dtype, device="cpu", cache_dtype=torch.bfloat16, seed=0):
    """(kv `[n, 576]`, the kv_a columns of a wider fused projection output, N(0, 1) times a
    power of two per token; weight `[512]` around 1; cos and sin `[n, 1, 32]` at random
    positions; a NaN-filled cache `[6, 16, 1, 576]`; n distinct random slots)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp2(torch.randint(-6, 7, (n, 1), generator=g))
    wide = torch.randn(n, 3072 + 576, generator=g) * scales
    kv = wide.to(device, dtype)[:, 3072:]
    weight = (1 + 0.5 * torch.randn(512, generator=g)).to(device, weight_dtype)
    positions = torch.randint(0, 163840, (n,), generator=g)
    cos, sin = Rope(M.PRESETS["v2-lite"])(positions.to(device), dtype)
    cache = torch.full((BLOCKS, PAGE, 1, 576), float("nan"), dtype=cache_dtype, device=device)
    slots = torch.randperm(BLOCKS * PAGE, generator=g)[:n].to(device)
    return kv, weight, cos, sin, cache, slots


def written_before(kv, weight, cos, sin, interleave, cache, slots) -> torch.Tensor:
    """The cache as the three operators left it (a copy of cache)."""
    want = cache.clone()
    latent = rms_norm(kv[:, :512], weight, EPS)
    key = rope(kv[:, None, 512:], cos, sin, interleave)[:, 0]
    mla_kernels.write_kv_cache(want, latent, key, slots, check_values=False)
    return want


def check(call, kv, weight, cos, sin, cache, slots, interleave, exact=True, q=None, q_out=None):
    """call writes what the operators wrote, and nothing else (the other slots stay NaN)."""
    want = written_before(kv, weight, cos, sin, interleave, cache, slots)
    call(kv, weight, EPS, cos, sin, interleave, cache, slots, q, q_out)
    rows, want_rows = cache.view(-1, 576), want.view(-1, 576)
    others = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    others[slots] = False
    assert rows[others].isnan().all()
    if exact:
        assert torch.equal(rows[slots], want_rows[slots])
    else:  # the interpreter: the mean's sum in another order, then a rounding to fp16
        got, expected = rows[slots].float(), want_rows[slots].float()
        assert torch.equal(got[:, 512:], expected[:, 512:])
        assert torch.allclose(got[:, :512], expected[:, :512], rtol=2**-10, atol=0)


def queries(n, heads, dtype, device="cpu", seed=0):
    """q's rope columns `[n, heads, 64]`, a view of the projection's output `[n, heads, 192]` (as
    `Attention._project` gives them), N(0, 1) times a power of two per token."""
    g = torch.Generator().manual_seed(1000 + seed)
    scales = torch.exp2(torch.randint(-6, 7, (n, 1, 1), generator=g))
    q = torch.randn(n, heads, NOPE + 64, generator=g) * scales
    return q.to(device, dtype)[..., NOPE:]


def destination(q, in_place):
    """(out, untouched): where the rotated q goes, the rope columns of a NaN-filled absorbed
    query `[n, heads, 576]` (decode) or q itself (prefill); untouched() says whether the values
    around out (the query's latent columns, q's rows' nope columns) are as they were."""
    if in_place:
        nope = q._base[..., :NOPE]
        before = nope.clone()
        return q, lambda: torch.equal(nope, before)
    query = q.new_full((*q.shape[:-1], LATENT + 64), float("nan"))
    return query[..., LATENT:], lambda: query[..., :LATENT].isnan().all()


def check_queries(call, args, interleave, q, in_place, want, exact=True):
    """call (cache_latent's arguments) with q writes the cache as `check` says, and want into
    `destination`'s out, nothing else."""
    out, untouched = destination(q, in_place)
    check(call, *args, interleave, exact, q, out)
    assert torch.equal(out, want)
    assert untouched()


# ---- CPU ----


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPES)
def test_the_operator_writes_what_the_three_operators_wrote(dtype, weight_dtype, interleave):
    check(cache_latent, *problem(11, dtype, weight_dtype, seed=3), interleave)


def test_int32_slots_and_no_tokens():
    kv, weight, cos, sin, cache, slots = problem(5, torch.float32, torch.float32, seed=1)
    check(cache_latent, kv, weight, cos, sin, cache, slots.int(), True)
    empty = problem(0, torch.float32, torch.float32)
    cache_latent(empty[0], empty[1], EPS, *empty[2:4], True, *empty[4:], None, None)
    assert empty[4].isnan().all()


def test_opcheck_on_cpu():
    kv, weight, cos, sin, cache, slots = problem(7, torch.bfloat16, torch.bfloat16)
    cache.zero_()  # opcheck compares outputs, and NaN is not equal to itself
    torch.library.opcheck(cache_latent, (kv, weight, EPS, cos, sin, True, cache, slots, None, None))


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPES)
def test_the_operator_rotates_the_queries_as_rope_into(dtype, weight_dtype, interleave, in_place):
    """Into the absorbed query's rope columns (decode) or in place (prefill), 16 and 20 heads
    (a block and a half of the kernel's)."""
    args = problem(11, dtype, weight_dtype, seed=3)
    cos, sin = args[2:4]
    for heads in (16, 20):
        q = queries(11, heads, dtype, seed=heads)
        want = torch.full_like(q, float("nan"))
        rope_into(q, cos, sin, interleave, want)
        assert torch.equal(want, rope(q, cos, sin, interleave))
        check_queries(cache_latent, args, interleave, q, in_place, want)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_queries_are_the_rotation_in_float64_to_within_the_roundings(dtype, interleave):
    """Each product and each sum rounded once: within two ulps of the products' magnitudes."""
    kv, weight, cos, sin, cache, slots = problem(9, dtype, dtype, seed=4)
    q = queries(9, 16, dtype, seed=4)
    out = torch.empty_like(q)
    cache_latent(kv, weight, EPS, cos, sin, interleave, cache, slots, q, out)
    x, c, s = q.double(), cos.double(), sin.double()
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else x.chunk(2, dim=-1)
    exact = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    products = torch.cat([(x1 * c).abs() + (x2 * s).abs(), (x2 * c).abs() + (x1 * s).abs()], -1)
    assert ((out.double() - exact).abs() <= 2 * torch.finfo(dtype).eps * products).all()


def test_the_queries_beside_the_latent_in_one_projection_row():
    check_beside_the_latent(cache_latent, torch.bfloat16)


def check_beside_the_latent(call, cache_dtype, exact=True):
    """Without q_lora, q and kv are columns of one projection's rows (`FusedLinear`): their
    memory spans interleave, which is no overlap of values; in place as prefill rotates."""
    kv_alone, weight, cos, sin, cache, slots = problem(
        6, torch.float16, torch.float16, cache_dtype=cache_dtype, seed=6
    )
    rows = torch.randn(6, 4 * (NOPE + 64) + 576).half()
    rows[:, -576:] = kv_alone
    q = rows[:, : 4 * (NOPE + 64)].unflatten(-1, (4, NOPE + 64))[..., NOPE:]
    kv = rows[:, -576:]
    want = rope(q, cos, sin, False)
    check(call, kv, weight, cos, sin, cache, slots, False, exact, q, q)
    assert torch.equal(q, want)
    assert torch.equal(kv, kv_alone)


def test_no_tokens_with_queries():
    kv, weight, cos, sin, cache, slots = problem(0, torch.float32, torch.float32)
    q = queries(0, 16, torch.float32)
    for call in (cache_latent, triton_cache_latent):
        for out in (q, torch.empty_like(q)):
            call(kv, weight, EPS, cos, sin, True, cache, slots, q, out)
    assert cache.isnan().all()


@pytest.mark.parametrize("in_place", [False, True])
def test_opcheck_with_queries_on_cpu(in_place):
    kv, weight, cos, sin, cache, slots = problem(7, torch.bfloat16, torch.bfloat16)
    cache.zero_()
    q = queries(7, 16, torch.bfloat16)
    out = q if in_place else torch.zeros_like(q)
    torch.library.opcheck(cache_latent, (kv, weight, EPS, cos, sin, True, cache, slots, q, out))


def test_the_fake_implementation_takes_the_queries():
    kv, weight, cos, sin, cache, slots = problem(7, torch.bfloat16, torch.bfloat16, "meta")
    q = queries(7, 16, torch.bfloat16, "meta")
    assert cache_latent(kv, weight, EPS, cos, sin, True, cache, slots, q, q) is None
    with pytest.raises(ValueError, match=r"q_out must have q's shape \(7, 16, 64\)"):
        cache_latent(kv, weight, EPS, cos, sin, True, cache, slots, q, q[:, :8])


def test_torch_compile_traces_the_operator_with_its_queries():
    """Decode's shape of call (into a new query buffer) and prefill's (in place), one graph."""
    kv, weight, cos, sin, cache, slots = problem(5, torch.bfloat16, torch.bfloat16)
    cache.zero_()
    q = queries(5, 16, torch.bfloat16)

    def step(kv, cos, sin, cache, q):
        query = q.new_zeros(*q.shape[:-1], LATENT + 64)
        cache_latent(kv, weight, EPS, cos, sin, True, cache, slots, q, query[..., LATENT:])
        cache_latent(kv, weight, EPS, cos, sin, True, cache, slots, q, q)
        return query

    want_cache, want_q = cache.clone(), q._base.clone()[..., NOPE:]
    want_query = step(kv, cos, sin, want_cache, want_q)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    query = compiled(kv, cos, sin, cache, q)
    assert torch.equal(query, want_query)
    assert torch.equal(q, want_q) and torch.equal(cache, want_cache)


def bad_arguments():
    kv, weight, cos, sin, cache, slots = problem(4, torch.float32, torch.float32)
    return [
        ((kv[:3], weight, EPS, cos, sin, True, cache, slots), r"kv must be \[n, 576\] with n = "),
        ((kv[:, :512], weight, EPS, cos, sin, True, cache, slots), r"got \(4, 512\)"),
        ((kv, weight[:64], EPS, cos, sin, True, cache, slots), r"weight must be \[512\]"),
        ((kv, weight, EPS, cos[:3], sin, True, cache, slots), r"cos must be \[n, 1, rope / 2\]"),
        ((kv, weight, EPS, cos, sin, True, cache[..., :512], slots), "cache must be a contig"),
        ((kv, weight, EPS, cos, sin, True, cache.float(), slots), "bfloat16 or float16"),
        ((kv, weight, EPS, cos, sin, True, cache, slots.float()), "int32 or int64, got"),
        (
            (kv, weight.to("meta"), EPS, cos, sin, True, cache, slots),
            "must share a device",
        ),
    ]


def bad_queries():
    """(q, q_out, the error's pattern) beside `problem(4, ...)`'s fp32 arguments."""
    q = queries(4, 16, torch.float32)
    whole = q._base
    return [
        (q, None, "q and q_out go together"),
        (None, q, "q and q_out go together"),
        (q[:3], q[:3], r"q must be \[n, heads, 64\] with n = slot_mapping's 4 slots"),
        (q[:, 0], q[:, 0], r"q must be \[n, heads, 64\] .* got \(4, 64\)"),
        (q[..., :32], q[..., :32], r"got \(4, 16, 32\)"),
        (q.double(), q.double(), r"q must be in kv's dtype and on its device"),
        (q.to("meta"), q.to("meta"), r"q must be in kv's dtype and on its device"),
        (q, torch.empty(4, 8, 64), r"q_out must have q's shape \(4, 16, 64\), got \(4, 8, 64\)"),
        (q, torch.empty_like(q).half(), r"q_out must be in q's dtype \(torch.float32\)"),
        (q, torch.empty_like(q, device="meta"), "q and q_out must be on one device"),
        (q, torch.empty(4, 16, 128)[..., ::2], "q_out's last dim must be contiguous"),
        # q itself is rotated in place; a view shifted by a few columns is not
        (q, whole[..., NOPE - 8 : -8], "q_out must not overlap q in memory"),
        (q, whole[..., :64], "q_out must not overlap q in memory"),
    ]


@pytest.mark.parametrize(("args", "message"), bad_arguments())
def test_bad_arguments_are_value_errors_naming_the_problem(args, message):
    q = queries(4, 16, torch.float32)
    for call in (cache_latent, triton_cache_latent):
        for queries_args in ((None, None), (q, torch.empty_like(q))):
            with pytest.raises(ValueError, match=message):
                call(*args, *queries_args)


@pytest.mark.parametrize(("q", "q_out", "message"), bad_queries())
def test_bad_queries_are_value_errors_and_nothing_is_written(q, q_out, message):
    kv, weight, cos, sin, cache, slots = problem(4, torch.float32, torch.float32)
    for call in (cache_latent, triton_cache_latent):
        with pytest.raises(ValueError, match=message):
            call(kv, weight, EPS, cos, sin, True, cache, slots, q, q_out)
        assert cache.isnan().all()


# ---- the Triton kernel on the CPU, through Triton's interpreter ----


def test_the_kernel_in_triton_s_interpreter(in_triton_interpreter):
    """`interpreted_checks`, in Triton's interpreter."""
    in_triton_interpreter(__file__)


def interpreted_checks():
    """fp32 and fp16 rows into an fp16 cache (the interpreter rounds to fp16 as torch does; to
    bf16 it truncates), both rope layouts, int64 and int32 slots."""
    for dtype in (torch.float32, torch.float16):
        for interleave in (True, False):
            kv, weight, cos, sin, cache, slots = problem(
                9, dtype, dtype, cache_dtype=torch.float16, seed=int(interleave)
            )
            check(triton_cache_latent, kv, weight, cos, sin, cache, slots, interleave, False)
    kv, weight, cos, sin, cache, slots = problem(3, torch.float32, torch.float32, seed=5)
    check(triton_cache_latent, kv, weight, cos, sin, cache.half(), slots.int(), True, False)
    interpreted_query_checks()


def interpreted_query_checks():
    """The queries bit for bit what `rope_into`'s kernel writes (interpreted too: it rounds bf16
    as the kernel here does, by truncation), and for fp32 and fp16 what the CPU operator writes,
    the cache as before: into a query buffer and in place, both rope layouts, 4, 16 (one block
    of the kernel's), 20 and 128 heads, q's columns from its projection's rows and q with a last
    dim that is not contiguous (copied first, out of place only), q beside kv in one row."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for interleave in (True, False):
            for heads in (4, 16, 20, 128):
                args = problem(5, dtype, dtype, cache_dtype=torch.float16, seed=heads)
                cos, sin = args[2:4]
                q = queries(5, heads, dtype, seed=heads)
                want = triton_rope(q, cos, sin, interleave, torch.empty_like(q))
                if dtype != torch.bfloat16:
                    assert torch.equal(want, rope(q, cos, sin, interleave))
                for in_place in (False, True):
                    if dtype == torch.bfloat16:  # the cache's latent rounded by truncation
                        out, untouched = destination(q, in_place)
                        triton_cache_latent(*args[:2], EPS, cos, sin, interleave, *args[4:], q, out)
                        assert torch.equal(out, want) and untouched()
                    else:
                        check_queries(
                            triton_cache_latent, args, interleave, q, in_place, want, False
                        )
    args = problem(5, torch.float16, torch.float16, cache_dtype=torch.float16, seed=7)
    cos, sin = args[2:4]
    strided = torch.randn(5, 16, 128).half()[..., ::2]
    want = triton_rope(strided, cos, sin, True)
    out, untouched = destination(queries(5, 16, torch.float16), False)
    check(triton_cache_latent, *args, True, False, strided, out)
    assert torch.equal(out, want) and untouched()
    check_beside_the_latent(triton_cache_latent, torch.float16, exact=False)


# ---- GPU ----


@gpu
@pytest.mark.parametrize("n", [1, 7, 96])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPES)
def test_the_kernel_writes_what_the_three_kernels_wrote(dtype, weight_dtype, interleave, n):
    check(cache_latent, *problem(n, dtype, weight_dtype, "cuda", seed=n), interleave)


@gpu
def test_opcheck_on_cuda():
    kv, weight, cos, sin, cache, slots = problem(7, torch.bfloat16, torch.bfloat16, "cuda")
    cache.zero_()
    torch.library.opcheck(
        cache_latent, (kv, weight, EPS, cos, sin, False, cache, slots, None, None)
    )


@gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("n", [1, 7, 96])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPES)
def test_the_kernel_rotates_the_queries_as_rope_into_s_kernel(
    dtype, weight_dtype, interleave, n, heads
):
    """Into a NaN-filled query buffer, then in place: rope_into's kernel's values, which are the
    CPU operator's; the cache as the operators' kernels wrote it."""
    args = problem(n, dtype, weight_dtype, "cuda", seed=n)
    cos, sin = args[2:4]
    q = queries(n, heads, dtype, "cuda", seed=n + heads)
    want = torch.full_like(q, float("nan"))
    rope_into(q, cos, sin, interleave, want)
    assert torch.equal(want.cpu(), rope(q.cpu(), cos.cpu(), sin.cpu(), interleave))
    for in_place in (False, True):
        check_queries(cache_latent, args, interleave, q, in_place, want)


@gpu
@pytest.mark.parametrize("with_queries", [False, True])
def test_the_kernel_replays_in_a_cuda_graph(with_queries):
    """With queries, decode's call: into the rope columns of a static query buffer."""
    kv, weight, cos, sin, cache, slots = problem(8, torch.bfloat16, torch.bfloat16, "cuda")
    q = queries(8, 16, torch.bfloat16, "cuda")
    out, untouched = destination(q, in_place=False)
    queried = (q, out) if with_queries else (None, None)
    args = (kv, weight, EPS, cos, sin, True, cache, slots, *queried)
    cache_latent(*args)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cache_latent(*args)
    for seed in (1, 2):
        new = problem(8, torch.bfloat16, torch.bfloat16, "cuda", seed=seed)
        for mine, fresh in zip((kv, cos, sin, cache, slots), (new[0], *new[2:]), strict=True):
            mine.copy_(fresh)
        q.copy_(queries(8, 16, torch.bfloat16, "cuda", seed=seed))
        out.fill_(float("nan"))
        want = written_before(kv, weight, cos, sin, True, cache, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache.view(-1, 576)[slots], want.view(-1, 576)[slots])
        if with_queries:
            assert torch.equal(out, rope(q, cos, sin, True)) and untouched()
        else:
            assert out.isnan().all()


@gpu
@pytest.mark.parametrize("in_place", [False, True])
def test_opcheck_with_queries_on_cuda(in_place):
    kv, weight, cos, sin, cache, slots = problem(7, torch.bfloat16, torch.bfloat16, "cuda")
    cache.zero_()
    q = queries(7, 16, torch.bfloat16, "cuda")
    out = q if in_place else torch.zeros_like(q)
    torch.library.opcheck(cache_latent, (kv, weight, EPS, cos, sin, False, cache, slots, q, out))


if __name__ == "__main__":
    interpreted_checks()
