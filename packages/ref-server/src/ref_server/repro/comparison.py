"""Our projected figures beside the published ones (docs/reproduction.md, Comparisons), and
what they are worth under DeepSeek's day-6 cost model (`ref_server.economics`).

Like is compared with like only where the reference is a saturation figure too: day 6's
73.7k / 14.8k are 24-hour averages over varying load, so each row says which kind its
reference is and what else differs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ref_server import economics
from ref_server.repro import published
from ref_server.repro.projection import PhaseProjection
from ref_server.repro.terms import CPU_LABEL, Term, derived

SATURATION, DAY_AVERAGE = "saturation", "day average"
NOT_LIKE = "a 24-hour average over varying load against our saturation figure: not like with like"

# phase -> (our throughput row: 0 computed / output without MTP, -1 incl. cache hits / output
# with MTP where it is on), reference, kind, caveat
REFERENCES = {
    "prefill": [
        (0, published.PROFILE_PREFILL_PER_NODE, SATURATION, "H800, perfectly balanced routing"),
        *(
            (0, term, SATURATION, f"96 x H100, {length:,}-token inputs")
            for length, term in published.SGLANG_PREFILL_PER_NODE.items()
        ),
        (-1, published.DAY6_PREFILL_PER_NODE, DAY_AVERAGE, f"H800; {NOT_LIKE}"),
    ],
    "decode": [
        (
            -1,
            published.PROFILE_DECODE_PER_NODE,
            SATURATION,
            "H800, balanced routing, KV 4,096; SGLang implies it includes MTP",
        ),
        (
            0,
            published.SGLANG_DECODE_PER_NODE,
            SATURATION,
            "96 x H100, 2K inputs, 256 requests a GPU",
        ),
        (-1, published.SGLANG_DECODE_MTP_PER_NODE, SATURATION, "96 x H100, simulated MTP, KV 4K"),
        (-1, published.DAY6_DECODE_PER_NODE, DAY_AVERAGE, f"H800; {NOT_LIKE}"),
    ],
}


@dataclass(frozen=True)
class Comparison:
    """Our figure over a published one of `kind` ("saturation" or "day average")."""

    ours: Term
    reference: Term
    kind: str
    caveat: str

    @property
    def ratio(self) -> float:
        return self.ours.value / self.reference.value

    def to_json(self) -> dict[str, object]:
        return {
            "ours": self.ours.name,
            "ours_value": self.ours.value,
            "reference": self.reference.to_json(),
            "kind": self.kind,
            "ratio": self.ratio,
            "caveat": self.caveat,
        }


def comparisons(projection: PhaseProjection) -> list[Comparison]:
    """The phase's projected figure beside each published one of that phase."""
    ours = projection.throughput[projection.projected_variant]
    phase = projection.point.phase
    caveat = "" if projection.device.is_gpu else f"{CPU_LABEL}; "
    if projection.projected_variant != "measured_overlap":
        caveat += "ours an upper bound; "
    if projection.balancedness.value != 1:
        caveat += f"ours at balancedness {projection.balancedness.value:.3g}; "
    if projection.kv_length is not None:
        caveat += f"ours at KV {projection.kv_length.value:,.0f}; "
    return [
        Comparison(ours[row], reference, kind, caveat + _mtp(ours[row], phase) + text)
        for row, reference, kind, text in REFERENCES[phase]
    ]


def _mtp(ours: Term, phase: str) -> str:
    if phase == "prefill":
        return ""
    return "ours with MTP; " if "mtp" in ours.name else "ours without MTP; "


def margin(prefill: Term, decode: Term, gpu_hour_usd: Term = published.GPU_HOUR_USD) -> list[Term]:
    """Day 6's token volumes and prices served at `prefill` (input tok/s/node incl. cache hits)
    and `decode` (output tok/s/node) on GPUs rented at `gpu_hour_usd`: the fleet is the nodes
    that volume needs at those rates, every node busy all day (DeepSeek's day-average figures
    keep its mean fleet 100.04 % busy; a saturation figure makes this optimistic)."""
    rates = {
        "gpu_hour_usd": gpu_hour_usd.value,
        "prefill_tokens_per_s_per_node": prefill.value,
        "decode_tokens_per_s_per_node": decode.value,
    }
    at_day6_fleet = economics.build_inputs("deepseek-day6", rates)
    nodes = economics.evaluate(at_day6_fleet).nodes_needed
    # CostInputs wants peak >= mean: the peak keeps day 6's ratio to the mean fleet
    peak = nodes * at_day6_fleet.peak_nodes / at_day6_fleet.mean_nodes
    report = economics.evaluate(
        economics.build_inputs("deepseek-day6", rates, {"mean_nodes": nodes, "peak_nodes": peak})
    )
    inputs = [prefill, decode, gpu_hour_usd]
    day = (
        f"deepseek-day6 volumes and prices (ref_server.economics) at {prefill.name}, {decode.name}"
    )
    return [
        derived(name, value, unit, inputs, f"{day}; {note}")
        for name, value, unit, note in (
            ("prefill_nodes_needed", report.prefill_nodes_needed, "node", "input / (rate x 24 h)"),
            ("decode_nodes_needed", report.decode_nodes_needed, "node", "output / (rate x 24 h)"),
            ("cost_usd_per_day", report.cost_usd, "USD", "GPU rent for the nodes needed"),
            ("revenue_usd_per_day", report.revenue_usd, "USD", "every token at R1 list prices"),
            ("margin", report.margin, "1", "(revenue - cost) / cost; day 6 published 5.45"),
            (
                "prefill_usd_per_m_input",
                report.prefill_usd_per_m_input,
                "USD/M tok",
                "node-hour / input tokens an hour",
            ),
            (
                "decode_usd_per_m_output",
                report.decode_usd_per_m_output,
                "USD/M tok",
                "node-hour / output tokens an hour",
            ),
        )
    ]
