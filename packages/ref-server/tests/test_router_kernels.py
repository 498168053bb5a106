"""The router's expert choice (`ref_server::moe_route`): on the CPU, the torch reference against
float64 and against `Gate.select`'s formula from before the operator, its slot order and tie
rules, NaN and infinities, with opcheck, fake shapes, torch.compile and argument checks; its
Triton kernel on the CPU through Triton's interpreter; on the GPU (`gpu` marker), the kernel
against float64 and the reference, in CUDA graphs.

Random logits leave some tokens with two choices (or group scores) within rounding of each
other, where implementations that round differently (the sigmoid's last ulp) may each be right:
such tokens are checked for valid ids and their weights only; every other token must have the
float64 choice, exactly. Inputs made of exact values (logits 0 and ±inf, dyadic biases) tie
on purpose: there every implementation must follow the tie and NaN rules to the id."""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass

import pytest
import torch

import ref_server.model as M
from ref_server.kernels.routing import MAX_EXPERTS, moe_route, triton_moe_route

gpu = pytest.mark.gpu
DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]
# Float64 margin below which a decision counts as a near tie: above every fp32 rounding of the
# scores (a few ulps of values below 2) and their two-expert sums.
TIE = 2e-6


@dataclass(frozen=True)
class Routing:
    experts: int
    n_group: int
    topk_group: int
    k: int
    norm_topk_prob: bool
    scaling: float

    @classmethod
    def of(cls, args: M.ModelArgs) -> Routing:
        return cls(
            args.n_routed_experts,
            args.n_group,
            args.topk_group,
            args.num_experts_per_tok,
            args.norm_topk_prob,
            args.routed_scaling_factor,
        )

    @property
    def arguments(self) -> tuple:
        """moe_route's arguments after logits and bias."""
        return astuple(self)[1:]


CONFIGS = {
    "v3": Routing.of(M.PRESETS["v3"]),  # 256 experts, 8 groups, 4 kept, k 8
    "v2-lite": Routing.of(M.PRESETS["v2-lite"]),  # 64 experts, one group, k 6, no norm
    "tiny": Routing.of(M.PRESETS["tiny"]),
    "v2": Routing(160, 8, 3, 6, False, 16.0),  # groups of 20: padded to 32 in the kernel
    "6-groups": Routing(48, 6, 2, 5, True, 0.75),  # 6 groups padded to 8
    "groups-of-2": Routing(24, 12, 5, 9, True, 1.0),  # a group's top two is all of it
    "all-groups-kept": Routing(96, 4, 4, 7, True, 1.5),  # nothing for the groups to rank
    "k-every-kept-expert": Routing(16, 4, 2, 8, True, 2.5),
}


