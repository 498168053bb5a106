"""From one GPU's per-layer times to tokens per second per node (docs/reproduction.md, The method).

Three step times: no overlap (the two microbatches one after the other), ideal two-batch
overlap (a lower bound on the step, so an upper bound on throughput) and, when a run of the
real executor measured one, the measured two-batch step, which is the projected figure.
Routed-expert and communication times are divided by the balancedness first. Per node =
GPUs per node x tokens a GPU per step / step time; prefill counts computed tokens and also
"incl. cache hits" (computed / (1 - cache-hit share)) as day 6 counts them; decode counts one
output token per request per step: multi-token prediction is not modelled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from ref_server.repro import imbalance, published, schedule
from ref_server.repro.shapes import V3, OperatingPoint, V3Dims
from ref_server.repro.terms import (
    Device,
    Term,
    derived,
    non_negative,
    positive,
    with_cpu_label,
)

SCALED_BY_IMBALANCE = ("routed_experts", "dispatch", "combine")


def _named(holder: object) -> None:
    for field in dataclasses.fields(holder):
        term = getattr(holder, field.name)
        if not isinstance(term, Term) or term.name != field.name or term.unit != "s":
            raise ValueError(f"{field.name} must be a Term named {field.name!r} in seconds (s)")
        non_negative(term)


@dataclass(frozen=True)
class LayerTimes:
    """One GPU's compute for one microbatch, seconds: each MoE layer's parts (as the model's
    op list cuts them, see `schedule.OPS_OF_ITEM`) and one dense layer; the LM head and sampling
    once per step, after both microbatches."""

    attention_prepare: Term
    attention_core: Term
    gate: Term
    routed_experts: Term
    shared_expert: Term
    moe_output: Term
    dense_layer: Term
    head_and_sampling: Term

    def __post_init__(self) -> None:
        _named(self)

    @classmethod
    def measured(cls, note: str, **seconds: float) -> LayerTimes:
        """Every part measured: seconds by field name; note: the run (commit, shapes)."""
        return cls(**{name: Term(name, s, "s", "measured", note) for name, s in seconds.items()})


@dataclass(frozen=True)
class Communication:
    """One microbatch's dispatch and combine in one MoE layer, seconds."""

    dispatch: Term
    combine: Term

    def __post_init__(self) -> None:
        _named(self)


