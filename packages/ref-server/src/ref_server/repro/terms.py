"""Labelled numbers: every figure the projection uses or produces says where it came from.

A `Term` is a value with its unit, its source and a note naming the document or run it came
from. Inputs are "measured" (by this project, on the device the projection names),
"published" (a figure from DeepSeek, DeepEP, SGLang, ...; the note cites it) or "assumed" (a
choice the projection makes; the note says why). Outputs are "derived", and their `basis`
lists the sources of every input they were computed from, so a throughput that rests on one
assumed term says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

INPUT_SOURCES = ("measured", "published", "assumed")
SOURCES = (*INPUT_SOURCES, "derived")
CPU_LABEL = "CPU, not a GPU figure"


class NotAGPUFigure(ValueError):
    """A figure measured on a CPU was asked for as a GPU figure."""


@dataclass(frozen=True)
class Term:
    """A number and its provenance. basis: for a derived term, the sources it rests on."""

    name: str
    value: float
    unit: str
    source: str
    note: str
    basis: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"term {self.name!r}: source {self.source!r} not one of {SOURCES}")
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)):
            raise ValueError(f"term {self.name!r}: value must be a number, got {self.value!r}")
        if not math.isfinite(self.value):
            raise ValueError(f"term {self.name!r}: value must be finite, got {self.value}")
        if not self.note:
            raise ValueError(f"term {self.name!r}: a note saying where it comes from is required")
        if (self.source == "derived") != bool(self.basis):
            raise ValueError(f"term {self.name!r}: a basis is given exactly for derived terms")
        if not set(self.basis) <= set(INPUT_SOURCES):
            raise ValueError(f"term {self.name!r}: basis {self.basis} not within {INPUT_SOURCES}")

    def to_json(self) -> dict[str, object]:
        row: dict[str, object] = {
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "source": self.source,
            "note": self.note,
        }
        if self.basis:
            row["basis"] = list(self.basis)
        return row


def derived(name: str, value: float, unit: str, inputs: Iterable[Term], note: str) -> Term:
    """A term computed from `inputs`: its basis is the union of theirs, and what rests on a CPU
    figure is labelled one."""
    inputs = list(inputs)
    basis = {source for term in inputs for source in term.basis or (term.source,)}
    if any(CPU_LABEL in term.note for term in inputs):
        note = with_cpu_label(note)
    return Term(name, value, unit, "derived", note, tuple(s for s in INPUT_SOURCES if s in basis))


def with_cpu_label(note: str) -> str:
    return note if CPU_LABEL in note else f"{note}; {CPU_LABEL}"


def non_negative(term: Term) -> Term:
    if term.value < 0:
        raise ValueError(f"{term.name} must not be negative, got {term.value:g} {term.unit}")
    return term


def positive(term: Term) -> Term:
    if term.value <= 0:
        raise ValueError(f"{term.name} must be greater than zero, got {term.value:g} {term.unit}")
    return term


@dataclass(frozen=True)
class Device:
    """Where the measured terms were measured. kind: "cuda" or "cpu"; name: e.g.
    "NVIDIA H200" (torch.cuda.get_device_name) or "cpu"."""

    kind: str
    name: str

    def __post_init__(self) -> None:
        if self.kind not in ("cuda", "cpu"):
            raise ValueError(f"device kind must be 'cuda' or 'cpu', got {self.kind!r}")
        if not self.name:
            raise ValueError("device name must not be empty")

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"

    @property
    def label(self) -> str:
        """What every printed or serialized figure measured here is called."""
        return f"GPU figure, measured on {self.name}" if self.is_gpu else CPU_LABEL

    def require_gpu(self, what: str) -> None:
        if not self.is_gpu:
            raise NotAGPUFigure(f"{what} was measured on {self.name!r}: {CPU_LABEL}")
