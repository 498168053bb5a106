"""`ref-server repro`: both phases' V3- or V3.2-shaped slices measured on the device at hand
(`slices.measure`), decode at one or more KV lengths and, with MTP, its verify step, projected
per node (`PhaseProjection`), compared and priced (`Reproduction`); a table, JSON or a PNG.

What is measured and what is not: each part of a layer's compute for one microbatch is
measured; dispatch and combine are DeepEP's published H800 + InfiniBand figures scaled to the
layout's bytes (`communication`); balancedness is EPLB's over synthetic Zipf loads (assumed),
or perfect with zipf 0; no two-batch step is measured (the slice has no peers to exchange
with), so the projection stands on the ideal overlap, an upper bound, and no figure of it is a
GPU figure yet (`PhaseProjection.gpu_figure` refuses). With MTP the acceptance rate is an input
(published or assumed), the verify step is measured where the model attends absorbed over the
latent cache at several new tokens a request (V3.2's sparse attention) and projected from the
decode step elsewhere, and the module's drafts are projected from the decode step's MoE layer.
See docs/reproduction.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ref_server.model.speculative import check_draft_tokens
from ref_server.repro import communication, imbalance, published, slices
from ref_server.repro.projection import (
    AttentionWork,
    Communication,
    PhaseProjection,
    Speculation,
    projected_verify,
)
from ref_server.repro.report import Reproduction
from ref_server.repro.shapes import DECODE_EP144, PREFILL_EP32, OperatingPoint, V3Dims
from ref_server.repro.terms import Term, derived

DESTINATIONS = Term(
    "destinations_per_token",
    4,
    "node",
    "assumed",
    "nodes a prefill token's experts are on: V3's group-limited routing's most, 4 of EP32's 4",
)
# A CPU runs the layouts at a small scale: the same ranks and slots, fewer tokens.
CPU_SCALE = "PREFILL_EP32's / DECODE_EP144's ranks and slots with fewer tokens: a CPU-sized run"


@dataclass(frozen=True)
class Layout:
    """What one slice runs: the two operating points, the prompt length and decode's KV length
    unless one is given."""

    prefill: OperatingPoint
    decode: OperatingPoint
    prompt: int
    kv_length: int


V3_LAYOUT = Layout(
    PREFILL_EP32, DECODE_EP144, slices.PROMPT, int(published.DAY6_MEAN_KV_LENGTH.value)
)
TINY_LAYOUT = Layout(
    OperatingPoint("prefill", 32, 256, source="assumed", note=CPU_SCALE),
    OperatingPoint("decode", 144, 32, source="assumed", note=CPU_SCALE),
    prompt=64,
    kv_length=64,
)
LAYOUTS = {"v3": V3_LAYOUT, "v3.2": V3_LAYOUT, "tiny": TINY_LAYOUT, "v3.2-tiny": TINY_LAYOUT}


def kv_length_term(tokens: int) -> Term:
    """Decode's KV length: day 6's published mean, or a length the caller chose."""
    if tokens == published.DAY6_MEAN_KV_LENGTH.value:
        return published.DAY6_MEAN_KV_LENGTH
    return Term("decode_kv_length", tokens, "tok", "assumed", "a KV length given to the run")


def mtp_terms(acceptance: float, drafts: int) -> tuple[Term, Term]:
    """MTP's acceptance rate and drafts a round: published (DeepSeek-V3's) where they are its,
    else given to the run."""
    check_draft_tokens(drafts)
    given = "given to the run"
    if acceptance == published.MTP_ACCEPTANCE.value:
        rate = published.MTP_ACCEPTANCE
    else:
        rate = Term("mtp_acceptance", acceptance, "1", "assumed", f"a draft's acceptance, {given}")
    if drafts == published.MTP_DRAFTS.value:
        return rate, published.MTP_DRAFTS
    note = f"drafts a round, {given}; each accepted at the rate of the first (assumed)"
    return rate, Term("mtp_drafts", drafts, "tok", "assumed", note)


def phase_communication(point: OperatingPoint, dims: V3Dims) -> Communication:
    """One microbatch's dispatch and combine from DeepEP's published figures: the normal mode
    at its EP32 RDMA bandwidth (prefill, FP8 dispatch, BF16 combine), the low-latency mode at
    EP128 scaled by pairs (decode)."""
    tokens = point.tokens_per_gpu // point.microbatches
    if point.phase == "prefill":
        return Communication(
            communication.normal_seconds(
                "dispatch",
                published.DEEPEP_NORMAL_DISPATCH_EP32,
                tokens,
                DESTINATIONS,
                fp8=True,
                dims=dims,
            ),
            communication.normal_seconds(
                "combine",
                published.DEEPEP_NORMAL_COMBINE_EP32,
                tokens,
                DESTINATIONS,
                fp8=False,
                dims=dims,
            ),
        )
    pairs = tokens * dims.num_experts_per_tok
    return Communication(
        communication.low_latency_seconds(
            "dispatch", published.DEEPEP_LL_DISPATCH_EP128, pairs, dims
        ),
        communication.low_latency_seconds(
            "combine", published.DEEPEP_LL_COMBINE_EP128, pairs, dims
        ),
    )


def zipf_loads(layers: int, experts: int, tokens: float, exponent: float, seed: int):
    """`[layers, experts]` tokens routed to each expert: a Zipf(exponent) popularity over the
    experts, shuffled per layer."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, experts + 1) ** exponent
    weights /= weights.sum()
    return np.stack([rng.permutation(weights) * tokens for _ in range(layers)])