def problem(n: int, experts: int, device="cpu", seed=0):
    """(logits `[n, experts]` N(0, 1) times 1/2, 1, 2 or 4 per token, bias `[experts]`
    N(0, 0.1)), fp32."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp2(torch.randint(-1, 3, (n, 1), generator=g).float())
    logits = torch.randn(n, experts, generator=g) * scales
    bias = 0.1 * torch.randn(experts, generator=g)
    return logits.to(device), bias.to(device)


def exact_problem(n: int, experts: int, seed=0):
    """(logits, bias) whose routing math is exact in fp32, so that ties are ties in any
    implementation: logits 0, ±inf (scores 1/2, 1, 0) or NaN; bias multiples of 1/8 in
    [-1, 1], ±inf or NaN."""
    g = torch.Generator().manual_seed(seed)
    logit_values = torch.tensor([0.0, 0.0, 0.0, float("inf"), float("-inf"), float("nan")])
    logits = logit_values[torch.randint(0, len(logit_values), (n, experts), generator=g)]
    bias = torch.randint(-8, 9, (experts,), generator=g) / 8
    special = torch.tensor([float("inf"), float("-inf"), float("nan")])
    odd = torch.rand(experts, generator=g) < 0.1
    bias[odd] = special[torch.randint(0, 3, (int(odd.sum()),), generator=g)]
    return logits, bias


def routed_weights(logits, r: Routing, ids) -> torch.Tensor:
    """The float64 weights of the given experts: sigmoid, normalized, scaled."""
    weights = logits.double().gather(1, ids).sigmoid()
    if r.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * r.scaling


def route_float64(logits, bias, r: Routing):
    """(ids `[n, k]`, decisive `[n]` bool): the routing math in float64 on finite inputs,
    without tie rules; decisive where no decision (the last kept group against the first
    dropped, each of the k + 1 best choices against the next) lies within TIE."""
    n = logits.shape[0]
    choice = logits.double().sigmoid() + bias.double()
    margins = []
    if r.topk_group < r.n_group:
        groups = choice.view(n, r.n_group, -1)
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        ranked = group_scores.sort(dim=-1, descending=True).values
        margins.append(ranked[:, r.topk_group - 1] - ranked[:, r.topk_group])
        kept = group_scores.topk(r.topk_group, dim=-1).indices
        keep = torch.zeros(n, r.n_group, dtype=torch.bool).scatter_(1, kept, True)
        choice = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
    ranked = choice.sort(dim=-1, descending=True)
    values = torch.cat([ranked.values, torch.full((n, 1), float("-inf"))], dim=1)[:, : r.k + 1]
    margins.append((values[:, :-1] - values[:, 1:]).amin(dim=1))
    decisive = torch.stack(margins, dim=1).amin(dim=1) > TIE
    return ranked.indices[:, : r.k], decisive


def route_by_rules(logits, bias, r: Routing) -> torch.Tensor:
    """ids `[n, k]` by the documented rules, token by token in Python: choices (fp32 scores
    plus bias; NaN below -inf) and groups (sums of the best two) ranked by value, then lower
    id. Exact for `exact_problem`'s inputs."""
    scores = logits.sigmoid().tolist()
    bias = bias.float().tolist()
    group_size = r.experts // r.n_group
    out = []
    for token in scores:
        choice = [s + b for s, b in zip(token, bias, strict=True)]
        choice = [-math.inf if math.isnan(c) else c for c in choice]
        groups = list(range(r.n_group))
        if r.topk_group < r.n_group:
            score = []
            for g in groups:
                best = sorted(choice[g * group_size : (g + 1) * group_size], reverse=True)
                total = best[0] + best[1]
                score.append(-math.inf if math.isnan(total) else total)
            groups = sorted(groups, key=lambda g: (-score[g], g))[: r.topk_group]
        eligible = [e for e in range(r.experts) if e // group_size in groups]
        out.append(sorted(eligible, key=lambda e: (-choice[e], e))[: r.k])
    return torch.tensor(out, dtype=torch.int64).view(len(scores), r.k)


def check_ids(ids, r: Routing) -> None:
    """ids `[n, k]` int64: in [0, E), distinct in each row."""
    assert ids.dtype == torch.int64 and ids.shape[1] == r.k and ids.is_contiguous()
    assert ((ids >= 0) & (ids < r.experts)).all()
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()


def check(route, logits, bias, r: Routing, reference=None) -> None:
    """route(logits, bias, ...) against float64: valid ids, weights of those ids within 1e-6
    (relative), the float64 ids exactly on decisive tokens (at least 95 % of them where there
    are 100 or more), and those of `reference` (weights, ids), if given, there too."""
    weights, ids = route(logits, bias, *r.arguments)
    assert weights.dtype == torch.float32 and weights.shape == (logits.shape[0], r.k)
    assert weights.is_contiguous() and weights.device == logits.device
    logits, bias, weights, ids = logits.cpu(), bias.cpu(), weights.cpu(), ids.cpu()
    check_ids(ids, r)
    want = routed_weights(logits, r, ids)
    torch.testing.assert_close(weights.double(), want, rtol=1e-6, atol=0)
    want_ids, decisive = route_float64(logits, bias, r)
    if len(decisive) >= 100:
        assert decisive.float().mean() >= 0.95
    assert torch.equal(ids[decisive], want_ids[decisive])
    if reference is not None:
        torch.testing.assert_close(weights, reference[0], rtol=1e-6, atol=0)
        assert torch.equal(ids[decisive], reference[1][decisive])


def check_exact(route, logits, bias, r: Routing) -> None:
    """route(...) on `exact_problem` inputs: the ids of the rules exactly; weights those of
    the ids (NaN where a NaN logit was taken, or, normalized, any)."""
    weights, ids = route(logits, bias, *r.arguments)
    weights, ids, logits, bias = (t.cpu() for t in (weights, ids, logits, bias))
    check_ids(ids, r)
    assert torch.equal(ids, route_by_rules(logits, bias, r))
    want = routed_weights(logits, r, ids)
    torch.testing.assert_close(weights.double(), want, rtol=1e-6, atol=0, equal_nan=True)


def assert_same_choice(got, old, decisive) -> None:
    """(weights, ids) `[n, k]` choosing old's experts with old's weights (rtol 1e-6) on the
    decisive tokens; the slots may come in another order."""
    (weights, ids), (old_weights, old_ids) = got, old
    order, old_order = ids.argsort(dim=1), old_ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, order)[decisive], old_ids.gather(1, old_order)[decisive])
    torch.testing.assert_close(
        weights.gather(1, order)[decisive],
        old_weights.gather(1, old_order)[decisive],
        rtol=1e-6,
        atol=0,
    )


