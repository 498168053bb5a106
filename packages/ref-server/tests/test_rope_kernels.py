"""The rotary embedding operators (`ref_server::rope`, `ref_server::rope_into`): on the CPU,
bit for bit the torch formula `layers.rotate` ran before them, on the strided views that
`Attention._project` rotates, with opcheck, fake shapes, torch.compile and argument checks;
their Triton kernel on the CPU through Triton's interpreter (where triton is installed); on
the GPU (`gpu` marker), the kernel against the torch formula bit for bit, in CUDA graphs."""

from __future__ import annotations

import pytest
import torch

import ref_server.model as M
from ref_server.kernels.rope import MAX_ROPE, rope, rope_into, triton_rope
from ref_server.model.layers import Rope, rotate

gpu = pytest.mark.gpu
# DeepSeek's MLA widths: q's heads are 128 nope + 64 rope dims, kv_a's output a 512 latent and
# the 64-dim rope key; the decode query is 512 absorbed + 64 rope dims per head.
NOPE, ROPE, LATENT = 128, 64, 512
HEADS = [16, 128]  # V2-Lite, V3
TOKENS = [0, 1, 7, 300]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def torch_formula(x, cos, sin, interleave):
    """`layers.rotate` before the operators."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def interpreted_formula(x, cos, sin, interleave):
    """The torch formula as Triton's interpreter computes the kernel: exactly the formula but
    for bf16, which the interpreter rounds from fp32 by truncation (the GPU to nearest)."""
    if x.dtype != torch.bfloat16:
        return torch_formula(x, cos, sin, interleave)

    def truncated(v):  # fp32 to bf16, dropping the low 16 bits
        return (v.view(torch.int32) & -(1 << 16)).view(torch.float32).to(torch.bfloat16)

    def product(a, b):
        return truncated(a.float() * b.float()).float()

    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    first = truncated(product(x1, cos) - product(x2, sin))
    second = truncated(product(x2, cos) + product(x1, sin))
    return torch.cat([first, second], dim=-1)


def rotation(tokens, dtype, device="cpu", seed=0, positions=None):
    """`Rope`'s (cos, sin) `[tokens, 1, 32]` for V2-Lite (YaRN) at random positions."""
    if positions is None:
        g = torch.Generator().manual_seed(seed)
        positions = torch.randint(0, 163840, (tokens,), generator=g)
    return Rope(M.PRESETS["v2-lite"])(positions.to(device), dtype)


def problem(tokens, heads, dtype, lead=(), device="cpu", seed=0):
    """(q_rope, k_rope, cos, sin) as `Attention._project` rotates them: q_rope
    `[*lead, tokens, heads, 64]` a view of q `[*lead, tokens, heads, 192]`, k_rope
    `[*lead, tokens, 1, 64]` a view of kv_a's output `[*lead, tokens, 576]` unsqueezed, cos
    and sin `[tokens, 1, 32]`; values N(0, 1) times a power of two per token."""
    g = torch.Generator().manual_seed(seed)

    def activations(width):
        scales = torch.exp2(torch.randint(-6, 7, (*lead, tokens, 1), generator=g))
        return (torch.randn(*lead, tokens, width, generator=g) * scales).to(device, dtype)

    q = activations(heads * (NOPE + ROPE)).unflatten(-1, (heads, NOPE + ROPE))
    q_rope = q.split([NOPE, ROPE], dim=-1)[1]
    k_rope = activations(LATENT + ROPE).split([LATENT, ROPE], dim=-1)[1].unsqueeze(-2)
    return q_rope, k_rope, *rotation(tokens, dtype, device, seed)


def strided_batches(heads, dtype, device="cpu"):
    """Two q_rope `[..., 5, heads, 64]` for cos and sin of 5 tokens: `[3, 5, heads, 64]` whose
    tokens are its outer dim in memory, and `[2, 3, 5, heads, 64]` whose leading dims do not
    merge into one."""
    transposed = problem(3, heads, dtype, lead=(5,), device=device, seed=2)[0].transpose(0, 1)
    unmerged = problem(5, heads, dtype, lead=(3, 2), device=device, seed=3)[0].transpose(0, 1)
    return transposed, unmerged