def balancedness(point: OperatingPoint, dims: V3Dims, groups: int, zipf: float, seed: int):
    """EPLB's balancedness over Zipf(zipf) loads of the layout's pairs; zipf 0: perfect."""
    if zipf < 0:
        raise ValueError(f"zipf must be >= 0, got {zipf:g}")
    if zipf == 0:
        return imbalance.PERFECT
    pairs = point.gpus * point.tokens_per_gpu * dims.num_experts_per_tok
    loads = zipf_loads(dims.num_moe_layers, dims.n_routed_experts, pairs, zipf, seed)
    nodes = max(1, point.gpus // published.GPUS_PER_NODE.value)
    note = f"synthetic Zipf({zipf:g}) expert loads over {dims.num_moe_layers} layers, seed {seed}"
    return imbalance.from_loads(
        loads, point.physical_experts, groups, int(nodes), point.gpus, "assumed", note
    )


def reproduce(
    slice_name: str,
    device: str,
    weight_dtype: str | None = None,
    reps: int = 5,
    zipf: float = 1.0,
    seed: int = 0,
    kernels: str = "ours",
    kv_lengths: list[int] | None = None,
    mtp_acceptance: float | None = None,
    mtp_drafts: int = 1,
) -> list[Reproduction]:
    """Both phases of the named slice measured on `device` through `kernels` (the model's:
    `ref_server.kernel_choice`) and projected: one reproduction a decode KV length (default:
    the layout's), the prefill measured once. mtp_acceptance: decode with MTP, its drafts each
    accepted at this rate, `mtp_drafts` a round; None: without."""
    if slice_name not in LAYOUTS:
        raise ValueError(f"unknown slice {slice_name!r}; slices: {', '.join(LAYOUTS)}")
    if any(tokens < 2 for tokens in kv_lengths or []):
        raise ValueError(f"decode KV lengths must be >= 2 tokens, got {kv_lengths}")
    layout = LAYOUTS[slice_name]
    args = slices.slice_args(slice_name)
    dims = slices.dims_of(args)
    mtp = None if mtp_acceptance is None else mtp_terms(mtp_acceptance, mtp_drafts)

    def measure(point: OperatingPoint, context: int, query_len: int = 1) -> slices.Measurement:
        return slices.measure(
            point, slice_name, device, weight_dtype, reps, context, kernels, query_len
        )

    def project(point, measured, kv_length=None, speculation=None) -> PhaseProjection:
        return PhaseProjection(
            point,
            measured.device,
            measured.times,
            phase_communication(point, dims),
            balancedness(point, dims, args.n_group, zipf, seed),
            dims=dims,
            kv_length=kv_length,
            attention=attention_work(point, measured, kv_length),
            speculation=speculation,
        )

    prefill = project(layout.prefill, measure(layout.prefill, layout.prompt))
    weights = decode_weights(slice_name, layout.decode, weight_dtype or "bf16")
    runs = []
    for tokens in kv_lengths or [layout.kv_length]:
        measured = measure(layout.decode, tokens)
        speculation = None
        if mtp is not None:
            acceptance, drafts = mtp
            verify = verify_point(layout.decode, drafts)
            if args.is_sparse:
                times = measure(verify, tokens, query_len=int(drafts.value) + 1).times
            else:
                times = projected_verify(measured.times, drafts)
            speculation = Speculation(acceptance, drafts, times, phase_communication(verify, dims))
        decode = project(layout.decode, measured, kv_length_term(tokens), speculation)
        runs.append(
            Reproduction(
                prefill, decode, decode_weights_per_gpu=weights, kernels=kernels, model=slice_name
            )
        )
    return runs


def verify_point(decode: OperatingPoint, drafts: Term) -> OperatingPoint:
    """MTP's verify step at `decode`'s requests: drafts + 1 tokens a request. The slice measures
    it where the model attends over the latent cache at several new tokens a request as at one
    (a sparse model); a dense model's verify step runs as a chunk of prefill, which decompresses
    each request's whole context, not as the absorbed verify step DeepSeek runs: its parts are
    `projected_verify`'s."""
    tokens = int(drafts.value) + 1
    return dataclasses.replace(
        decode,
        tokens_per_gpu=decode.tokens_per_gpu * tokens,
        note=f"{decode.note}; a verify step of {tokens} tokens a request",
    )


def attention_work(
    point: OperatingPoint, measured: slices.Measurement, kv_length: Term | None
) -> AttentionWork:
    inputs = [point.tokens_term(), *([kv_length] if kv_length else [])]
    note = (
        f"one microbatch, one layer of rank 0 of {point.phase} EP{point.gpus}, as the slice ran "
        "it: ModelArgs.attention_flops"
    )
    return AttentionWork(
        derived(f"{point.phase}_attention_flops", measured.attention_flops, "FLOP", inputs, note),
        derived(
            f"{point.phase}_attention_kv_bytes",
            measured.attention_kv_bytes,
            "B",
            inputs,
            "the cache bytes the attention reads at least once, one microbatch, one layer: each "
            "context's rows, or in V3.2 each query's picked rows and its context's index keys",
        ),
    )


def decode_weights(slice_name: str, point: OperatingPoint, weight_dtype: str) -> Term:
    """Bytes of weights a decode GPU holds: the slice's whole model (all its layers), its
    routed experts as `point`'s slots a GPU (ModelArgs.weight_bytes_per_gpu)."""
    model = slices.SLICES[slice_name]
    slots = point.physical_experts // point.gpus
    ep_size = model.n_routed_experts // slots
    return derived(
        "decode_weights_per_gpu",
        model.weight_bytes_per_gpu(ep_size, weight_dtype),
        "B",
        [point.tokens_term()],
        f"{model.num_hidden_layers} layers in {weight_dtype}, {slots} routed experts a GPU at "
        f"{point.phase} EP{point.gpus}, attention, dense and shared layers on each",
    )


def draw(reproduction: Reproduction, path: str) -> None:
    """Bars of our per-node figures (no overlap, ideal overlap) beside the published ones, per
    phase, on a bare matplotlib Figure (no display needed)."""
    from ref_server.bench.plot import require_matplotlib

    require_matplotlib()
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4.5), layout="constrained")
    for axes, projection in zip(
        figure.subplots(1, 2), (reproduction.prefill, reproduction.decode), strict=True
    ):
        ours = [
            (f"ours, {variant.replace('_', ' ')}, {_counted(term.name)}", term.value)
            for variant, terms in projection.throughput.items()
            for term in terms
        ]
        published_bars = [
            (f"{row.reference.name.replace('_per_node', '')} ({row.kind})", row.reference.value)
            for row in reproduction.comparisons()
            if row.ours.name.startswith(projection.point.phase)
        ]
        names, values = zip(*ours, *published_bars, strict=True)
        colors = ["tab:blue"] * len(ours) + ["tab:gray"] * len(published_bars)
        axes.barh(names, values, color=colors)
        axes.invert_yaxis()
        axes.set_xlabel("tokens/s per 8-GPU node")
        bound = (
            "measured two-batch step"
            if projection.measured_step
            else "ideal overlap: an upper bound"
        )
        axes.set_title(
            f"{projection.point.phase}, {bound}\n{projection.device.label}", fontsize=9, loc="right"
        )
    figure.savefig(path, dpi=120)


def _counted(name: str) -> str:
    if "incl_cache_hits" in name:
        return "incl. cache hits"
    if "mtp" in name:
        return "output with MTP"
    return "computed" if name.startswith("prefill") else "output"
