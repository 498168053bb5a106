"""The whole reproduction table: both phases, the comparisons, the margin, the hardware
differences and the memory check, as JSON (every term with value, unit, source and note) and as
text. A table resting on a CPU measurement says "CPU, not a GPU figure" on every derived and
measured row and at its head. `SideBySide`: the summaries of reproductions of several slices
(V3 beside V3.2) or kernel sets at one decode KV length in columns; `tables` groups
reproductions so."""

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
    "The ideal two-batch step is a lower bound (throughput upper bound); only a measured "
    "two-batch step is a projection.",
    "Communication labelled published-H800-IB is DeepEP's H800 + CX7 figure, not our fabric's.",
)
NO_MTP = "Multi-token prediction is off: decode counts one output token a request a step."
WITH_MTP = (
    "MTP rows rest on an acceptance rate, not on drafts of a trained module; the module's steps "
    "are projected from the decode step's MoE layer, a verify step not measured is projected "
    "from the decode step, and the memory check leaves the module's layer out."
)
SPARSE_PRICES = (
    "V3.2 is priced as V3 is: day 6's volumes at R1's list prices and DeepSeek's $2 an H800-hour."
)


@dataclass(frozen=True)
class Reproduction:
    """Both phases' projections priced at `gpu_hour_usd`. decode_weights_per_gpu (bytes, from
    `ModelArgs.weight_bytes_per_gpu` of the layout) enables the memory check, with the KV cache
    of the decode layout's requests at the decode projection's KV length (day 6's mean without
    one). kernels: what the slices' model ran (`ref_server.kernel_choice`); model: the slice's
    name (`ref_server.repro.slices.SLICES`)."""

    prefill: PhaseProjection
    decode: PhaseProjection
    gpu_hour_usd: Term = published.GPU_HOUR_USD
    decode_weights_per_gpu: Term | None = None
    kv_cache_fp8: bool = True
    hbm_capacity: Term = published.H200_HBM_CAPACITY
    kernels: str = "ours"
    model: str = "v3"

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            if getattr(self, name).point.phase != name:
                raise ValueError(f"{name} must be a {name} projection")

    @property
    def kv_length(self) -> Term:
        return self.decode.kv_length or published.DAY6_MEAN_KV_LENGTH

    @property
    def description(self) -> str:
        """What was run: the slice, decode's KV length, the kernels, MTP."""
        kernels = "" if self.kernels == "ours" else f", kernels {self.kernels}"
        return (
            f"the {self.model} slice, decode at KV {self.kv_length.value:,.0f}{kernels}"
            f"{self.mtp_description}"
        )

    @property
    def mtp_description(self) -> str:
        mtp = self.decode.speculation
        if mtp is None:
            return ""
        return f", MTP at acceptance {mtp.acceptance.value:g}, {mtp.drafts.value:g} draft(s)"

    def caveats(self) -> list[str]:
        lines = [*CAVEATS, WITH_MTP if self.decode.speculation else NO_MTP]
        if self.decode.dims.index_topk is not None:
            lines.append(SPARSE_PRICES)
        fit = {term.name: term.value for term in self.memory()}
        if fit.get("hbm_left", 0) < 0:
            lines.append(
                f"At KV {self.kv_length.value:,.0f} the decode layout's "
                f"{self.decode.point.tokens_per_gpu} requests a GPU do not fit in "
                f"{self.hbm_capacity.value / 1e9:.0f} GB ({fit['decode_requests_that_fit']:.0f} "
                "would): its decode figures are for a batch one GPU cannot hold."
            )
        return lines

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
        point, dims, kv_length = self.decode.point, self.decode.dims, self.kv_length
        requests = point.tokens_term()
        kv = derived(
            "decode_kv_cache_per_gpu",
            kv_cache_bytes(dims, point.tokens_per_gpu, kv_length.value, self.kv_cache_fp8),
            "B",
            [requests, kv_length],
            f"{'FP8' if self.kv_cache_fp8 else 'BF16'} latent cache of "
            f"{dims.num_hidden_layers} layers"
            + (", each with the indexer's FP8 keys" if dims.index_topk is not None else ""),
        )
        weights = self.decode_weights_per_gpu
        fit = memory_check(weights, kv, self.hbm_capacity, requests)
        return [weights, kv, self.hbm_capacity, *fit]

    def _phase_json(self, projection: PhaseProjection) -> dict[str, object]:
        def rows(terms: list[Term]) -> list[dict[str, object]]:
            return [_row(term, projection.device.label) for term in terms]

        layout = per_rank_work(projection.dims, projection.point).terms(projection.point)
        mtp_steps = [steps["step"] for steps in projection.speculation_steps.values()]
        return {
            "device": {"kind": projection.device.kind, "name": projection.device.name},
            "figure": projection.device.label,
            "per_rank_work": rows(layout),
            "inputs": rows(projection.inputs()),
            "attention": rows(projection.attention_terms()),
            "speculation": rows(projection.speculation_terms()),
            "step_times": rows([*projection.step_times.values(), *mtp_steps]),
            "throughput": rows([t for ts in projection.throughput.values() for t in ts]),
            "projected_from": projection.projected_variant,
        }

    def to_json(self) -> dict[str, object]:
        return {
            "figure": self.label,
            "model": self.model,
            "kernels": self.kernels,
            "description": self.description,
            "prefill": self._phase_json(self.prefill),
            "decode": self._phase_json(self.decode),
            "comparisons": [row.to_json() | {"figure": self.label} for row in self.comparisons()],
            "economics": [_row(term, self.label) for term in self.economics()],
            "hardware": [term.to_json() for term in self.hardware()],
            "memory": [_row(term, self.decode.device.label) for term in self.memory()],
            "caveats": self.caveats(),
        }

    def to_text(self, every_term: bool = False) -> str:
        """The summary: what was run, each phase's step times and throughput, the economics and
        the comparisons, then the caveats; `every_term` adds the inputs, the per-rank work, the
        attention's work and rates, MTP's terms, the hardware and the memory check, each term
        with its source and note. Lines fit 100 columns."""
        data = self.to_json()
        parts = ("per_rank_work", "inputs", "attention", "speculation", "step_times", "throughput")
        if not every_term:
            parts = parts[-2:]
        sections = [(f"{phase} {part}", data[phase][part]) for phase in ("prefill", "decode")
                    for part in parts]  # fmt: skip
        sections.append(("economics", data["economics"]))
        if every_term:
            sections += [(name, data[name]) for name in ("hardware", "memory")]
        lines = [f"day-6 reproduction: {self.label}", self.description]
        for title, rows in sections:
            if rows:
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
        for caveat in data["caveats"]:
            lines += textwrap.wrap(caveat, WIDTH, initial_indent="- ", subsequent_indent="  ")
        if not every_term:
            lines.append("\nEvery term with its source and note: --terms; as JSON: --json.")
        return "\n".join(lines)