def gate_select_formula(scores, bias, r: Routing):
    """`Gate.select` before the operator (sigmoid scores in)."""
    choice = scores + bias.float()
    groups = choice.view(-1, r.n_group, r.experts // r.n_group)
    group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(r.topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    choice = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
    ids = choice.topk(r.k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if r.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * r.scaling, ids


# ---- tie, NaN and edge cases, for any route and device ----


def expect_equal_choices_to_go_to_the_lower_id(route, device) -> None:
    """Every logit 0, no bias: ids 0..k-1 in order (the lowest groups' lowest experts)."""
    for name in ("v3", "v2-lite", "groups-of-2", "6-groups"):
        r = CONFIGS[name]
        logits = torch.zeros(3, r.experts, device=device)
        weights, ids = route(logits, torch.zeros(r.experts, device=device), *r.arguments)
        assert torch.equal(ids.cpu(), torch.arange(r.k).expand(3, r.k))
        want = routed_weights(logits.cpu(), r, ids.cpu())
        torch.testing.assert_close(weights.cpu().double(), want, rtol=1e-6, atol=0)


def expect_group_ties_to_go_to_the_lower_group(route, device) -> None:
    """16 experts in 4 groups, 2 kept, k 3; logits 0 (scores 1/2) and the bias setting the
    choices, so that every sum is exact. Token 0: groups 1, 2, 3 tie at 1.25 (group 3 holding
    the best expert, group 2 its two best tied: a top-two sum counts both), group 0 below:
    groups 1 and 2 are kept. Token 1: every group ties, its choices a permutation of the same
    four: groups 0 and 1, each choice's tie going to the lower id."""
    r = Routing(16, 4, 2, 3, False, 1.0)
    first = [0.25, 0.25, 0.25, 0.25, 0.75, 0.5, 0.125, 0, 0.625, 0.625, 0.25, 0, 1.0, 0.25, 0, 0]
    second = [0, 0.25, 0.5, 0.75, 0.75, 0.5, 0.25, 0, 0.5, 0.75, 0, 0.25, 0.25, 0, 0.75, 0.5]
    logits = torch.zeros(1, 16, device=device)
    for choices, want in ((first, [4, 8, 9]), (second, [3, 4, 2])):
        bias = torch.tensor(choices, device=device) - 0.5
        weights, ids = route(logits, bias, *r.arguments)
        assert ids.cpu().tolist() == [want]
        assert weights.cpu().tolist() == [[0.5] * 3]


def expect_nan_to_rank_last(route, device) -> None:
    """16 experts in 4 groups, 1 kept, k 3, no norm. Token 0: group 1 holds the best two
    experts and two NaN logits, as good as -inf: the third slot takes the lower of those
    (not a dropped group's finite expert); token 1: all NaN, ids 0..2, weights NaN. Then 2
    kept, with norm: a NaN bias leaves its expert (5, the second best by logit) out; a group
    whose top two sum to NaN (inf - inf) is dropped, its expert of choice inf too. Every
    group's sum NaN: groups 0 and 1 (as tied), their experts of choice inf, then the lowest
    id. Logits all -inf: scores 0, weights 0 (the 1e-20 keeps 0 / 0 away), ids by the bias."""
    r = Routing(16, 4, 1, 3, False, 1.0)
    nan = float("nan")
    logits = torch.tensor(
        [[0, 0, 0, 0, 3, 2, nan, nan, 0, 0, 0, 0, 0, 0, 0, 0], [nan] * 16], device=device
    )
    weights, ids = route(logits, torch.zeros(16, device=device), *r.arguments)
    assert ids.cpu().tolist() == [[4, 5, 6], [0, 1, 2]]
    want = torch.tensor([[3.0, 2.0, nan], [nan] * 3]).sigmoid()
    torch.testing.assert_close(weights.cpu(), want, rtol=1e-6, atol=0, equal_nan=True)
    r = Routing(16, 4, 2, 3, True, 1.0)
    bias = torch.zeros(16, device=device)
    bias[5] = nan
    bias[8:12] = torch.tensor([float("inf")] + [float("-inf")] * 3)  # group 2: inf - inf
    logits = torch.zeros(2, 16, device=device)
    logits[:, 4:6] = 5.0
    logits[1, 8] = 9.0
    weights, ids = route(logits, bias, *r.arguments)
    assert ids.cpu().tolist() == [[4, 0, 1], [4, 0, 1]]
    assert torch.isfinite(weights).all()
    bias = torch.tensor([float("inf")] + [float("-inf")] * 3, device=device).repeat(4)
    weights, ids = route(logits, bias, *r.arguments)
    assert ids.cpu().tolist() == [[0, 4, 1], [0, 4, 1]]
    logits = torch.full((1, 16), float("-inf"), device=device)
    bias = torch.arange(16.0, device=device) / 16
    weights, ids = route(logits, bias, *r.arguments)
    assert ids.cpu().tolist() == [[15, 14, 13]] and weights.cpu().tolist() == [[0.0] * 3]


def expect_rows_of_any_stride_and_none(route, device) -> None:
    """Logits a slice of wider rows, a transposed (column-major) tensor, no tokens; a bf16
    bias."""
    r = CONFIGS["v3"]
    wide, bias = problem(40, r.experts + 64, device, seed=5)
    logits, bias = wide[:, : r.experts], bias[: r.experts]
    check(route, logits, bias, r, moe_route(logits.cpu(), bias.cpu(), *r.arguments))
    logits = wide[:, : r.experts].t().contiguous().t()
    check(route, logits, bias, r)
    bf16 = bias.bfloat16()
    check(route, logits, bf16, r, moe_route(logits.cpu(), bf16.cpu(), *r.arguments))
    weights, ids = route(logits[:0], bias, *r.arguments)
    assert weights.shape == ids.shape == (0, r.k) and ids.dtype == torch.int64


def expect_rows_that_are_no_tokens_to_go_nowhere(route, device) -> None:
    """Rows where real_rows is False (a CUDA graph's padding, NaN logits in one): ids -1 and
    weights 0; the real rows as without real_rows."""
    r = CONFIGS["v3"]
    logits, bias = problem(6, r.experts, device, seed=11)
    logits[4] = float("nan")
    real = torch.tensor([True, False, True, True, False, False], device=device)
    weights, ids = route(logits, bias, *r.arguments, real)
    want_weights, want_ids = route(logits, bias, *r.arguments)
    assert torch.equal(ids[real], want_ids[real])
    assert torch.equal(weights[real], want_weights[real])
    assert ids[~real].eq(-1).all() and weights[~real].eq(0).all()
    assert weights.shape == ids.shape == (6, r.k)


EDGE_CASES = [
    expect_equal_choices_to_go_to_the_lower_id,
    expect_group_ties_to_go_to_the_lower_group,
    expect_nan_to_rank_last,
    expect_rows_of_any_stride_and_none,
    expect_rows_that_are_no_tokens_to_go_nowhere,
]


# ---- CPU: the reference (and the cases on CUDA: the kernel) ----


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", EDGE_CASES, ids=lambda case: case.__name__)
def test_edge_cases(case, device):
    case(moe_route, device)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_reference_matches_float64(name):
    r = CONFIGS[name]
    logits, bias = problem(500, r.experts, seed=len(name))
    check(moe_route, logits, bias, r)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_reference_follows_the_rules_on_exact_ties_nan_and_infinities(name):
    r = CONFIGS[name]
    logits, bias = exact_problem(64, r.experts, seed=len(name))
    check_exact(moe_route, logits, bias, r)


@pytest.mark.parametrize("name", ["v3", "v2-lite", "v2", "tiny"])
def test_the_reference_chooses_as_gate_select_did(name):
    """The same experts, with the same weights, as the formula before the operator (whose
    slot order was topk's); the reference's slots in descending order of choice."""
    r = CONFIGS[name]
    logits, bias = problem(500, r.experts, seed=7)
    weights, ids = moe_route(logits, bias, *r.arguments)
    old_weights, old_ids = gate_select_formula(logits.sigmoid(), bias, r)
    _, decisive = route_float64(logits, bias, r)
    assert_same_choice((weights, ids), (old_weights, old_ids), decisive)
    choice = logits.sigmoid() + bias
    assert (choice.gather(1, ids).diff(dim=1) <= 0).all()


@pytest.mark.parametrize("name", ["v3", "v2-lite", "6-groups"])
def test_opcheck_on_cpu(name):
    r = CONFIGS[name]
    torch.library.opcheck(moe_route, (*problem(9, r.experts), *r.arguments))
    real = torch.arange(9) % 3 > 0
    torch.library.opcheck(moe_route, (*problem(9, r.experts), *r.arguments, real))


def test_the_fake_implementation_gives_the_outputs():
    r = CONFIGS["v3"]
    logits, bias = problem(5, r.experts, device="meta")
    weights, ids = moe_route(logits, bias, *r.arguments)
    assert weights.device.type == ids.device.type == "meta"
    assert weights.shape == ids.shape == (5, 8)
    assert (weights.dtype, ids.dtype) == (torch.float32, torch.int64)


def test_torch_compile_traces_the_operator_whole():
    r = CONFIGS["v3"]
    logits, bias = problem(20, r.experts)
    compiled = torch.compile(
        lambda x, b: moe_route(x, b, *r.arguments), fullgraph=True, backend="aot_eager"
    )
    for got, want in zip(
        compiled(logits, bias), moe_route(logits, bias, *r.arguments), strict=True
    ):
        assert torch.equal(got, want)


def test_logits_that_require_grad_route_without_a_gradient():
    """As outside no_grad, the router's weight a parameter: the forward runs."""
    r = CONFIGS["tiny"]
    logits, bias = problem(4, r.experts)
    weights, ids = moe_route(logits.requires_grad_(), bias, *r.arguments)
    want = moe_route(logits.detach(), bias, *r.arguments)
    assert torch.equal(weights.detach(), want[0]) and torch.equal(ids, want[1])


def bad_arguments():
    logits, bias = problem(3, 64)
    v3 = (8, 4, 8, True, 2.5)
    return [
        ((logits[None], bias, *v3), r"logits must be \[n, experts\], got 3 dims"),
        ((logits.double(), bias, *v3), "logits must be float32, got torch.float64"),
        (
            (logits, bias[:63], *v3),
            r"bias must be \[64\] \(one per expert of logits\), got \(63,\)",
        ),
        ((logits, bias.long(), *v3), "bias must be one of .* got torch.int64"),
        ((logits, bias.to("meta"), *v3), "logits and bias must be on one device"),
        ((logits, bias, 6, 4, 8, True, 1.0), r"n_group \(6\) must divide the 64 experts"),
        ((logits, bias, 0, 1, 8, True, 1.0), r"n_group \(0\) must divide"),
        ((logits, bias, 8, 0, 8, True, 1.0), r"topk_group \(0\) must be in 1..n_group \(8\)"),
        ((logits, bias, 8, 9, 8, True, 1.0), r"topk_group \(9\) must be in"),
        ((logits, bias, 64, 4, 2, True, 1.0), "groups score their best two experts: 64 groups"),
        ((logits, bias, 8, 4, 0, True, 1.0), r"k \(0\) must be in 1..the experts of the kept"),
        ((logits, bias, 8, 4, 33, True, 1.0), r"k \(33\) .* \(4 x 8\)"),
        (
            (logits, bias, *v3, torch.ones(4, dtype=torch.bool)),
            r"real_rows must be \[3\] bool \(one per row of logits\), got \(4,\)",
        ),
        ((logits, bias, *v3, torch.ones(3)), r"real_rows must be \[3\] bool.* torch.float32"),
        (
            (logits, bias, *v3, torch.ones(3, dtype=torch.bool, device="meta")),
            "logits and real_rows must be on one device",
        ),
    ]


@pytest.mark.parametrize("args, message", bad_arguments())
def test_bad_arguments_are_a_value_error_naming_the_problem(args, message):
    with pytest.raises(ValueError, match=message):
        moe_route(*args)
    with pytest.raises(ValueError, match=message):
        triton_moe_route(*args)


def test_the_kernel_refuses_more_experts_than_it_holds():
    """Before any launch (so without triton)."""
    logits, bias = problem(2, 2 * MAX_EXPERTS)
    with pytest.raises(ValueError, match=f"at most {MAX_EXPERTS} experts, got {2 * MAX_EXPERTS}"):
        triton_moe_route(logits, bias, 1, 1, 8, True, 1.0)


# ---- the Triton kernel on the CPU, through Triton's interpreter ----


def test_the_kernel_in_triton_s_interpreter(in_triton_interpreter):
    """`interpreted_checks`, in Triton's interpreter."""
    in_triton_interpreter(__file__)


def interpreted_checks():
    """Every config on 1 and 30 random tokens (against float64 and the reference) and 16 exact
    ones (the rules); the edge cases."""
    for name, r in CONFIGS.items():
        for n in (1, 30):
            logits, bias = problem(n, r.experts, seed=n + len(name))
            check(triton_moe_route, logits, bias, r, moe_route(logits, bias, *r.arguments))
        check_exact(triton_moe_route, *exact_problem(16, r.experts, seed=len(name)), r)
    for case in EDGE_CASES:
        case(triton_moe_route, "cpu")


# ---- GPU ----


@gpu
@pytest.mark.parametrize("n", [1, 7, 1000, 20000])
@pytest.mark.parametrize("name", CONFIGS)
def test_the_kernel_matches_float64_and_the_reference(name, n):
    """Fresh random tokens; the outputs' memory NaN (and out-of-range ids) before the call,
    so that anything left unwritten shows."""
    r = CONFIGS[name]
    logits, bias = problem(n, r.experts, "cuda", seed=n + 100)
    reference = moe_route(logits.cpu(), bias.cpu(), *r.arguments)
    poison = (
        torch.full((n, r.k), float("nan"), device="cuda"),
        torch.full((n, r.k), -7, device="cuda"),
    )
    del poison  # the outputs' blocks, next
    check(moe_route, logits, bias, r, reference)
    first = moe_route(logits, bias, *r.arguments)
    again = moe_route(logits, bias, *r.arguments)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))  # deterministic


@gpu
@pytest.mark.parametrize("name", CONFIGS)
def test_the_kernel_follows_the_rules_on_exact_ties_nan_and_infinities(name):
    r = CONFIGS[name]
    logits, bias = exact_problem(2000, r.experts, seed=len(name) + 1)
    check_exact(moe_route, logits.cuda(), bias.cuda(), r)


@gpu
def test_more_experts_than_the_kernel_holds_take_the_reference_on_cuda():
    r = Routing(2 * MAX_EXPERTS, 8, 2, 8, True, 2.5)
    logits, bias = problem(50, r.experts, "cuda")
    check(moe_route, logits, bias, r, moe_route(logits.cpu(), bias.cpu(), *r.arguments))


@gpu
def test_the_kernel_does_not_wait_for_the_device():
    r = CONFIGS["v3"]
    logits, bias = problem(64, r.experts, "cuda")
    moe_route(logits, bias, *r.arguments)  # compiles first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_route(logits, bias, *r.arguments)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
@pytest.mark.parametrize("n", [1, 64])
@pytest.mark.parametrize("name", ["v3", "v2-lite"])
def test_the_kernel_replays_in_a_cuda_graph(name, n):
    """Captured once, replayed on new logits and bias in the same tensors."""
    r = CONFIGS[name]
    logits, bias = problem(n, r.experts, "cuda")
    moe_route(logits, bias, *r.arguments)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = moe_route(logits, bias, *r.arguments)
    for seed in (1, 2):
        new_logits, new_bias = problem(n, r.experts, "cuda", seed=seed)
        logits.copy_(new_logits)
        bias.copy_(new_bias)
        graph.replay()
        torch.cuda.synchronize()
        want = moe_route(logits, bias, *r.arguments)
        assert torch.equal(weights, want[0]) and torch.equal(ids, want[1])
        check(lambda *_: (weights, ids), logits, bias, r)


@gpu
@pytest.mark.parametrize("name", ["v3", "v2-lite", "v2"])
def test_opcheck_on_cuda(name):
    r = CONFIGS[name]
    torch.library.opcheck(moe_route, (*problem(9, r.experts, "cuda"), *r.arguments))


@gpu
def test_torch_compile_calls_the_kernel():
    r = CONFIGS["v3"]
    logits, bias = problem(33, r.experts, "cuda")
    compiled = torch.compile(lambda x, b: moe_route(x, b, *r.arguments), fullgraph=True)
    for got, want in zip(
        compiled(logits, bias), moe_route(logits, bias, *r.arguments), strict=True
    ):
        assert torch.equal(got, want)


@gpu
@pytest.mark.parametrize("name", ["v3", "v2-lite"])
def test_router_gemm_logits_choose_as_gate_select_did_on_cuda(name):
    """Logits of a bf16 router GEMM with fp32 output (as `Gate` computes them) and a bf16
    bias: the kernel's experts and weights are those of the formula before the operator,
    run on CUDA, on every decisive token."""
    r = CONFIGS[name]
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2000, 2048, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(r.experts, 2048, generator=g) * 0.02).to("cuda", torch.bfloat16)
    bias = (0.1 * torch.randn(r.experts, generator=g)).to("cuda", torch.bfloat16)
    logits = torch.mm(x, w.t(), out_dtype=torch.float32)
    weights, ids = moe_route(logits, bias, *r.arguments)
    old_weights, old_ids = gate_select_formula(logits.sigmoid(), bias, r)
    _, decisive = route_float64(logits.cpu(), bias.cpu(), r)
    decisive = decisive.cuda()
    assert decisive.float().mean() >= 0.95
    assert_same_choice((weights, ids), (old_weights, old_ids), decisive)


if __name__ == "__main__":
    interpreted_checks()