def query_buffer(q_rope, fill=7.0):
    """The decode query `[..., heads, 512 + rope]` filled with `fill`, and its rope columns."""
    buffer = q_rope.new_full((*q_rope.shape[:-1], LATENT + q_rope.shape[-1]), fill)
    return buffer, buffer[..., LATENT:]


def check_written(buffer, want, fill=7.0):
    """buffer's rope columns are exactly want, its latent columns still `fill`."""
    assert torch.equal(buffer[..., LATENT:], want)
    assert (buffer[..., :LATENT] == fill).all()


def check_in_place(x, cos, sin, interleave, want, into=rope_into):
    """into (rope_into's arguments) with out x itself (a view of q or of kv_a's output, as
    `problem` makes them): x becomes want, and the other columns of its rows stay as they
    were."""
    whole = x._base
    before = whole.clone()
    into(x, cos, sin, interleave, x)
    assert torch.equal(x, want)
    offset = x.storage_offset() - whole.storage_offset()
    untouched = torch.ones_like(whole, dtype=torch.bool)
    untouched.as_strided(x.shape, x.stride(), offset).fill_(False)
    assert torch.equal(whole[untouched], before[untouched])


# ---- CPU ----


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("heads", HEADS)
def test_the_operator_on_the_cpu_is_the_torch_formula_bit_for_bit(heads, tokens, interleave, dtype):
    q_rope, k_rope, cos, sin = problem(tokens, heads, dtype, seed=tokens)
    for x in (q_rope, k_rope):
        want = torch_formula(x, cos, sin, interleave)
        got = rope(x, cos, sin, interleave)
        assert got.is_contiguous() and got.dtype == dtype and torch.equal(got, want)
        assert torch.equal(rotate(x, (cos, sin), interleave), want)
        buffer, rope_columns = query_buffer(x)
        rope_into(x, cos, sin, interleave, rope_columns)
        check_written(buffer, want)
        check_in_place(x, cos, sin, interleave, want)


@pytest.mark.parametrize("interleave", [True, False])
def test_leading_batch_dims_bit_for_bit(interleave):
    """`Transformer.forward`'s layout, `[b, t, heads, 64]` with cos and sin `[t, 1, 32]`; a
    transposed batch (tokens its outer dim in memory); two leading dims that do not merge;
    each also written into a batched query buffer."""
    q_rope, k_rope, _, _ = problem(5, 16, torch.bfloat16, lead=(3,), seed=1)
    cos, sin = rotation(5, torch.bfloat16, positions=torch.arange(5))
    for x in (q_rope, k_rope, *strided_batches(16, torch.bfloat16)):
        want = torch_formula(x, cos, sin, interleave)
        got = rope(x, cos, sin, interleave)
        assert got.is_contiguous() and torch.equal(got, want)
        buffer, rope_columns = query_buffer(x)
        rope_into(x, cos, sin, interleave, rope_columns)
        check_written(buffer, want)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_on_cpu(dtype, interleave):
    q_rope, k_rope, cos, sin = problem(7, 16, dtype)
    for x in (q_rope, k_rope):
        torch.library.opcheck(rope, (x, cos, sin, interleave))
        torch.library.opcheck(rope_into, (x, cos, sin, interleave, query_buffer(x)[1]))


def test_the_fake_implementations_give_the_output():
    q_rope, k_rope, cos, sin = problem(7, 128, torch.bfloat16, device="meta")
    out = rope(q_rope, cos, sin, True)
    assert out.device.type == "meta" and out.shape == (7, 128, 64) and out.is_contiguous()
    assert out.dtype == torch.bfloat16
    assert rope_into(k_rope, cos, sin, False, query_buffer(k_rope)[1]) is None


def test_torch_compile_traces_the_operators_whole():
    q_rope, k_rope, cos, sin = problem(7, 16, torch.bfloat16)

    def rotated(q_rope, k_rope, cos, sin):
        buffer, rope_columns = query_buffer(q_rope)
        rope_into(q_rope, cos, sin, True, rope_columns)
        return buffer, rope(k_rope, cos, sin, True)

    buffer, k_rotated = torch.compile(rotated, fullgraph=True, backend="aot_eager")(
        q_rope, k_rope, cos, sin
    )
    check_written(buffer, torch_formula(q_rope, cos, sin, True))
    assert torch.equal(k_rotated, torch_formula(k_rope, cos, sin, True))


