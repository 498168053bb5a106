"""The whole reproduction table: both phases, the comparisons, the margin, the hardware
differences and the memory check, as JSON (every term with value, unit, source and note) and as
text. A table resting on a CPU measurement says "CPU, not a GPU figure" on every derived and
measured row and at its head. `SideBySide`: the summaries of reproductions through several
kernel sets in columns."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from ref_server.repro import comparison, published
from ref_server.repro.projection import PhaseProjection
from ref_server.repro.shapes import kv_cache_bytes, memory_check, per_rank_work
from ref_server.repro.terms import CPU_LABEL, Term, derived

CAVEATS = (
    "Day 6's 73.7k / 14.8k tok/s per node are 24-hour averages over varying load; our figures "
    "are saturation figures at a fixed batch, comparable with profile-data's and SGLang's.",
    "profile-data simulated perfectly balanced routing: compare with it at balancedness 1 only.",
    "Prefill counts computed tokens; 'incl. cache hits' divides by 1 - 0.563 as day 6 does.",
    "Multi-token prediction is not modelled: decode counts one output token a request a step.",
    "The ideal two-batch step is a lower bound (throughput upper bound); only a measured "
    "two-batch step is a projection.",
    "Communication labelled published-H800-IB is DeepEP's H800 + CX7 figure, not our fabric's.",
)


@dataclass(frozen=True)
class Reproduction:
    """Both phases' projections priced at `gpu_hour_usd`. decode_weights_per_gpu (bytes, from
    `ModelArgs.weight_bytes_per_gpu` of the layout) enables the memory check, with the KV cache
    of the decode layout's requests at day 6's mean KV length. kernels: what the slices' model
    ran (`ref_server.kernel_choice`)."""

    prefill: PhaseProjection
    decode: PhaseProjection
    gpu_hour_usd: Term = published.GPU_HOUR_USD
    decode_weights_per_gpu: Term | None = None
    kv_cache_fp8: bool = True
    hbm_capacity: Term = published.H200_HBM_CAPACITY
    kernels: str = "ours"

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            if getattr(self, name).point.phase != name:
                raise ValueError(f"{name} must be a {name} projection")

    @property
    def label(self) -> str:
        devices = {self.prefill.device, self.decode.device}
        if not all(device.is_gpu for device in devices):
            return CPU_LABEL
        return "; ".join(sorted(device.label for device in devices))

    def comparisons(self) -> list[comparison.Comparison]:
        return comparison.comparisons(self.prefill) + comparison.comparisons(self.decode)

    def economics(self) -> list[Term]:
        return comparison.margin(
            self.prefill.projected(), self.decode.projected(), self.gpu_hour_usd
        )

    def hardware(self) -> list[Term]:
        """H800 (DeepSeek's) against H200 (ours), as docs/reproduction.md compares them."""
        ratio = derived(
            "hbm_bandwidth_h200_over_h800",
            published.H200_HBM_BANDWIDTH.value / published.H800_HBM_BANDWIDTH.value,
            "1",
            [published.H200_HBM_BANDWIDTH, published.H800_HBM_BANDWIDTH],
            "memory-bound decode attention should run about this much faster on H200; SM count "
            "and tensor throughput are the same; our box has no InfiniBand for EP across nodes",
        )
        return [
            published.H800_HBM_BANDWIDTH,
            published.H200_HBM_BANDWIDTH,
            ratio,
            published.H800_HBM_CAPACITY,
            published.H200_HBM_CAPACITY,
            published.DENSE_BF16_TENSOR,
            published.H800_NVLINK,
        ]

    def memory(self) -> list[Term]:
        if self.decode_weights_per_gpu is None:
            return []
        point, dims = self.decode.point, self.decode.dims
        kv_length = published.DAY6_MEAN_KV_LENGTH
        kv = derived(
            "decode_kv_cache_per_gpu",
            kv_cache_bytes(dims, point.tokens_per_gpu, kv_length.value, self.kv_cache_fp8),
            "B",
            [point.tokens_term(), kv_length],
            f"{'FP8' if self.kv_cache_fp8 else 'BF16'} latent cache of "
            f"{dims.num_hidden_layers} layers",
        )
        weights = self.decode_weights_per_gpu
        return [weights, kv, self.hbm_capacity, memory_check(weights, kv, self.hbm_capacity)]

    def _phase_json(self, projection: PhaseProjection) -> dict[str, object]:
        def rows(terms: list[Term]) -> list[dict[str, object]]:
            return [_row(term, projection.device.label) for term in terms]

        layout = per_rank_work(projection.dims, projection.point).terms(projection.point)
        return {
            "device": {"kind": projection.device.kind, "name": projection.device.name},
            "figure": projection.device.label,
            "per_rank_work": rows(layout),
            "inputs": rows(projection.inputs()),
            "step_times": rows(list(projection.step_times.values())),
            "throughput": rows([t for ts in projection.throughput.values() for t in ts]),
            "projected_from": projection.projected_variant,
        }

    def to_json(self) -> dict[str, object]:
        return {
            "figure": self.label,
            "kernels": self.kernels,
            "prefill": self._phase_json(self.prefill),
            "decode": self._phase_json(self.decode),
            "comparisons": [row.to_json() | {"figure": self.label} for row in self.comparisons()],
            "economics": [_row(term, self.label) for term in self.economics()],
            "hardware": [term.to_json() for term in self.hardware()],
            "memory": [_row(term, self.decode.device.label) for term in self.memory()],
            "caveats": list(CAVEATS),
        }

    def to_text(self, every_term: bool = False) -> str:
        """The summary: each phase's step times and throughput, the economics and the
        comparisons, then the caveats; `every_term` adds the inputs, the per-rank work, the
        hardware and the memory check, each term with its source and note. Lines fit 100
        columns."""
        data = self.to_json()
        parts = ("per_rank_work", "inputs", "step_times", "throughput")
        if not every_term:
            parts = parts[2:]
        sections = [(f"{phase} {part}", data[phase][part]) for phase in ("prefill", "decode")
                    for part in parts]  # fmt: skip
        sections.append(("economics", data["economics"]))
        if every_term:
            sections += [(name, data[name]) for name in ("hardware", "memory")]
        kernels = "" if self.kernels == "ours" else f", kernels {self.kernels}"
        lines = [f"day-6 reproduction: {self.label}{kernels}"]
        for title, rows in sections:
            lines.append(f"\n{title}")
            for row in rows:
                lines += _lines(row, every_term)
        lines.append("\nours / published")
        for row in data["comparisons"]:
            ref = row["reference"]
            line = f"{row['ratio']:5.2f}  {row['ours']} / {ref['name']} ({ref['value']:,.0f}, "
            lines += textwrap.wrap(
                line + f"{row['kind']})", WIDTH, initial_indent="  ", subsequent_indent=" " * 9
            )
            if every_term:
                lines += _wrapped(row["caveat"])
        lines.append("")
        for caveat in CAVEATS:
            lines += textwrap.wrap(caveat, WIDTH, initial_indent="- ", subsequent_indent="  ")
        if not every_term:
            lines.append("\nEvery term with its source and note: --terms; as JSON: --json.")
        return "\n".join(lines)


WIDTH = 100


@dataclass(frozen=True)
class SideBySide:
    """Reproductions of one layout through different kernel sets, the first the base: each
    summary term (step times, throughput, economics) and each ratio to a published figure in a
    column per set, then each other set's value over the base's."""

    runs: tuple[Reproduction, ...]

    def __post_init__(self) -> None:
        if len(self.runs) < 2 or len({run.kernels for run in self.runs}) < len(self.runs):
            raise ValueError("side by side takes reproductions through two or more kernel sets")

    @property
    def kernels(self) -> list[str]:
        return [run.kernels for run in self.runs]

    def rows(self) -> list[dict[str, object]]:
        """In the summary's order: {section, name, unit, values: each set's, over_base: each
        other set's value over the base's (None where the base's is 0)}."""
        documents = [run.to_json() for run in self.runs]
        sections = [(f"{phase} {part}", (phase, part)) for phase in ("prefill", "decode")
                    for part in ("step_times", "throughput")]  # fmt: skip
        rows = []
        for title, (phase, part) in sections:
            for i, term in enumerate(documents[0][phase][part]):
                values = [d[phase][part][i]["value"] for d in documents]
                rows.append(self._row(title, term["name"], term["unit"], values))
        for i, term in enumerate(documents[0]["economics"]):
            values = [d["economics"][i]["value"] for d in documents]
            rows.append(self._row("economics", term["name"], term["unit"], values))
        for i, row in enumerate(documents[0]["comparisons"]):
            values = [d["comparisons"][i]["ratio"] for d in documents]
            name = f"{row['ours']} / {row['reference']['name']}"
            rows.append(self._row("ours / published", name, "1", values))
        return rows

    def _row(self, section: str, name: str, unit: str, values: list[float]) -> dict:
        base, others = values[0], zip(self.kernels[1:], values[1:], strict=True)
        return {
            "section": section,
            "name": name,
            "unit": unit,
            "values": dict(zip(self.kernels, values, strict=True)),
            "over_base": {kernels: value / base if base else None for kernels, value in others},
        }

    def to_json(self) -> dict[str, object]:
        return {
            "figure": self.runs[0].label,
            "kernels": self.kernels,
            "side_by_side": self.rows(),
            "runs": {run.kernels: run.to_json() for run in self.runs},
        }

    def to_text(self, every_term: bool = False) -> str:
        """The summary in a column per kernel set and one per other set over the base (a term
        whose name is too long for its column wraps above its values); every_term: then each
        run's whole table (`Reproduction.to_text`)."""
        base = self.kernels[0]
        heads = self.kernels + [f"{kernels} / {base}" for kernels in self.kernels[1:]]
        labels = {run.label for run in self.runs}
        lines = [f"day-6 reproduction, kernels side by side: {'; '.join(sorted(labels))}"]
        section = None
        for row in self.rows():
            if row["section"] != section:
                section = row["section"]
                lines.append("\n" + f"{section:<{NAME}}" + "".join(f"{h:>{CELL}}" for h in heads))
            name = f"  {row['name']} ({row['unit']})"
            if len(name) > NAME:
                lines.append(name)
                name = ""
            values = [f"{value:>{CELL},.6g}" for value in row["values"].values()]
            ratios = [f"{r:>{CELL}.3f}" if r is not None else f"{'-':>{CELL}}"
                      for r in row["over_base"].values()]  # fmt: skip
            lines.append(f"{name:<{NAME}}" + "".join(values + ratios))
        lines.append("\nEach set's whole table: --terms; as JSON: --json.")
        if every_term:
            lines += [
                f"\nkernels {run.kernels}\n" + run.to_text(every_term=True) for run in self.runs
            ]
        return "\n".join(lines)


NAME, CELL = 52, 16  # columns of SideBySide's text: a term's name, a value


def _wrapped(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent="      ", subsequent_indent="      ")


def _row(term: Term, label: str) -> dict[str, object]:
    row = term.to_json()
    if "measured" in (term.basis or (term.source,)):
        row["figure"] = label
    return row


def _lines(row: dict[str, object], with_note: bool) -> list[str]:
    """A term's name, value and unit, labelled when it rests on a CPU measurement; with_note:
    then where it comes from."""
    label = f"  [{CPU_LABEL}]" if row.get("figure") == CPU_LABEL else ""
    lines = [f"  {row['name']:<48} {row['value']:>12,.6g} {row['unit']}{label}"]
    if with_note:
        basis = f"derived from {'+'.join(row['basis'])}" if "basis" in row else row["source"]
        lines += _wrapped(f"{basis}: {row['note']}")
    return lines
