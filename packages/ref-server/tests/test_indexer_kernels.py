"""DeepSeek-V3.2's indexer kernels (`ref_server.kernels.indexer`): the logits' default
implementation (the torch reference) against a float64 formula written out query by query, on
values worked by hand, ragged and causal key ranges, page sizes 16-128 and padded block tables;
the top-k selection with ties and too few keys; cache slots; argument checks; opcheck; the
kernel's error bound on Hopper; the Triton kernel against the reference in Triton's interpreter
(where triton is installed) and on the GPU (`gpu` marker, within that bound) at V3.2's shapes,
with CUDA graph replays."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ref_server.kernels import indexer
from ref_server.kernels.indexer import (
    FP8,
    cache_slots,
    index_logits,
    index_logits_paged,
    index_topk,
    logits_error_bound,
    triton_by_environment,
    triton_index_logits,
    triton_index_logits_paged,
)

gpu = pytest.mark.gpu
INF = float("inf")


# ---- independent references ----


def logits_f64(q, weights, keys, scales, ranges) -> torch.Tensor:
    """float64 `[queries, keys]`: query i's logits over keys `[n, d]` e4m3 with scales `[n]` in
    its range (lo, hi), -inf elsewhere. q `[queries, h, d]` e4m3, weights `[queries, h]`."""
    q, keys = q.double().cpu(), keys.double().cpu()
    weights, scales = weights.double().cpu(), scales.double().cpu()
    out = torch.full((len(q), len(keys)), -INF, dtype=torch.float64)
    for i, (lo, hi) in enumerate(ranges):
        lo, hi = max(lo, 0), min(hi, len(keys))
        if lo < hi:
            dots = q[i] @ keys[lo:hi].T  # [h, keys]
            out[i, lo:hi] = (weights[i, :, None] * dots.clamp(min=0)).sum(0) * scales[lo:hi]
    return out


def paged_f64(q, weights, k_cache, k_scale, block_table, seqlens) -> torch.Tensor:
    """float64 `[b, s_q, max_pages * page_size]`: each sequence's keys gathered slot by slot, its
    query i seeing positions up to seqlens - s_q + i."""
    b, s_q = q.shape[:2]
    page_size = k_cache.shape[1]
    width = block_table.shape[1] * page_size
    out = torch.full((b, s_q, width), -INF, dtype=torch.float64)
    for j in range(b):
        length = min(int(seqlens[j]), width)
        slots = [(int(block_table[j, p // page_size]), p % page_size) for p in range(length)]
        keys = torch.stack([k_cache[page, offset] for page, offset in slots]) if slots else None
        if keys is None:
            continue
        scales = torch.stack([k_scale[page, offset] for page, offset in slots])
        ranges = [(0, int(seqlens[j]) - s_q + 1 + i) for i in range(s_q)]
        out[j, :, :length] = logits_f64(q[j], weights[j], keys, scales, ranges)
    return out


def assert_logits(got: torch.Tensor, want: torch.Tensor, tolerance: float | torch.Tensor) -> None:
    """-inf exactly where want has it; elsewhere within tolerance: a float, relative to want's
    largest magnitude; a tensor as want, each element's bound (`logits_error_bound`)."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    got, want = got.double().cpu(), want.double().cpu()
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite) and (got[~finite] == -INF).all()
    if isinstance(tolerance, float):
        scale = want[finite].abs().max().item() if finite.any() else 1.0
        torch.testing.assert_close(
            got[finite], want[finite], rtol=tolerance, atol=tolerance * scale
        )
        return
    error, bound = (got - want)[finite].abs(), tolerance.double().cpu()[finite]
    over = (error > bound).nonzero().squeeze(1)
    assert not len(over), (
        f"{len(over)} of {len(error)} logits off by more than their bound, up to "
        f"{(error / bound).max().item():.3g} times it (first: {error[over[0]].item():.4g} > "
        f"{bound[over[0]].item():.4g})"
    )


# ---- inputs ----


def fp8(shape, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * 2).to(FP8)