def test_gradients_are_not_supported_but_the_forward_runs():
    q_rope, _, cos, sin = problem(3, 16, torch.float32)
    x = q_rope.detach().requires_grad_()
    out = rope(x, cos, sin, True)
    assert torch.equal(out.detach(), torch_formula(q_rope, cos, sin, True))
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()


def bad_inputs():
    """(args of `rope`, the error's pattern): x `[7, 16, 64]` bf16, cos and sin `[7, 1, 32]`."""
    x, _, cos, sin = problem(7, 16, torch.bfloat16)
    odd = x[..., :63]
    return [
        ((x[0, 0], cos, sin), r"x must be \[\.\.\., n, heads, rope\], got shape \(64,\)"),
        ((x.int(), cos, sin), "x must be a floating-point tensor, got torch.int32"),
        ((odd, cos[..., :31], sin[..., :31]), "x's rope dim must be even .* got 63"),
        ((x, cos[:, 0], sin), r"cos must be \[n, 1, rope / 2\] = \[7, 1, 32\] .* got \(7, 32\)"),
        ((x, cos, sin[:1]), r"sin must be \[n, 1, rope / 2\] .* got \(1, 1, 32\)"),
        ((x, cos.float(), sin), r"cos must be in x's dtype \(torch.bfloat16\), got torch.float32"),
        ((x, cos, sin.to("meta")), "x and sin must be on one device"),
    ]


@pytest.mark.parametrize(("args", "message"), bad_inputs())
def test_bad_inputs_raise_value_errors(args, message):
    """From the operators and from the kernel's entry (which checks before it launches)."""
    x = args[0]
    for call in (
        lambda: rope(*args, True),
        lambda: rope_into(*args, True, torch.empty_like(x)),
        lambda: triton_rope(*args, True),
    ):
        with pytest.raises(ValueError, match=message):
            call()


def bad_destinations():
    """(x, out, the error's pattern) for `rope_into`."""
    x, _, _, _ = problem(7, 16, torch.bfloat16)
    batched = problem(5, 16, torch.bfloat16, lead=(2, 3))[0]
    q = torch.zeros(7, 16, NOPE + ROPE, dtype=x.dtype)
    return [
        (x, torch.empty(7, 16, 32, dtype=x.dtype), r"out must have x's shape \(7, 16, 64\)"),
        (x, torch.empty(7, 16, 64), r"out must be in x's dtype \(torch.bfloat16\)"),
        (x, torch.empty_like(x, device="meta"), "x and out must be on one device"),
        (x, torch.empty(7, 16, 128, dtype=x.dtype)[..., ::2], "out's last dim must be contig"),
        (
            batched,
            torch.empty(3, 2, 5, 16, 64, dtype=x.dtype).transpose(0, 1),
            r"out's dims before \[n, heads, rope\] must merge into one",
        ),
        # x itself is rotated in place; a view shifted by a few columns is not
        (q[..., NOPE:], q[..., NOPE - 8 : NOPE + ROPE - 8], "out must not overlap x in memory"),
        # apart value by value, but not in the memory the two span
        (q[..., NOPE:], q[..., :ROPE], "out must not overlap x in memory"),
    ]


@pytest.mark.parametrize(("x", "out", "message"), bad_destinations())
def test_bad_destinations_raise_value_errors(x, out, message):
    cos, sin = rotation(x.shape[-3], x.dtype)
    for call in (rope_into, lambda *args: triton_rope(*args[:4], out=args[4])):
        with pytest.raises(ValueError, match=message):
            call(x, cos, sin, True, out)


