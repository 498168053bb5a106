"""From one GPU's per-layer times to tokens per second per node (docs/reproduction.md, The method).

Three step times: no overlap (the two microbatches one after the other), ideal two-batch
overlap (a lower bound on the step, so an upper bound on throughput) and, when a run of the
real executor measured one, the measured two-batch step, which is the projected figure.
Routed-expert and communication times are divided by the balancedness first. Per node =
GPUs per node x tokens a GPU per step / step time; prefill counts computed tokens and also
"incl. cache hits" (computed / (1 - cache-hit share)) as day 6 counts them; decode counts one
output token per request per step and, with a `Speculation` (MTP), also the accepted length per
step of a verify step and the module's drafts.
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
class AttentionWork:
    """What one microbatch's attention computes and reads in one layer (`ModelArgs.
    attention_flops`, sparse in V3.2): `flops` (FLOP) and `kv_bytes` (cache bytes read, B)."""

    flops: Term
    kv_bytes: Term

    def __post_init__(self) -> None:
        for term, unit in ((self.flops, "FLOP"), (self.kv_bytes, "B")):
            if term.unit != unit:
                raise ValueError(f"{term.name} must be in {unit}, got {term.unit!r}")
            positive(term)


@dataclass(frozen=True)
class Speculation:
    """Decode with DeepSeek-V3's MTP module as the draft model: each round it drafts `drafts`
    tokens a request, the model verifies them in one step of drafts + 1 tokens a request
    (`verify`: one microbatch's parts, measured or `projected_verify`; `verify_communication`:
    its dispatch and combine), and a request keeps its drafts up to the first rejected one,
    each kept with probability `acceptance`, and one more token."""

    acceptance: Term
    drafts: Term
    verify: LayerTimes
    verify_communication: Communication

    def __post_init__(self) -> None:
        if not 0 <= self.acceptance.value <= 1:
            raise ValueError(
                f"{self.acceptance.name} must be in [0, 1], got {self.acceptance.value:g}"
            )
        k = self.drafts.value
        if k < 1 or k != int(k):
            raise ValueError(f"{self.drafts.name} must be a whole number >= 1, got {k:g}")

    def accepted_length(self) -> Term:
        """Tokens a round gives a request: 1 + p + ... + p^k."""
        p, k = self.acceptance.value, int(self.drafts.value)
        return derived(
            "mtp_accepted_length",
            sum(p**i for i in range(k + 1)),
            "tok",
            [self.acceptance, self.drafts],
            f"1 + p + ... + p^{k} at p = {p:g}: each draft kept with probability p while the ones "
            "before it were, and one more token from the verify step",
        )

    def verify_terms(self) -> list[Term]:
        """The verify step's parts and transfers, named verify_*."""
        verify = [getattr(self.verify, f.name) for f in dataclasses.fields(LayerTimes)]
        verify += [self.verify_communication.dispatch, self.verify_communication.combine]
        return [dataclasses.replace(t, name=f"verify_{t.name}") for t in verify]

    def terms(self) -> list[Term]:
        return [self.acceptance, self.drafts, self.accepted_length(), *self.verify_terms()]


def projected_verify(decode: LayerTimes, drafts: Term) -> LayerTimes:
    """A verify step's parts where the slice does not measure one: each part of the measured
    decode step times drafts + 1, the tokens a request it computes."""
    factor = drafts.value + 1
    note = (
        f"projected: the decode step's part x {factor:g} (drafts + 1 tokens a request), linear "
        "in tokens as compute-bound work grows; weight-bound GEMMs grow less"
    )
    return LayerTimes(
        **{
            f.name: derived(
                f.name,
                getattr(decode, f.name).value * factor,
                "s",
                [getattr(decode, f.name), drafts],
                note,
            )
            for f in dataclasses.fields(LayerTimes)
        }
    )


@dataclass(frozen=True)
class PhaseProjection:
    """One phase (prefill or decode) projected from one GPU's times at `point`.

    measured_step: a two-batch step of the real executor, seconds, if one was measured;
    kv_length: decode's tokens of context a request; attention: what attention_core computes
    and reads, for its achieved rates; speculation: decode with MTP."""

    point: OperatingPoint
    device: Device
    times: LayerTimes
    communication: Communication
    balancedness: Term
    measured_step: Term | None = None
    dims: V3Dims = V3
    cache_hit_share: Term = published.CACHE_HIT_SHARE
    gpus_per_node: Term = published.GPUS_PER_NODE
    kv_length: Term | None = None
    attention: AttentionWork | None = None
    speculation: Speculation | None = None

    def __post_init__(self) -> None:
        imbalance.check(self.balancedness)
        if self.speculation is not None:
            if self.point.phase != "decode":
                raise ValueError("speculation (MTP) is a decode projection's")
            if self.measured_step is not None:
                raise ValueError(
                    "a measured two-batch step has no verify step measured beside it: give "
                    "measured_step or speculation, not both"
                )
        if self.kv_length is not None:
            positive(self.kv_length)
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
        if self.kv_length is not None:
            terms.append(self.kv_length)
        return [*terms, self.gpus_per_node]

    def _note(self, text: str) -> str:
        return text if self.device.is_gpu else with_cpu_label(text)

    def _seconds(self, times: LayerTimes, communication: Communication) -> dict[str, float]:
        parts = {f.name: getattr(times, f.name).value for f in dataclasses.fields(LayerTimes)}
        parts.update(dispatch=communication.dispatch.value)
        parts.update(combine=communication.combine.value)
        for name in SCALED_BY_IMBALANCE:
            parts[name] /= self.balancedness.value
        return parts

    def _steps(
        self, name: str, seconds: dict[str, float], layers: tuple[int, int], inputs, where: str
    ) -> dict[str, Term]:
        """ "no_overlap" and "ideal_overlap" seconds of `layers` (dense, MoE) of the phase's
        schedule over these parts, and the head and sampling once."""
        phase, head = self.point.phase, seconds["head_and_sampling"]
        where += f"; routed experts and communication / balancedness {self.balancedness.value:.3g}"
        times = {
            "no_overlap": derived(
                f"{name}_no_overlap",
                schedule.sequential_seconds(phase, seconds, *layers) + head,
                "s",
                inputs,
                self._note(f"{where}; one microbatch after the other, transfers not hidden"),
            ),
            "ideal_overlap": derived(
                f"{name}_ideal_overlap",
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
        return times

    @cached_property
    def step_times(self) -> dict[str, Term]:
        """ "no_overlap", "ideal_overlap" and, if measured, "measured_overlap": seconds a step."""
        dims = self.dims
        layers = (dims.first_k_dense_replace, dims.num_moe_layers)
        times = self._steps(
            f"{self.point.phase}_step",
            self._seconds(self.times, self.communication),
            layers,
            [self.balancedness, *self._time_terms()],
            f"{layers[0]} dense + {layers[1]} MoE layers, 2 microbatches, head and sampling",
        )
        if self.measured_step is not None:
            times["measured_overlap"] = self.measured_step
        return times

    @cached_property
    def speculation_steps(self) -> dict[str, dict[str, Term]]:
        """With MTP, per step time ("no_overlap", "ideal_overlap"): "verify" (the model's step
        over drafts + 1 tokens a request), "draft" (one of the module's: an MoE layer, as the
        model's, over one token a request, and the head) and "step" (verify + drafts x draft);
        {} without."""
        mtp = self.speculation
        if mtp is None:
            return {}
        dims = self.dims
        layers = (dims.first_k_dense_replace, dims.num_moe_layers)
        verify = self._steps(
            "decode_verify_step",
            self._seconds(mtp.verify, mtp.verify_communication),
            layers,
            [self.balancedness, *mtp.verify_terms()],
            f"the verify step: {layers[0]} dense + {layers[1]} MoE layers over "
            f"{mtp.drafts.value + 1:g} tokens a request, 2 microbatches, head and sampling",
        )
        draft = self._steps(
            "decode_draft_step",
            self._seconds(self.times, self.communication),
            (0, 1),
            [self.balancedness, *self._time_terms()],
            "projected: the MTP module's step as the decode step's MoE layer (its eh_proj not "
            "counted) and head, 2 microbatches; a round's first draft reads the kept tokens, "
            "counted as one a request",
        )
        k = mtp.drafts
        return {
            variant: {
                "verify": verify[variant],
                "draft": draft[variant],
                "step": derived(
                    f"decode_mtp_step_{variant}",
                    verify[variant].value + k.value * draft[variant].value,
                    "s",
                    [verify[variant], draft[variant], k],
                    self._note(f"{verify[variant].name} + {k.value:g} x {draft[variant].name}"),
                ),
            }
            for variant in verify
        }

    @cached_property
    def throughput(self) -> dict[str, list[Term]]:
        """Per step time: tokens per second per node (prefill: computed, then incl. cache hits;
        decode: output tokens, then with MTP where it is on)."""
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
                if variant in self.speculation_steps:
                    rows[variant].append(self._with_mtp(variant))
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

    def _with_mtp(self, variant: str) -> Term:
        tokens, step = self.point.tokens_term(), self.speculation_steps[variant]["step"]
        length = self.speculation.accepted_length()
        return derived(
            f"decode_mtp_per_node_{variant}",
            self.gpus_per_node.value * tokens.value * length.value / step.value,
            "tok/s/node",
            [tokens, self.gpus_per_node, step, length],
            self._note(
                f"output tokens at {step.name}: {length.value:.3g} a request a step (its "
                "accepted drafts and one more)"
            ),
        )

    def speculation_terms(self) -> list[Term]:
        """With MTP: its inputs, the verify and draft steps, and the speed-up at the projected
        step beside the published one; [] without."""
        if self.speculation is None:
            return []
        steps = [
            steps[part] for steps in self.speculation_steps.values() for part in ("verify", "draft")
        ]
        rows = self.throughput[self.projected_variant]
        speedup = derived(
            f"decode_mtp_speedup_{self.projected_variant}",
            rows[-1].value / rows[0].value,
            "1",
            rows,
            self._note(f"{rows[-1].name} / {rows[0].name}"),
        )
        return [*self.speculation.terms(), *steps, speedup, published.MTP_DECODE_SPEEDUP]

    def attention_terms(self) -> list[Term]:
        """What attention_core computes and reads (`attention`), and at what rate; [] without."""
        work = self.attention
        if work is None:
            return []
        core, phase = positive(self.times.attention_core), self.point.phase
        note = (
            "over the measured attention_core, which also holds the values' projection and "
            "o_proj (and V3.2's indexer scores and top-k): below the attention kernel's own rate"
        )
        kinds = ((work.flops, "flop_rate", "FLOP/s"), (work.kv_bytes, "kv_byte_rate", "B/s"))
        rates = [
            derived(
                f"{phase}_attention_core_{kind}",
                term.value / core.value,
                unit,
                [term, core],
                self._note(f"{term.name} {note}"),
            )
            for term, kind, unit in kinds
        ]
        return [work.flops, work.kv_bytes, *rates]

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
