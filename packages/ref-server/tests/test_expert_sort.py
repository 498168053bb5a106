"""The expert sort operators (`ref_server::moe_sort_by_expert` and `..._and_gather`): on the
CPU, against an independent reference (a stable argsort, bincount, the inverse permutation)
and `RoutedExperts.grouped`'s code, with opcheck, fake shapes, torch.compile and argument
checks; their Triton kernels on the CPU through Triton's interpreter (where triton is
installed), one chunk and several; on the GPU (`gpu` marker), at decode and prefill sizes in
poisoned memory, in CUDA graphs, without waiting for the device or compiling per batch size."""

from __future__ import annotations

import pytest
import torch

from ref_server.kernels import expert_sort
from ref_server.kernels.expert_sort import (
    MAX_EXPERTS,
    moe_sort_by_expert,
    moe_sort_by_expert_and_gather,
    triton_moe_sort_by_expert,
)

gpu = pytest.mark.gpu


def random_ids(n, k, num_experts, invalid=0.3, seed=0, device="cpu"):
    """ids `[n, k]` int64: experts drawn uniformly, a fraction `invalid` of them -1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_experts, (n, k), generator=g)
    ids[torch.rand(n, k, generator=g) < invalid] = -1
    return ids.to(device)


def expected(ids, num_experts):
    """(order, offsets, rows) the operator must give, computed another way than its reference:
    ids out of [0, num_experts) count as -1."""
    flat = ids.flatten().cpu()
    valid = (flat >= 0) & (flat < num_experts)
    order = torch.where(valid, flat, num_experts).argsort(stable=True)
    counts = torch.bincount(flat[valid], minlength=num_experts)
    offsets = counts.cumsum(0).to(torch.int32)
    rows = torch.where(valid, order.argsort(), -1).view(ids.shape)
    return order, offsets, rows


def check(outputs, ids, num_experts, x=None) -> None:
    """outputs exactly `expected`'s (and with x, x[order // k]), in their dtypes and shapes."""
    order, offsets, rows = outputs[:3]
    assert order.dtype == torch.int64 and order.shape == (ids.numel(),)
    assert offsets.dtype == torch.int32 and offsets.shape == (num_experts,)
    assert rows.dtype == torch.int64 and rows.shape == ids.shape
    want = expected(ids, num_experts)
    for name, got, value in zip(("order", "offsets", "rows"), outputs[:3], want, strict=True):
        assert torch.equal(got.cpu(), value), name
    if x is not None:
        (gathered,) = outputs[3:]
        assert gathered.dtype == x.dtype and gathered.is_contiguous()
        assert torch.equal(gathered.cpu(), x.cpu()[want[0] // ids.shape[1]])


def grouped_bookkeeping(ids, num_experts):
    """`RoutedExperts.grouped`'s code before the operator (for ids in [-1, num_experts))."""
    n, k = ids.shape
    valid = ids.flatten() >= 0
    expert = torch.where(valid, ids.flatten(), num_experts)
    order = expert.argsort(stable=True)
    ends = torch.arange(1, num_experts + 1, device=ids.device)
    offsets = torch.searchsorted(expert[order], ends, out_int32=True)
    sorted_at = torch.arange(n * k, device=ids.device)
    rows = torch.empty_like(order).scatter_(0, order, sorted_at)
    rows = torch.where(valid, rows, -1).view(n, k)
    return order, offsets, rows


def out_of_range(n, k, num_experts, seed=0):
    """ids with every kind of value: experts, -1, below -1, num_experts and far above."""
    ids = random_ids(n, k, num_experts, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    wild = torch.tensor([-2, -(2**40), num_experts, num_experts + 1, 2**40])
    pick = torch.rand(n, k, generator=g) < 0.2
    ids[pick] = wild[torch.randint(0, len(wild), (int(pick.sum()),), generator=g)]
    return ids


# (name, ids, num_experts): the cases both the CPU and the interpreted kernels run
def cases():
    return [
        ("no tokens", torch.empty(0, 8, dtype=torch.int64), 64),
        ("one token", random_ids(1, 6, 64, invalid=0), 64),
        ("one token, some -1", torch.tensor([[3, -1, 0, 3, -1, 63]]), 64),
        ("all -1", torch.full((9, 8), -1), 16),
        ("all one expert", torch.full((11, 6), 5), 8),
        ("one expert in all", random_ids(7, 3, 1), 1),
        ("30% -1", random_ids(37, 8, 64, seed=1), 64),
        ("256 experts", random_ids(40, 8, 256, seed=2), 256),
        ("experts one short of a power of two", random_ids(20, 6, 63, seed=3), 63),
        ("experts no power of two", random_ids(13, 8, 5, seed=4), 5),
        ("ids out of range", out_of_range(25, 8, 12, seed=5), 12),
    ]


# ---- CPU ----


@pytest.mark.parametrize("name, ids, num_experts", cases())
def test_the_operator_on_the_cpu_is_the_expected_sort(name, ids, num_experts):
    check(moe_sort_by_expert(ids, num_experts), ids, num_experts)


@pytest.mark.parametrize("name, ids, num_experts", cases()[:-1])
def test_the_operator_is_the_grouped_code_it_replaces(name, ids, num_experts):
    """For ids in [-1, num_experts): bit for bit `RoutedExperts.grouped`'s tensors; order is
    the stable argsort of the expert with -1 as num_experts."""
    got = moe_sort_by_expert(ids, num_experts)
    for a, b in zip(got, grouped_bookkeeping(ids, num_experts), strict=True):
        assert torch.equal(a, b)
    keys = torch.where(ids >= 0, ids, num_experts).flatten()
    assert torch.equal(got[0], keys.argsort(stable=True))


def test_ids_out_of_range_count_as_minus_one():
    ids = torch.tensor([[2, 7, -3], [-1, 0, 9]])
    order, offsets, rows = moe_sort_by_expert(ids, 3)
    assert order.tolist() == [4, 0, 1, 2, 3, 5]
    assert offsets.tolist() == [1, 1, 2]
    assert rows.tolist() == [[1, -1, -1], [-1, 0, -1]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_the_gather_gives_the_rows_in_sorted_order(dtype):
    ids = random_ids(30, 6, 16, seed=6)
    x = (torch.randn(30, 100) * 50).to(dtype)
    outputs = moe_sort_by_expert_and_gather(ids, 16, x)
    check(outputs, ids, 16, x)
    wide = torch.randn(30, 300).to(dtype)
    check(moe_sort_by_expert_and_gather(ids, 16, wide[:, 50:150]), ids, 16, wide[:, 50:150])
    empty = torch.empty(0, 6, dtype=torch.int64)
    assert moe_sort_by_expert_and_gather(empty, 16, x[:0])[3].shape == (0, 100)


@pytest.mark.parametrize(
    "ids, num_experts", [(random_ids(9, 8, 64), 64), (out_of_range(5, 6, 4), 4)]
)
def test_opcheck_on_cpu(ids, num_experts):
    torch.library.opcheck(moe_sort_by_expert, (ids, num_experts))
    x = torch.randn(ids.shape[0], 24, dtype=torch.bfloat16)
    torch.library.opcheck(moe_sort_by_expert_and_gather, (ids, num_experts, x))


def test_the_fake_implementations_give_the_outputs():
    ids = torch.empty(5, 8, dtype=torch.int64, device="meta")
    order, offsets, rows = moe_sort_by_expert(ids, 64)
    assert order.device.type == offsets.device.type == rows.device.type == "meta"
    assert (order.shape, order.dtype) == ((40,), torch.int64)
    assert (offsets.shape, offsets.dtype) == ((64,), torch.int32)
    assert (rows.shape, rows.dtype) == ((5, 8), torch.int64)
    x = torch.empty(5, 96, dtype=torch.bfloat16, device="meta")
    gathered = moe_sort_by_expert_and_gather(ids, 64, x)[3]
    assert (gathered.shape, gathered.dtype) == ((40, 96), torch.bfloat16)


def test_torch_compile_traces_the_operators_whole():
    def bookkeeping(ids, x):
        order, offsets, rows = moe_sort_by_expert(ids, 16)
        return order, offsets, rows, moe_sort_by_expert_and_gather(ids, 16, x)[3]

    ids, x = random_ids(12, 6, 16, seed=7), torch.randn(12, 32)
    compiled = torch.compile(bookkeeping, fullgraph=True, backend="aot_eager")
    got = compiled(ids, x)
    check(got, ids, 16, x)


def bad_inputs():
    ids = random_ids(3, 8, 16)
    x = torch.randn(3, 32)
    return [
        ((ids.flatten(), 16, None), r"ids must be \[n, k\], got \(24,\)"),
        ((ids.view(3, 2, 4), 16, None), r"ids must be \[n, k\], got \(3, 2, 4\)"),
        ((ids.int(), 16, None), "ids must be int64, got torch.int32"),
        ((ids.float(), 16, None), "ids must be int64, got torch.float32"),
        ((ids, 0, None), "num_experts must be a positive int, got 0"),
        ((ids, 16, x[:2]), r"x must be \[n, hidden\] with n = 3 .* got \(2, 32\)"),
        ((ids, 16, x.flatten()), r"x must be \[n, hidden\] with n = 3 .* got \(96,\)"),
        ((ids, 16, x.to("meta")), "x and ids must be on one device"),
    ]


@pytest.mark.parametrize("args, message", bad_inputs())
def test_bad_arguments_are_a_value_error_naming_the_problem(args, message):
    ids, num_experts, x = args
    with pytest.raises(ValueError, match=message):
        if x is None:
            moe_sort_by_expert(ids, num_experts)
        else:
            moe_sort_by_expert_and_gather(ids, num_experts, x)
    with pytest.raises(ValueError, match=message):
        triton_moe_sort_by_expert(ids, num_experts, x)


@pytest.mark.parametrize("num_experts", [True, 4.0])
def test_the_kernels_take_num_experts_as_an_int_only(num_experts):
    """(The operators' int argument takes a bool as 1 and refuses a float itself.)"""
    with pytest.raises(ValueError, match=f"num_experts must be a positive int, got {num_experts}"):
        triton_moe_sort_by_expert(random_ids(2, 2, 4), num_experts)


def test_the_kernels_refuse_what_they_do_not_take():
    """Before any launch (so without triton): more than MAX_EXPERTS experts, chunks that are
    no power of two or out of [BLOCK, CHUNK]."""
    ids = random_ids(3, 8, 16)
    with pytest.raises(ValueError, match=f"at most {MAX_EXPERTS} experts, got 1024"):
        triton_moe_sort_by_expert(ids, MAX_EXPERTS + 1)
    for chunk in (8, 48, 4096):
        with pytest.raises(ValueError, match=f"chunk must be a power of two .* got {chunk}"):
            triton_moe_sort_by_expert(ids, 16, chunk=chunk)


def test_the_reference_takes_any_number_of_experts():
    """As the CUDA implementation does past MAX_EXPERTS (through the reference)."""
    ids = random_ids(20, 8, 2000, seed=8)
    check(moe_sort_by_expert(ids, 2000), ids, 2000)


# ---- the Triton kernels on the CPU, through Triton's interpreter ----


def test_the_kernels_in_triton_s_interpreter(in_triton_interpreter):
    """`interpreted_checks`, in Triton's interpreter."""
    in_triton_interpreter(__file__)


def interpreted_checks():
    """Every case in one chunk; several chunks (16, 64 and 128 slots, the slot count a multiple
    of the chunk or not) with all -1, one expert, 256 experts and ids out of range; the gather
    in each, with widths one copy does not cover and rows a stride apart."""
    for _, ids, num_experts in cases():
        check(triton_moe_sort_by_expert(ids, num_experts), ids, num_experts)
    several = [
        (random_ids(40, 8, 64, seed=10), 64, 64),
        (random_ids(33, 6, 64, seed=11), 64, 128),
        (random_ids(16, 8, 256, seed=12), 256, 16),
        (torch.full((10, 8), -1), 16, 16),
        (torch.full((9, 7), 3), 4, 16),
        (out_of_range(21, 8, 12, seed=13), 12, 32),
    ]
    for ids, num_experts, chunk in several:
        check(triton_moe_sort_by_expert(ids, num_experts, chunk=chunk), ids, num_experts)
    g = torch.Generator().manual_seed(14)
    for ids, num_experts, chunk, x in [
        (random_ids(12, 6, 64, seed=15), 64, 2048, torch.randn(12, 700, generator=g)),
        (random_ids(12, 6, 64, seed=15), 64, 16, torch.randn(12, 1, generator=g)),
        (random_ids(30, 4, 8, seed=16), 8, 32, torch.randn(30, 600, generator=g).bfloat16()),
        (torch.full((5, 8), -1), 8, 2048, torch.randn(5, 40, generator=g).half()),
    ]:
        got = triton_moe_sort_by_expert(ids, num_experts, x, chunk=chunk)
        check(got, ids, num_experts, x)
    wide = torch.randn(12, 900, generator=g).bfloat16()
    ids = random_ids(12, 8, 32, seed=17)
    check(triton_moe_sort_by_expert(ids, 32, wide[:, 100:612]), ids, 32, wide[:, 100:612])
    empty = torch.empty(0, 8, dtype=torch.int64)
    check(triton_moe_sort_by_expert(empty, 8, wide[:0]), empty, 8, wide[:0])


# ---- GPU ----


def poison_cuda_memory(mib: int = 256) -> None:
    """Fill blocks of the caching allocator's large and small pools with all ones (-1 as
    int64 and int32, NaN as floats) and give them back, so that outputs allocated next start
    out poisoned: an entry the kernels leave unwritten shows as a mismatch."""
    large = torch.full((mib << 17,), -1, dtype=torch.int64, device="cuda")
    small = [torch.full((1 << 15,), -1, dtype=torch.int64, device="cuda") for _ in range(16)]
    del large, small


# (tokens, k, experts, fraction of -1): decode sizes (one chunk), just past one chunk, prefill
GPU_SIZES = [
    (1, 6, 64, 0.0),
    (1, 8, 256, 0.5),
    (7, 6, 64, 0.3),
    (64, 8, 32, 0.3),
    (256, 6, 64, 0.0),
    (256, 8, 256, 0.3),
    (257, 8, 256, 0.3),
    (1000, 6, 64, 0.3),
    (4096, 8, 32, 0.7),
    (16384, 8, 256, 0.3),
    (16384, 8, 256, 0.0),
]


@gpu
@pytest.mark.parametrize("n, k, num_experts, invalid", GPU_SIZES)
def test_the_kernels_match_the_reference(n, k, num_experts, invalid):
    ids = random_ids(n, k, num_experts, invalid, seed=n + k, device="cuda")
    poison_cuda_memory()
    got = moe_sort_by_expert(ids, num_experts)
    check(got, ids, num_experts)
    for a, b in zip(got, moe_sort_by_expert(ids, num_experts), strict=True):
        assert torch.equal(a, b)  # deterministic


@gpu
@pytest.mark.parametrize("n", [2, 300, 20000])
def test_the_kernels_on_uniform_and_wild_ids(n):
    """All -1, all one expert, ids out of range, at one chunk and several."""
    for ids, num_experts in [
        (torch.full((n, 8), -1, device="cuda"), 64),
        (torch.full((n, 8), 63, device="cuda"), 64),
        (torch.zeros(n, 6, dtype=torch.int64, device="cuda"), 1),
        (out_of_range(n, 8, 48, seed=n).cuda(), 48),
    ]:
        poison_cuda_memory()
        check(moe_sort_by_expert(ids, num_experts), ids, num_experts)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "n, k, num_experts, hidden",
    [(1, 6, 64, 2048), (256, 8, 256, 7168), (3000, 8, 32, 2048), (5, 8, 8, 100)],
)
def test_the_gather_matches_torch(n, k, num_experts, hidden, dtype):
    ids = random_ids(n, k, num_experts, seed=n, device="cuda")
    x = torch.randn(n, hidden, device="cuda").to(dtype)
    poison_cuda_memory()
    check(moe_sort_by_expert_and_gather(ids, num_experts, x), ids, num_experts, x)
    wide = torch.randn(n, hidden + 64, device="cuda").to(dtype)[:, 32 : 32 + hidden]
    check(moe_sort_by_expert_and_gather(ids, num_experts, wide), ids, num_experts, wide)


@gpu
def test_many_experts_fall_back_to_the_reference():
    ids = random_ids(100, 8, MAX_EXPERTS + 1, device="cuda")
    check(moe_sort_by_expert(ids, MAX_EXPERTS + 1), ids, MAX_EXPERTS + 1)


@gpu
@pytest.mark.parametrize("n", [256, 16384])
def test_the_kernels_do_not_wait_for_the_device(n):
    ids = random_ids(n, 8, 256, device="cuda")
    x = torch.randn(n, 512, dtype=torch.bfloat16, device="cuda")
    moe_sort_by_expert(ids, 256)  # compiles first
    moe_sort_by_expert_and_gather(ids, 256, x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_sort_by_expert(ids, 256)
        moe_sort_by_expert_and_gather(ids, 256, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
@pytest.mark.parametrize("n, k, num_experts", [(1, 6, 64), (128, 8, 256), (5000, 8, 64)])
def test_the_kernels_replay_in_a_cuda_graph(n, k, num_experts):
    """Captured once, replayed on new ids (and rows of x) in the same tensors."""
    ids = random_ids(n, k, num_experts, device="cuda")
    x = torch.randn(n, 1024, dtype=torch.bfloat16, device="cuda")
    moe_sort_by_expert(ids, num_experts)  # compiles outside the capture
    moe_sort_by_expert_and_gather(ids, num_experts, x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sorted_only = moe_sort_by_expert(ids, num_experts)
        gathered = moe_sort_by_expert_and_gather(ids, num_experts, x)
    for seed in (1, 2, 3):
        ids.copy_(random_ids(n, k, num_experts, invalid=0.2 * seed, seed=seed))
        x.copy_(torch.randn(n, 1024, dtype=torch.bfloat16))
        graph.replay()
        check(sorted_only, ids, num_experts)
        check(gathered, ids, num_experts, x)


@gpu
def test_batch_sizes_do_not_compile_the_kernels_again():
    """After a warm-up at each power of two of slots in one chunk, and at several chunks,
    other decode batch sizes (one chunk) and prefill sizes (several) reuse the compiled
    kernels."""
    device = torch.cuda.current_device()

    def compiled():
        kernels = expert_sort._triton_kernels()[1:]
        return sum(len(kernel.device_caches[device][0]) for kernel in kernels)

    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 5000):  # one chunk of 8 to 2048 slots, several
        moe_sort_by_expert(random_ids(n, 8, 64, device="cuda"), 64)
    before = compiled()
    for n in (3, 17, 100, 255, 2049, 3001, 16384):
        moe_sort_by_expert(random_ids(n, 8, 64, seed=n, device="cuda"), 64)
    assert compiled() == before


@gpu
def test_opcheck_on_cuda():
    for n in (9, 3000):
        ids = random_ids(n, 8, 64, device="cuda")
        torch.library.opcheck(moe_sort_by_expert, (ids, 64))
        x = torch.randn(n, 256, dtype=torch.bfloat16, device="cuda")
        torch.library.opcheck(moe_sort_by_expert_and_gather, (ids, 64, x))


@gpu
def test_torch_compile_calls_the_kernels():
    ids = random_ids(64, 8, 64, device="cuda")
    x = torch.randn(64, 2048, dtype=torch.bfloat16, device="cuda")
    compiled = torch.compile(
        lambda ids, x: moe_sort_by_expert_and_gather(ids, 64, x), fullgraph=True
    )
    check(compiled(ids, x), ids, 64, x)


if __name__ == "__main__":
    interpreted_checks()