def test_the_kernel_s_entry_refuses_what_it_does_not_take():
    """float64, and rope wider than MAX_ROPE (on CUDA, the operators take those through the
    torch formula)."""
    x, _, cos, sin = problem(2, 4, torch.float64)
    with pytest.raises(ValueError, match=r"the kernel takes x in .*, got torch.float64"):
        triton_rope(x, cos, sin, True)
    wide = torch.zeros(2, 4, MAX_ROPE + 2)
    half = torch.zeros(2, 1, MAX_ROPE // 2 + 1)
    with pytest.raises(ValueError, match=f"rope dim of at most {MAX_ROPE}, got {MAX_ROPE + 2}"):
        triton_rope(wide, half, half, True)


# ---- the Triton kernel on the CPU, through Triton's interpreter ----


def test_the_kernel_in_triton_s_interpreter(in_triton_interpreter):
    """`interpreted_checks`, in Triton's interpreter."""
    in_triton_interpreter(__file__)


def check_interpreted(x, cos, sin, interleave, into=True):
    """The kernel on x, new (and into a query buffer) is `interpreted_formula` bit for bit."""
    want = interpreted_formula(x, cos, sin, interleave)
    got = triton_rope(x, cos, sin, interleave)
    assert got.is_contiguous() and got.shape == x.shape and torch.equal(got, want)
    if into:
        buffer, rope_columns = query_buffer(x)
        assert triton_rope(x, cos, sin, interleave, rope_columns) is rope_columns
        check_written(buffer, want)
        if x._base is not None and x.dim() <= 4 and x.stride(-1) == 1:  # out as rope_into takes
            into = lambda *args: triton_rope(*args[:4], out=args[4])  # noqa: E731
            check_in_place(x, cos, sin, interleave, want, into)


def interpreted_checks():
    """q and k, new and into a query buffer, in both layouts: of both models on 0 and 1
    tokens in every dtype, on 7 tokens V2-Lite's in every dtype and V3's in bf16; V2-Lite's q
    on 300 tokens in bf16 (new only: the interpreter runs a program in milliseconds); leading
    batch dims (merging and not), heads and pairs that fill no power of two, a last dim that
    is not contiguous."""
    cases = [(heads, tokens, dtype) for heads in HEADS for tokens in (0, 1) for dtype in DTYPES]
    cases += [(16, 7, dtype) for dtype in DTYPES] + [(128, 7, torch.bfloat16)]
    for heads, tokens, dtype in cases:
        q_rope, k_rope, cos, sin = problem(tokens, heads, dtype, seed=tokens)
        for interleave in (True, False):
            check_interpreted(q_rope, cos, sin, interleave)
            check_interpreted(k_rope, cos, sin, interleave)
    q_rope, _, cos, sin = problem(300, 16, torch.bfloat16, seed=300)
    check_interpreted(q_rope, cos, sin, True, into=False)
    q_rope, k_rope, _, _ = problem(5, 16, torch.bfloat16, lead=(2,), seed=1)
    cos, sin = rotation(5, torch.bfloat16, positions=torch.arange(5))
    for interleave in (True, False):
        for x in (q_rope, k_rope, *strided_batches(16, torch.bfloat16)):
            check_interpreted(x, cos, sin, interleave)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 5, 48, generator=g, dtype=torch.float16)
    cos, sin = torch.randn(2, 6, 1, 24, generator=g, dtype=torch.float16)
    for interleave in (True, False):
        check_interpreted(x, cos, sin, interleave)
        wide = torch.randn(6, 5, 96, generator=g, dtype=torch.float16)
        check_interpreted(wide[..., ::2], cos, sin, interleave)


# ---- GPU ----


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("heads", HEADS)
def test_the_kernel_is_the_torch_formula_bit_for_bit(heads, tokens, interleave, dtype):
    """Against the formula on CUDA and on the CPU, new and into a NaN-filled query buffer."""
    q_rope, k_rope, cos, sin = problem(tokens, heads, dtype, device="cuda", seed=tokens + heads)
    for x in (q_rope, k_rope):
        want = torch_formula(x, cos, sin, interleave)
        got = rope(x, cos, sin, interleave)
        assert got.is_contiguous() and torch.equal(got, want)
        cpu = torch_formula(*(t.cpu() for t in (x, cos, sin)), interleave)
        assert torch.equal(got.cpu(), cpu)
        buffer, rope_columns = query_buffer(x, fill=float("nan"))
        rope_into(x, cos, sin, interleave, rope_columns)
        assert torch.equal(rope_columns, want) and buffer[..., :LATENT].isnan().all()
        check_in_place(x, cos, sin, interleave, want)


@gpu
def test_the_kernel_writes_every_value_of_a_new_output():
    """A new output in memory that held NaN just before: the caching allocator's block of a
    tensor of its size, freed."""
    q_rope, _, cos, sin = problem(300, 128, torch.bfloat16, device="cuda", seed=5)
    rope(q_rope, cos, sin, True)  # compiles first
    poison = torch.full(q_rope.shape, float("nan"), dtype=q_rope.dtype, device="cuda")
    address = poison.data_ptr()
    del poison
    got = rope(q_rope, cos, sin, True)
    assert got.data_ptr() == address
    assert torch.equal(got, torch_formula(q_rope, cos, sin, True))


