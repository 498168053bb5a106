"""`ref-server repro`: both phases' V3-shaped slices measured on the device at hand
(`slices.measure`), projected per node (`PhaseProjection`), compared and priced
(`Reproduction`); a table, JSON or a PNG.

What is measured and what is not: each part of a layer's compute for one microbatch is
measured; dispatch and combine are DeepEP's published H800 + InfiniBand figures scaled to the
layout's bytes (`communication`); balancedness is EPLB's over synthetic Zipf loads (assumed),
or perfect with zipf 0; no two-batch step is measured (the slice has no peers to exchange
with), so the projection stands on the ideal overlap, an upper bound, and no figure of it is a
GPU figure yet (`PhaseProjection.gpu_figure` refuses). See docs/reproduction.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ref_server.repro import communication, imbalance, published, slices
from ref_server.repro.projection import Communication, PhaseProjection
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
    """What one slice runs: the two operating points and the prompt (and decode KV) length."""

    prefill: OperatingPoint
    decode: OperatingPoint
    prompt: int


LAYOUTS = {
    "v3": Layout(PREFILL_EP32, DECODE_EP144, slices.PROMPT),
    "tiny": Layout(
        OperatingPoint("prefill", 32, 256, source="assumed", note=CPU_SCALE),
        OperatingPoint("decode", 144, 32, source="assumed", note=CPU_SCALE),
        prompt=64,
    ),
}


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
) -> Reproduction:
    """Both phases of the named slice measured on `device` through `kernels` (the model's:
    `ref_server.kernel_choice`) and projected."""
    if slice_name not in LAYOUTS:
        raise ValueError(f"unknown slice {slice_name!r}; slices: {', '.join(LAYOUTS)}")
    layout = LAYOUTS[slice_name]
    args = slices.slice_args(slice_name)
    dims = slices.dims_of(args)
    phases = {}
    for point in (layout.prefill, layout.decode):
        times, where = slices.measure(
            point, slice_name, device, weight_dtype, reps, layout.prompt, kernels
        )
        phases[point.phase] = PhaseProjection(
            point,
            where,
            times,
            phase_communication(point, dims),
            balancedness(point, dims, args.n_group, zipf, seed),
            dims=dims,
        )
    weights = decode_weights(slice_name, layout.decode, weight_dtype or "bf16")
    return Reproduction(
        phases["prefill"], phases["decode"], decode_weights_per_gpu=weights, kernels=kernels
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
    return "computed" if name.startswith("prefill") else "output"