WIDTH = 100


# What may differ between a SideBySide's runs, and the Reproduction field that says it.
VARYING = (("slices", "model"), ("kernels", "kernels"))


@dataclass(frozen=True)
class SideBySide:
    """Reproductions at one decode KV length of different slices (V3 beside V3.2) or kernel
    sets, the first the base: each summary term (each phase's attention work, step times and
    throughput, the economics) and each ratio to a published figure in a column per run, named
    by what differs (its slice, its kernels, or both), then each other run's value over the
    base's."""

    runs: tuple[Reproduction, ...]

    def __post_init__(self) -> None:
        if len(self.runs) < 2:
            raise ValueError("side by side takes two or more reproductions")
        if len({run.kv_length.value for run in self.runs}) > 1:
            raise ValueError("side by side takes reproductions at one decode KV length")
        if len(set(self.columns)) < len(self.runs):
            raise ValueError("side by side takes reproductions of different slices or kernels")

    @property
    def differing(self) -> list[str]:
        """What differs between the runs: "slices", "kernels" or both."""
        fields = [(what, {getattr(run, field) for run in self.runs}) for what, field in VARYING]
        return [what for what, values in fields if len(values) > 1]

    @property
    def columns(self) -> list[str]:
        """Each run's name: its slice, its kernels, or both, as they differ."""
        fields = [field for what, field in VARYING if what in self.differing]
        return [" ".join(getattr(run, field) for field in fields) for run in self.runs]

    @property
    def kernels(self) -> list[str]:
        return [run.kernels for run in self.runs]

    def rows(self) -> list[dict[str, object]]:
        """In the summary's order: {section, name, unit, values: each run's by column,
        over_base: each other run's value over the base's (None where the base's is 0)}."""
        documents = [run.to_json() for run in self.runs]
        paths = [(phase, part) for phase in ("prefill", "decode")
                 for part in ("attention", "step_times", "throughput")]  # fmt: skip
        rows = []
        for path in [*paths, ("economics",)]:
            title = " ".join(path)
            parts = [_at(document, path) for document in documents]
            if len({tuple(term["name"] for term in part) for part in parts}) > 1:
                raise ValueError(f"the runs' {title} terms differ: set MTP alike for all")
            for i, term in enumerate(parts[0]):
                values = [part[i]["value"] for part in parts]
                rows.append(self._row(title, term["name"], term["unit"], values))
        for i, row in enumerate(documents[0]["comparisons"]):
            values = [d["comparisons"][i]["ratio"] for d in documents]
            name = f"{row['ours']} / {row['reference']['name']}"
            rows.append(self._row("ours / published", name, "1", values))
        return rows

    def _row(self, section: str, name: str, unit: str, values: list[float]) -> dict:
        base, others = values[0], zip(self.columns[1:], values[1:], strict=True)
        return {
            "section": section,
            "name": name,
            "unit": unit,
            "values": dict(zip(self.columns, values, strict=True)),
            "over_base": {column: value / base if base else None for column, value in others},
        }

    def to_json(self) -> dict[str, object]:
        return {
            "figure": self.runs[0].label,
            "columns": self.columns,
            "kernels": self.kernels,
            "side_by_side": self.rows(),
            "caveats": self.caveats(),
            "runs": dict(zip(self.columns, (run.to_json() for run in self.runs), strict=True)),
        }

    def to_text(self, every_term: bool = False) -> str:
        """The summary in a column per run and one per other run over the base (a term whose
        name is too long for its column wraps above its values); every_term: then each run's
        whole table (`Reproduction.to_text`)."""
        base = self.columns[0]
        heads = self.columns + [f"{column} / {base}" for column in self.columns[1:]]
        cell = max(CELL, *(len(head) + 2 for head in heads))
        labels = "; ".join(sorted({run.label for run in self.runs}))
        first = self.runs[0]
        lines = [
            f"day-6 reproduction, {' and '.join(self.differing)} side by side: {labels}",
            f"decode at KV {first.kv_length.value:,.0f}{first.mtp_description}",
        ]
        section = None
        for row in self.rows():
            if row["section"] != section:
                section = row["section"]
                lines.append("\n" + f"{section:<{NAME}}" + "".join(f"{h:>{cell}}" for h in heads))
            name = f"  {row['name']} ({row['unit']})"
            if len(name) > NAME:
                lines.append(name)
                name = ""
            values = [f"{value:>{cell},.6g}" for value in row["values"].values()]
            ratios = [f"{r:>{cell}.3f}" if r is not None else f"{'-':>{cell}}"
                      for r in row["over_base"].values()]  # fmt: skip
            lines.append(f"{name:<{NAME}}" + "".join(values + ratios))
        lines.append("")
        for caveat in self.caveats():
            lines += textwrap.wrap(caveat, WIDTH, initial_indent="- ", subsequent_indent="  ")
        lines.append("\nEach run's whole table: --terms; as JSON: --json.")
        if every_term:
            lines += [
                f"\n{column}\n" + run.to_text(every_term=True)
                for column, run in zip(self.columns, self.runs, strict=True)
            ]
        return "\n".join(lines)

    def caveats(self) -> list[str]:
        """Each run's caveats once, those of some runs only named by their columns."""
        each = [run.caveats() for run in self.runs]
        lines = []
        for caveat in dict.fromkeys(c for caveats in each for c in caveats):
            having = [col for col, cs in zip(self.columns, each, strict=True) if caveat in cs]
            lines.append(caveat if len(having) == len(each) else f"{', '.join(having)}: {caveat}")
        return lines


def tables(runs: list[Reproduction]) -> list[Reproduction | SideBySide]:
    """The runs at each decode KV length, in the order first run: one alone, several side by
    side."""
    by_length: dict[float, list[Reproduction]] = {}
    for run in runs:
        by_length.setdefault(run.kv_length.value, []).append(run)
    return [
        group[0] if len(group) == 1 else SideBySide(tuple(group)) for group in by_length.values()
    ]


NAME, CELL = 52, 16  # columns of SideBySide's text: a term's name, a value


def _at(document: dict, path: tuple[str, ...]) -> list[dict]:
    for key in path:
        document = document[key]
    return document


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