@dataclass(frozen=True)
class PhaseProjection:
    """One phase (prefill or decode) projected from one GPU's times at `point`.

    measured_step: a two-batch step of the real executor, seconds, if one was measured."""

    point: OperatingPoint
    device: Device
    times: LayerTimes
    communication: Communication
    balancedness: Term
    measured_step: Term | None = None
    dims: V3Dims = V3
    cache_hit_share: Term = published.CACHE_HIT_SHARE
    gpus_per_node: Term = published.GPUS_PER_NODE

    def __post_init__(self) -> None:
        imbalance.check(self.balancedness)
        if self.point.microbatches != 2:
            raise ValueError(
                "the two-batch schedules run 2 microbatches, the layout has "
                f"{self.point.microbatches}"
            )
        if self.measured_step is not None:
            positive(self.measured_step)
            if self.measured_step.unit != "s":
                raise ValueError(f"{self.measured_step.name} must be in seconds (s)")
        if not 0 <= self.cache_hit_share.value < 1:
            raise ValueError(f"{self.cache_hit_share.name} must be in [0, 1)")
        positive(self.gpus_per_node)

    def _time_terms(self) -> list[Term]:
        terms = [getattr(self.times, f.name) for f in dataclasses.fields(LayerTimes)]
        return [*terms, self.communication.dispatch, self.communication.combine]

    def inputs(self) -> list[Term]:
        """Every term the projection uses."""
        terms = [self.point.tokens_term(), self.balancedness, *self._time_terms()]
        if self.point.phase == "prefill":
            terms.append(self.cache_hit_share)
        return [*terms, self.gpus_per_node]

    def _note(self, text: str) -> str:
        return text if self.device.is_gpu else with_cpu_label(text)

    def _seconds(self) -> dict[str, float]:
        parts = {f.name: getattr(self.times, f.name).value for f in dataclasses.fields(LayerTimes)}
        parts.update(dispatch=self.communication.dispatch.value)
        parts.update(combine=self.communication.combine.value)
        for name in SCALED_BY_IMBALANCE:
            parts[name] /= self.balancedness.value
        return parts

    @cached_property
    def step_times(self) -> dict[str, Term]:
        """ "no_overlap", "ideal_overlap" and, if measured, "measured_overlap": seconds a step."""
        phase, dims, seconds = self.point.phase, self.dims, self._seconds()
        layers = (dims.first_k_dense_replace, dims.num_moe_layers)
        head = seconds["head_and_sampling"]
        inputs = [self.balancedness, *self._time_terms()]
        where = (
            f"{layers[0]} dense + {layers[1]} MoE layers, 2 microbatches, head and sampling; "
            f"routed experts and communication / balancedness {self.balancedness.value:.3g}"
        )
        times = {
            "no_overlap": derived(
                f"{phase}_step_no_overlap",
                schedule.sequential_seconds(phase, seconds, *layers) + head,
                "s",
                inputs,
                self._note(f"{where}; one microbatch after the other, transfers not hidden"),
            ),
            "ideal_overlap": derived(
                f"{phase}_step_ideal_overlap",
                schedule.overlapped_seconds(phase, seconds, *layers) + head,
                "s",
                inputs,
                self._note(
                    f"{where}; lower bound (throughput upper bound): the {phase} two-batch "
                    "schedule with transfers taking no SMs, one at a time, no launch gaps"
                ),
            ),
        }
        for step in times.values():
            positive(step)
        if self.measured_step is not None:
            times["measured_overlap"] = self.measured_step
        return times

    @cached_property
    def throughput(self) -> dict[str, list[Term]]:
        """Per step time: tokens per second per node (prefill: computed, then incl. cache hits;
        decode: output tokens, no MTP)."""
        phase, tokens = self.point.phase, self.point.tokens_term()
        rows: dict[str, list[Term]] = {}
        for variant, step in self.step_times.items():
            per_node = self.gpus_per_node.value * tokens.value / step.value
            inputs = [tokens, self.gpus_per_node, step]
            if phase == "decode":
                note = self._note(
                    f"output tokens at {step.name}; one token a request a step, no MTP"
                )
                rows[variant] = [
                    derived(f"decode_per_node_{variant}", per_node, "tok/s/node", inputs, note)
                ]
                continue
            computed = derived(
                f"prefill_computed_per_node_{variant}",
                per_node,
                "tok/s/node",
                inputs,
                self._note(f"computed input tokens at {step.name}"),
            )
            share = self.cache_hit_share
            with_hits = derived(
                f"prefill_incl_cache_hits_per_node_{variant}",
                per_node / (1 - share.value),
                "tok/s/node",
                [computed, share],
                self._note(f"computed / (1 - {share.value:g}), as day 6 counts input"),
            )
            rows[variant] = [computed, with_hits]
        return rows

    @property
    def projected_variant(self) -> str:
        """The step time the projection stands on: the measured one, else the ideal bound."""
        return "measured_overlap" if self.measured_step is not None else "ideal_overlap"

    def projected(self) -> Term:
        """The phase's figure for the economics: prefill incl. cache hits, decode output."""
        return self.throughput[self.projected_variant][-1]

    def gpu_figure(self) -> Term:
        """The projected figure as a GPU figure: NotAGPUFigure for a CPU measurement,
        ValueError without a measured two-batch step (the ideal one is only a bound)."""
        self.device.require_gpu(f"the {self.point.phase} projection")
        if self.measured_step is None:
            raise ValueError(
                f"the {self.point.phase} projection has no measured two-batch step: its ideal "
                "overlap is an upper bound, not a figure"
            )
        return self.projected()


def implied_step_time(
    per_node: Term, tokens_per_gpu: Term, gpus_per_node: Term = published.GPUS_PER_NODE
) -> Term:
    """The step a per-node throughput implies: tokens a GPU per step x GPUs per node / per node."""
    positive(per_node)
    positive(tokens_per_gpu)
    return derived(
        f"{per_node.name}_implied_step",
        tokens_per_gpu.value * gpus_per_node.value / per_node.value,
        "s",
        [per_node, tokens_per_gpu, gpus_per_node],
        f"{tokens_per_gpu.name} x {gpus_per_node.name} / {per_node.name}",
    )
