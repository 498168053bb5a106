"""DeepSeek's day-6 cost model: what a serving deployment costs, earns and needs.

The model is the one in DeepSeek's "Day 6" post (2025-03-01): GPUs are rented by the hour,
every token is billed at list prices (cache-hit input, cache-miss input, output), and the
cost-profit margin is (revenue - cost) / cost. Per-node throughput turns token volumes into
the number of prefill and decode nodes that serve them and into a cost per million tokens.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from ref_server import config_file

PER_MILLION = 1e6
SECONDS_PER_HOUR = 3600.0


def _field(description: str) -> dataclasses.Field:
    return dataclasses.field(metadata={"help": description})


class EconomicsError(ValueError):
    """An input to the cost model that cannot describe a deployment."""


@dataclass(frozen=True)
class CostInputs:
    """A deployment over a time window: hardware, traffic, prices and per-node throughput.

    Token volumes are totals over the window. Throughputs are tokens per second per node:
    prefill counts input tokens (cache hits included), decode counts output tokens.
    """

    gpu_hour_usd: float = _field("rental price of one GPU for one hour, USD")
    gpus_per_node: int = _field("GPUs per node")
    mean_nodes: float = _field("nodes in service, averaged over the window")
    peak_nodes: float = _field("most nodes in service at once during the window")
    window_hours: float = _field("length of the window the volumes cover, hours")
    input_tokens: float = _field("input tokens served in the window, cache hits included")
    cache_hit_tokens: float = _field("input tokens served from the KV cache")
    output_tokens: float = _field("output tokens generated in the window")
    input_hit_usd_per_m: float = _field("price of a million cache-hit input tokens, USD")
    input_miss_usd_per_m: float = _field("price of a million cache-miss input tokens, USD")
    output_usd_per_m: float = _field("price of a million output tokens, USD")
    prefill_tokens_per_s_per_node: float = _field("prefill input tokens/s per node")
    decode_tokens_per_s_per_node: float = _field("decode output tokens/s per node")

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise EconomicsError(f"{field.name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise EconomicsError(f"{field.name} must be finite, got {value}")
            if value < 0:
                raise EconomicsError(f"{field.name} must not be negative, got {value}")
        if self.gpus_per_node != int(self.gpus_per_node) or self.gpus_per_node < 1:
            raise EconomicsError(
                f"gpus_per_node must be a whole number >= 1, got {self.gpus_per_node}"
            )
        for name in (
            "gpu_hour_usd",
            "mean_nodes",
            "peak_nodes",
            "window_hours",
            "prefill_tokens_per_s_per_node",
            "decode_tokens_per_s_per_node",
        ):
            if getattr(self, name) == 0:
                raise EconomicsError(f"{name} must be greater than zero")
        if self.peak_nodes < self.mean_nodes:
            raise EconomicsError(
                f"peak_nodes ({self.peak_nodes}) is below mean_nodes ({self.mean_nodes})"
            )
        if self.cache_hit_tokens > self.input_tokens:
            raise EconomicsError(
                f"cache_hit_tokens ({self.cache_hit_tokens:g}) exceeds input_tokens "
                f"({self.input_tokens:g}): cache hits are part of the input"
            )

    @classmethod
    def field_names(cls) -> list[str]:
        return [field.name for field in dataclasses.fields(cls)]


@dataclass(frozen=True)
class CostReport:
    """What `evaluate` derives from `CostInputs`; money in USD over the inputs' window."""

    cost_usd: float
    peak_provisioned_cost_usd: float
    revenue_usd: float
    margin: float
    cache_hit_share: float
    prefill_usd_per_m_input: float
    decode_usd_per_m_output: float
    prefill_nodes_needed: float
    decode_nodes_needed: float
    nodes_needed: float
    busy_share_of_mean_nodes: float


def evaluate(inputs: CostInputs) -> CostReport:
    node_hour_usd = inputs.gpu_hour_usd * inputs.gpus_per_node
    cost = node_hour_usd * inputs.mean_nodes * inputs.window_hours
    miss_tokens = inputs.input_tokens - inputs.cache_hit_tokens
    revenue = (
        inputs.cache_hit_tokens * inputs.input_hit_usd_per_m
        + miss_tokens * inputs.input_miss_usd_per_m
        + inputs.output_tokens * inputs.output_usd_per_m
    ) / PER_MILLION
    window_s = inputs.window_hours * SECONDS_PER_HOUR
    prefill_nodes = inputs.input_tokens / (inputs.prefill_tokens_per_s_per_node * window_s)
    decode_nodes = inputs.output_tokens / (inputs.decode_tokens_per_s_per_node * window_s)
    return CostReport(
        cost_usd=cost,
        peak_provisioned_cost_usd=node_hour_usd * inputs.peak_nodes * inputs.window_hours,
        revenue_usd=revenue,
        margin=(revenue - cost) / cost,
        cache_hit_share=inputs.cache_hit_tokens / inputs.input_tokens
        if inputs.input_tokens
        else 0.0,
        prefill_usd_per_m_input=node_hour_usd
        / (inputs.prefill_tokens_per_s_per_node * SECONDS_PER_HOUR)
        * PER_MILLION,
        decode_usd_per_m_output=node_hour_usd
        / (inputs.decode_tokens_per_s_per_node * SECONDS_PER_HOUR)
        * PER_MILLION,
        prefill_nodes_needed=prefill_nodes,
        decode_nodes_needed=decode_nodes,
        nodes_needed=prefill_nodes + decode_nodes,
        busy_share_of_mean_nodes=(prefill_nodes + decode_nodes) / inputs.mean_nodes,
    )


# The post gives token volumes rounded to the billion (608 B in, 342 B cache hits, 168 B out)
# but revenue to the dollar ($562,027). Priced as rounded, the volumes give $562,100. The
# output volume below is the one inside "168 B" that gives the published revenue with the
# published input volumes; how DeepSeek's exact volumes split that $73 is not published.
PRESETS: dict[str, CostInputs] = {
    "deepseek-day6": CostInputs(
        gpu_hour_usd=2.0,
        gpus_per_node=8,
        mean_nodes=226.75,
        peak_nodes=278,
        window_hours=24,
        input_tokens=608e9,
        cache_hit_tokens=342e9,
        output_tokens=round((562_027 - 342e3 * 0.14 - 266e3 * 0.55) / 2.19 * PER_MILLION),
        input_hit_usd_per_m=0.14,
        input_miss_usd_per_m=0.55,
        output_usd_per_m=2.19,
        prefill_tokens_per_s_per_node=73.7e3,
        decode_tokens_per_s_per_node=14.8e3,
    ),
}


def preset(name: str) -> CostInputs:
    try:
        return PRESETS[name]
    except KeyError:
        raise EconomicsError(
            f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
        ) from None


def read_toml(path: str | Path) -> dict[str, object]:
    """Read cost-model values from a TOML file: any `CostInputs` field, plus `preset`."""
    try:
        return config_file.read_toml(path, ["preset", *CostInputs.field_names()])
    except ValueError as error:
        raise EconomicsError(str(error)) from None


def build_inputs(preset_name: str, *overrides: dict[str, object]) -> CostInputs:
    """The named preset with each mapping of field values applied in turn (None = keep)."""
    merged: dict[str, object] = {}
    for values in overrides:
        merged.update({key: value for key, value in values.items() if value is not None})
    return dataclasses.replace(preset(preset_name), **merged)