@gpu
@pytest.mark.parametrize("interleave", [True, False])
def test_the_kernel_on_batched_empty_and_unsupported_inputs(interleave):
    """Leading batch dims (merging and not); no tokens; float64 and rope wider than MAX_ROPE
    through the torch formula."""
    q_rope, k_rope, _, _ = problem(5, 16, torch.bfloat16, lead=(3,), device="cuda")
    cos, sin = rotation(5, torch.bfloat16, "cuda", positions=torch.arange(5))
    for x in (q_rope, k_rope, *strided_batches(16, torch.bfloat16, "cuda")):
        assert torch.equal(rope(x, cos, sin, interleave), torch_formula(x, cos, sin, interleave))
    q_rope, _, cos, sin = problem(0, 16, torch.bfloat16, device="cuda")
    assert rope(q_rope, cos, sin, interleave).shape == (0, 16, 64)
    q_rope, _, cos, sin = problem(7, 16, torch.float64, device="cuda")
    want = torch_formula(q_rope, cos, sin, interleave)
    assert torch.equal(rope(q_rope, cos, sin, interleave), want)
    wide = torch.randn(7, 2, MAX_ROPE + 2, device="cuda")
    half = torch.randn(7, 1, MAX_ROPE // 2 + 1, device="cuda")
    want = torch_formula(wide, half, half, interleave)
    assert torch.equal(rope(wide, half, half, interleave), want)


@gpu
def test_the_kernel_does_not_wait_for_the_device():
    q_rope, k_rope, cos, sin = problem(7, 128, torch.bfloat16, device="cuda")
    _, rope_columns = query_buffer(q_rope)
    rope(k_rope, cos, sin, True)  # compiles first
    rope_into(q_rope, cos, sin, True, rope_columns)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rope(k_rope, cos, sin, True)
        rope_into(q_rope, cos, sin, True, rope_columns)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
@pytest.mark.parametrize("tokens", [1, 7])
def test_the_kernel_replays_in_a_cuda_graph(tokens):
    """q into the query buffer and k, captured once after a warm-up at another token count
    (which the kernel is not specialized on), replayed on new values in the same tensors."""
    q_rope, k_rope, cos, sin = problem(tokens, 16, torch.bfloat16, device="cuda")
    warm_up = problem(tokens + 2, 16, torch.bfloat16, device="cuda")
    rope(warm_up[1], *warm_up[2:], True)
    rope_into(warm_up[0], *warm_up[2:], True, query_buffer(warm_up[0])[1])
    torch.cuda.synchronize()
    buffer, rope_columns = query_buffer(q_rope)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rope_into(q_rope, cos, sin, True, rope_columns)
        k_rotated = rope(k_rope, cos, sin, True)
    for seed in (1, 2):
        fresh = problem(tokens, 16, torch.bfloat16, device="cuda", seed=seed)
        for static, value in zip((q_rope, k_rope, cos, sin), fresh, strict=True):
            static.copy_(value)
        graph.replay()
        check_written(buffer, torch_formula(q_rope, cos, sin, True))
        assert torch.equal(k_rotated, torch_formula(k_rope, cos, sin, True))


@gpu
def test_opcheck_on_cuda():
    q_rope, k_rope, cos, sin = problem(9, 16, torch.bfloat16, device="cuda")
    for x in (q_rope, k_rope):
        torch.library.opcheck(rope, (x, cos, sin, True))
        torch.library.opcheck(rope_into, (x, cos, sin, False, query_buffer(x)[1]))


@gpu
def test_torch_compile_calls_the_kernel():
    q_rope, k_rope, cos, sin = problem(7, 128, torch.bfloat16, device="cuda")

    def rotated(q_rope, k_rope, cos, sin):
        buffer, rope_columns = query_buffer(q_rope)
        rope_into(q_rope, cos, sin, True, rope_columns)
        return buffer, rope(k_rope, cos, sin, True)

    buffer, k_rotated = torch.compile(rotated, fullgraph=True)(q_rope, k_rope, cos, sin)
    check_written(buffer, torch_formula(q_rope, cos, sin, True))
    assert torch.equal(k_rotated, torch_formula(k_rope, cos, sin, True))


if __name__ == "__main__":
    interpreted_checks()