def ragged_inputs(tokens, keys, heads, dim, g):
    q, k = fp8((tokens, heads, dim), g), fp8((keys, dim), g)
    weights = torch.randn(tokens, heads, generator=g)
    k_scale = torch.rand(keys, generator=g) + 0.01
    return q, weights, k, k_scale


def paged_inputs(seqlens, s_q, heads, dim, page_size, g, spare_pages=1):
    """Arguments of index_logits_paged: pages in random order, each table row padded with
    `spare_pages` entries past its pages, holding out-of-range page ids."""
    b = len(seqlens)
    needed = [-(-max(n, 0) // page_size) for n in seqlens]
    pages = sum(needed) + 2
    order = torch.randperm(pages, generator=g)
    max_pages = max(needed) + spare_pages
    block_table = torch.full((b, max_pages), pages + 1000, dtype=torch.int32)
    block_table[:, -1] = -5
    used = 0
    for j, n in enumerate(needed):
        block_table[j, :n] = order[used : used + n]
        used += n
    q = fp8((b, s_q, heads, dim), g)
    weights = torch.randn(b, s_q, heads, generator=g)
    k_cache = fp8((pages, page_size, dim), g)
    k_scale = torch.rand(pages, page_size, generator=g) + 0.01
    seqlens = torch.tensor(seqlens, dtype=torch.int32)
    return q, weights, k_cache, k_scale, block_table, seqlens


def worked_example():
    """Two queries of 2 heads of dim 2 over 3 keys, the logits worked by hand (e4m3 holds every
    value exactly): key 0 gets 0.5 * relu(1 + 2) * 1 from head 0 (head 1's -0.5 is cut);
    key 2 0.5 * relu(0.5 + 0.5) * 4; key 1 nothing; the second query sees key 1 only, where
    head 1 gives -1 * relu(2) * 0.25."""
    q = torch.tensor([[[1.0, 2.0], [-1.0, 0.5]], [[0.0, 1.0], [1.0, 0.0]]]).to(FP8)
    weights = torch.tensor([[0.5, 2.0], [1.0, -1.0]])
    k = torch.tensor([[1.0, 1.0], [2.0, -4.0], [0.5, 0.25]]).to(FP8)
    k_scale = torch.tensor([1.0, 0.25, 4.0])
    ks, ke = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32)
    want = torch.tensor([[1.5, 0.0, 2.0], [-INF, -0.5, -INF]])
    return (q, weights, k, k_scale, ks, ke), want


def worked_example_paged():
    """The first query of `worked_example` as decode (s_q 1, seqlens 3) over pages of 2 slots:
    keys 0 and 1 in page 1, key 2 in page 0's first slot; the logits 4 wide."""
    (q, weights, k, k_scale, _, _), want = worked_example()
    k_cache = torch.stack([torch.cat([k[2:], k[:1]]), k[:2]])  # page 0 slot 1: unread
    scales = torch.stack([torch.tensor([4.0, 9.0]), k_scale[:2]])
    block_table = torch.tensor([[1, 0]], dtype=torch.int32)
    args = (q[:1, None], weights[:1, None], k_cache, scales, block_table, torch.tensor([3]).int())
    return args, torch.cat([want[:1], torch.tensor([[-INF]])], 1)[:, None]


# ---- the reference on the CPU ----


def test_worked_example_gives_the_hand_computed_logits():
    args, want = worked_example()
    torch.testing.assert_close(index_logits(*args), want, rtol=0, atol=0)
    args, want = worked_example_paged()
    torch.testing.assert_close(index_logits_paged(*args), want, rtol=0, atol=0)


@pytest.mark.parametrize("chunk_values", [1 << 26, 1 << 12], ids=["one-chunk", "chunks"])
def test_ragged_logits_are_the_float64_formula(chunk_values, monkeypatch):
    monkeypatch.setattr(indexer, "REFERENCE_CHUNK_VALUES", chunk_values)
    g = torch.Generator().manual_seed(chunk_values)
    q, weights, k, k_scale = ragged_inputs(9, 300, 64, 128, g)
    # two packed causal sequences, an empty range, a negative start, an end past the keys
    ranges = [
        (0, 1),
        (0, 2),
        (0, 170),
        (170, 171),
        (170, 300),
        (5, 5),
        (9, 3),
        (-4, 20),
        (250, 999),
    ]
    ks, ke = (torch.tensor(list(column), dtype=torch.int32) for column in zip(*ranges, strict=True))
    got = index_logits(q, weights, k, k_scale, ks, ke)
    assert_logits(got, logits_f64(q, weights, k, k_scale, ranges), 1e-5)


@pytest.mark.parametrize("chunk_values", [1 << 26, 1 << 12], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("s_q", [1, 2, 3])
@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
def test_paged_logits_are_the_float64_formula_up_to_each_query(
    page_size, s_q, chunk_values, monkeypatch
):
    monkeypatch.setattr(indexer, "REFERENCE_CHUNK_VALUES", chunk_values)
    g = torch.Generator().manual_seed(page_size * 10 + s_q)
    # a sequence shorter than s_q, one of a page exactly, one ending inside a page
    seqlens = [s_q - 1, page_size, 3 * page_size + 5]
    args = paged_inputs(seqlens, s_q, 64, 128, page_size, g)
    got = index_logits_paged(*args)
    assert got.shape == (3, s_q, args[4].shape[1] * page_size)
    want = paged_f64(*args)
    assert_logits(got, want, 1e-5)
    for j, n in enumerate(seqlens):  # causal: query i sees exactly n - s_q + i + 1 positions
        seen = want[j].isfinite().sum(-1)
        assert seen.tolist() == [max(n - s_q + i + 1, 0) for i in range(s_q)]


def test_other_head_counts_and_widths():
    g = torch.Generator().manual_seed(3)
    args = paged_inputs([7, 40], 2, 5, 48, 16, g)
    assert_logits(index_logits_paged(*args), paged_f64(*args), 1e-5)


def opcheck(op, args) -> None:
    """torch.library.opcheck but its test_schema (which compares inputs with torch.allclose,
    that has no float8 kernels): that the inputs come back unchanged is checked here."""
    before = [t.clone() for t in args]
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op, args, test_utils=utils)
    for was, now in zip(before, args, strict=True):
        assert torch.equal(was.view(torch.uint8), now.view(torch.uint8))


def test_opcheck():
    g = torch.Generator().manual_seed(4)
    q, weights, k, k_scale = ragged_inputs(5, 40, 4, 32, g)
    ks, ke = torch.tensor([0, 0, 3, 10, 20]).int(), torch.tensor([1, 2, 30, 40, 11]).int()
    opcheck(index_logits, (q, weights, k, k_scale, ks, ke))
    opcheck(index_logits_paged, paged_inputs([3, 20], 2, 4, 32, 16, g))


# ---- top-k and slots ----


def assert_topk(positions: torch.Tensor, logits: torch.Tensor, k: int) -> None:
    """positions `[rows, k]` holds, in any order, distinct positions of k largest finite logits
    of each row (any of equal ones), then -1 for the rest."""
    assert positions.dtype == torch.int32 and positions.shape == (len(logits), k)
    for row, chosen in zip(logits, positions, strict=True):
        finite = int(row.isfinite().sum())
        taken = chosen[chosen >= 0]
        assert len(taken) == min(k, finite) and (chosen == -1).sum() == k - len(taken)
        assert len(set(taken.tolist())) == len(taken)
        want = row.sort(descending=True).values[: len(taken)]
        torch.testing.assert_close(row[taken.long()].sort(descending=True).values, want)


def test_topk_takes_the_largest_with_ties_and_pads_with_minus_one():
    g = torch.Generator().manual_seed(5)
    ties = torch.randint(0, 4, (4, 300), generator=g).float()  # many equal at the k-th place
    distinct = torch.randn(4, 300, generator=g)
    logits = torch.cat([ties, distinct])
    logits[1, 100:] = -INF  # 100 finite, fewer than k
    logits[5, :] = -INF  # none
    logits[6, ::2] = -INF  # 150, the same as k
    positions = index_topk(logits, 150)
    assert_topk(positions, logits, 150)
    assert (positions[1] >= 0).sum() == 100 and (positions[5] == -1).all()
    assert sorted(positions[6].tolist()) == list(range(1, 300, 2))


def test_topk_of_rows_narrower_than_k():
    logits = torch.tensor([[0.5, -INF, 2.0], [1.0, 1.0, 1.0]])
    positions = index_topk(logits.view(2, 1, 3), 5)
    assert positions.shape == (2, 1, 5)
    assert sorted(positions[0, 0].tolist()) == [-1, -1, -1, 0, 2]
    assert sorted(positions[1, 0].tolist()) == [-1, -1, 0, 1, 2]


def test_cache_slots_follow_the_block_table():
    g = torch.Generator().manual_seed(6)
    block_table = torch.randperm(40, generator=g)[:12].view(3, 4).int()
    positions = torch.randint(-1, 4 * 16, (3, 2, 7), generator=g).int()
    slots = cache_slots(positions, block_table, 16)
    for j in range(3):
        for i in range(2):
            for c in range(7):
                p = int(positions[j, i, c])
                want = -1 if p < 0 else int(block_table[j, p // 16]) * 16 + p % 16
                assert slots[j, i, c] == want
    assert slots.dtype == torch.int32 and slots.shape == positions.shape


# ---- argument checks and the switch ----


def _ragged_args():
    g = torch.Generator().manual_seed(7)
    ks, ke = torch.zeros(3, dtype=torch.int32), torch.full((3,), 8, dtype=torch.int32)
    return dict(
        zip(["q", "weights", "k", "k_scale"], ragged_inputs(3, 8, 4, 32, g), strict=True)
    ) | dict(ks=ks, ke=ke)


def _paged_args():
    g = torch.Generator().manual_seed(8)
    names = ["q", "weights", "k_cache", "k_scale", "block_table", "seqlens"]
    return dict(zip(names, paged_inputs([5, 9], 1, 4, 32, 16, g), strict=True))


BAD_RAGGED = {
    "q": lambda a: a["q"].float(),
    "weights": lambda a: a["weights"][:, :2],
    "k": lambda a: a["k"][:, :16],
    "k_scale": lambda a: a["k_scale"].double(),
    "ks": lambda a: a["ks"].long(),
    "ke": lambda a: a["ke"][:2],
}
BAD_PAGED = {
    "q": lambda a: a["q"][0],
    "weights": lambda a: a["weights"].bfloat16(),
    "k_cache": lambda a: a["k_cache"].bfloat16(),
    "k_scale": lambda a: a["k_scale"][:, :8],
    "block_table": lambda a: a["block_table"][:1],
    "seqlens": lambda a: a["seqlens"].long(),
}


@pytest.mark.parametrize("name", BAD_RAGGED)
def test_bad_ragged_arguments_raise_naming_them(name):
    for function in (index_logits, triton_index_logits):
        args = _ragged_args()
        args[name] = BAD_RAGGED[name](args)
        with pytest.raises(ValueError, match=rf"^{name} must"):
            function(**args)


@pytest.mark.parametrize("name", BAD_PAGED)
def test_bad_paged_arguments_raise_naming_them(name):
    for function in (index_logits_paged, triton_index_logits_paged):
        args = _paged_args()
        args[name] = BAD_PAGED[name](args)
        with pytest.raises(ValueError, match=rf"^{name} must"):
            function(**args)


def test_bad_topk_and_slots_arguments_raise_naming_them():
    with pytest.raises(ValueError, match=r"^logits must"):
        index_topk(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^k must"):
        index_topk(torch.zeros(2, 8), 0)
    table = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^positions must"):
        cache_slots(torch.zeros(2, 4, dtype=torch.int64), table, 16)
    with pytest.raises(ValueError, match=r"^block_table must"):
        cache_slots(torch.zeros(3, 4, dtype=torch.int32), table, 16)
    with pytest.raises(ValueError, match=r"^page_size must"):
        cache_slots(torch.zeros(2, 4, dtype=torch.int32), table, 0)


@pytest.mark.parametrize("installed", [True, False])
def test_the_switch_reads_0_or_1_and_is_on_where_triton_is_installed(monkeypatch, installed):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name: (object() if installed else None) if name == "triton" else find_spec(name),
    )
    monkeypatch.delenv(indexer.SWITCH, raising=False)
    assert triton_by_environment() == installed
    monkeypatch.setenv(indexer.SWITCH, "0")
    assert not triton_by_environment()
    monkeypatch.setenv(indexer.SWITCH, "1")
    assert triton_by_environment()
    monkeypatch.setenv(indexer.SWITCH, "yes")
    with pytest.raises(ValueError, match=indexer.SWITCH):
        triton_by_environment()


# ---- the kernel's error bound on Hopper ----


def test_the_error_bound_is_the_terms_magnitudes_and_wrong_logits_exceed_it():
    """`logits_error_bound` is FP8_DOT_UNIT (plus fp32's share) of the float64 formula over the
    arguments' absolute values; the exact logits stay within it, and logits with a head left
    out, each key's neighbour's, the keys' scales left out or a channel left out exceed it at a
    large share of the keys, so the GPU tests that assert it would fail such a kernel."""
    g = torch.Generator().manual_seed(13)
    q, weights, k, k_scale = ragged_inputs(40, 300, 64, 128, g)
    ranges = [(0, 100 + 5 * i) for i in range(40)]
    ks, ke = (torch.tensor(column, dtype=torch.int32) for column in zip(*ranges, strict=True))
    bound = logits_error_bound(index_logits, q, weights, k, k_scale, ks, ke)
    absolute = [x.float().abs().to(FP8) for x in (q, k)]
    magnitudes = logits_f64(absolute[0], weights.abs(), absolute[1], k_scale, ranges)
    unit = indexer.FP8_DOT_UNIT + (128 + 64) * indexer.FP32_UNIT
    assert_logits(bound, magnitudes * unit, 1e-5)
    want = logits_f64(q, weights, k, k_scale, ranges)
    assert_logits(want.float(), want, bound)
    seen = want.isfinite()
    wrong = {
        "a head": (logits_f64(q[:, 1:], weights[:, 1:], k, k_scale, ranges), 0.3),
        "the key": (logits_f64(q, weights, k.roll(-1, 0), k_scale.roll(-1, 0), ranges), 0.9),
        "the scale": (logits_f64(q, weights, k, torch.ones_like(k_scale), ranges), 0.9),
        "a channel": (logits_f64(q[..., 1:], weights, k[:, 1:], k_scale, ranges), 0.6),
    }
    for name, (logits, share) in wrong.items():
        over = ((logits - want)[seen].abs() > bound.double()[seen]).double().mean().item()
        assert over > share, f"without {name}: {over:.2f} of the logits over the bound"
        with pytest.raises(AssertionError, match="off by more than their bound"):
            assert_logits(logits.float(), want, bound)


# ---- the Triton kernel on the CPU, through Triton's interpreter ----


def test_the_kernel_in_triton_s_interpreter(in_triton_interpreter):
    """`interpreted_checks`, in Triton's interpreter."""
    in_triton_interpreter(__file__)


def interpreted_checks():
    """The kernel against the reference: the worked examples; paged decode at V3.2's 64 heads
    of 128 over page sizes 16-128, s_q 1-3, sequences shorter than s_q and padded tables, with
    one tile a program and with several; other head counts and widths; a packed causal
    prefill with odd ranges."""
    args, want = worked_example()
    torch.testing.assert_close(triton_index_logits(*args), want, rtol=0, atol=0)
    args, want = worked_example_paged()
    torch.testing.assert_close(triton_index_logits_paged(*args), want, rtol=0, atol=0)
    g = torch.Generator().manual_seed(9)
    for target_programs in (indexer.TARGET_PROGRAMS, 1):
        indexer.TARGET_PROGRAMS = target_programs
        for page_size, s_q in ((16, 1), (64, 2), (128, 3)):
            args = paged_inputs([s_q - 1, 2 * page_size, page_size + 3], s_q, 64, 128, page_size, g)
            assert_logits(triton_index_logits_paged(*args), index_logits_paged(*args), 1e-5)
        args = paged_inputs([7, 40], 2, 5, 48, 16, g)
        assert_logits(triton_index_logits_paged(*args), index_logits_paged(*args), 1e-5)
        q, weights, k, k_scale = ragged_inputs(37, 37, 64, 128, g)
        ks = torch.tensor([0] * 20 + [20] * 15 + [30, 5]).int()
        ke = torch.tensor([*range(1, 36), 10, 99]).int()
        got = triton_index_logits(q, weights, k, k_scale, ks, ke)
        assert_logits(got, index_logits(q, weights, k, k_scale, ks, ke), 1e-5)


# ---- the GPU ----

GPU_PAGED = [  # seqlens, s_q, page_size
    ([4096] * 64, 1, 64),
    ([8192 - 37 * i for i in range(128)], 2, 64),
    ([1, 2, 3, 1000, 2049], 3, 16),
    ([70000, 3], 1, 128),
]


@gpu
@pytest.mark.parametrize("seqlens, s_q, page_size", GPU_PAGED)
def test_the_paged_kernel_is_the_reference_on_cuda(seqlens, s_q, page_size, monkeypatch):
    g = torch.Generator().manual_seed(len(seqlens) + s_q)
    args = [x.cuda() for x in paged_inputs(seqlens, s_q, 64, 128, page_size, g)]
    monkeypatch.setenv(indexer.SWITCH, "0")
    want = index_logits_paged(*args)  # the reference
    bound = logits_error_bound(index_logits_paged, *args)
    monkeypatch.setenv(indexer.SWITCH, "1")
    assert_logits(index_logits_paged(*args), want, bound)


@gpu
def test_the_ragged_kernel_is_the_reference_on_cuda(monkeypatch):
    g = torch.Generator().manual_seed(10)
    lengths = [4096, 512, 512, 1, 100]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    ks = torch.tensor([s for s, n in zip(starts, lengths, strict=True) for _ in range(n)]).int()
    ke = torch.arange(1, sum(lengths) + 1).int()
    args = [x.cuda() for x in (*ragged_inputs(sum(lengths), sum(lengths), 64, 128, g), ks, ke)]
    monkeypatch.setenv(indexer.SWITCH, "0")
    want = index_logits(*args)
    bound = logits_error_bound(index_logits, *args)
    monkeypatch.setenv(indexer.SWITCH, "1")
    assert_logits(index_logits(*args), want, bound)


@gpu
def test_captured_in_a_cuda_graph_and_replayed_with_new_values(monkeypatch):
    monkeypatch.setenv(indexer.SWITCH, "1")
    g = torch.Generator().manual_seed(11)
    args = [x.cuda() for x in paged_inputs([3000, 64, 1], 2, 64, 128, 64, g)]
    index_logits_paged(*args)  # compiles the kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = index_logits_paged(*args)
        positions = index_topk(logits, 2048)
        slots = cache_slots(positions, args[4], 64)
    new = paged_inputs([60, 2990, 1], 2, 64, 128, 64, g)  # as many pages, other lengths
    for arg, value in zip(args, new, strict=True):
        arg.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    # the replay is the kernel on the new values, bit for bit; its accuracy is tested above
    assert torch.equal(logits, index_logits_paged(*args))
    assert_topk(positions.flatten(0, 1).cpu(), logits.flatten(0, 1).cpu(), 2048)
    torch.testing.assert_close(slots.cpu(), cache_slots(positions.cpu(), new[4], 64))


@gpu
def test_opcheck_on_cuda(monkeypatch):
    monkeypatch.setenv(indexer.SWITCH, "1")
    g = torch.Generator().manual_seed(12)
    args = [x.cuda() for x in paged_inputs([300, 20], 2, 64, 128, 64, g)]
    opcheck(index_logits_paged, args)


if __name__ == "__main__":
    interpreted_checks()
