"""The `kernels` option: whose kernels run each part of the model, chosen when it is built.

    ours                      ref-server's own kernels, mla_kernels and ep_comm (the default)
    deepseek                  DeepSeek's libraries for every part the model has
    deepseek:attention,gemm   DeepSeek's for the parts named, ours for the others

The parts: `attention` (paged decode attention: FlashMLA), `gemm` (the FP8 GEMMs of the
projections and the routed experts: DeepGEMM) and `exchange` (the expert-parallel dispatch and
combine: DeepEP). A model has the gemm part only with FP8 weights and the exchange only when
its experts are split over several ranks; "deepseek" asks for the parts the model has, a
named part the model lacks is an error.

Torch-free, so that the command line checks a value before loading anything;
`ref_server.model.kernel_set` turns a choice into the implementations.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

OURS = "ours"
DEEPSEEK = "deepseek"


@dataclass(frozen=True)
class Library:
    """One of DeepSeek's libraries: its module, its name, what it runs here and where to get
    it (none of them has a PyPI wheel)."""

    module: str
    name: str
    runs: str
    source: str


LIBRARIES = {
    "attention": Library(
        "flash_mla", "FlashMLA", "decode attention", "https://github.com/deepseek-ai/FlashMLA"
    ),
    "gemm": Library(
        "deep_gemm", "DeepGEMM", "FP8 GEMMs", "https://github.com/deepseek-ai/DeepGEMM"
    ),
    "exchange": Library(
        "deep_ep", "DeepEP", "expert exchange", "https://github.com/deepseek-ai/DeepEP"
    ),
}
PARTS = tuple(LIBRARIES)
FORMS = f"{OURS}, {DEEPSEEK} or {DEEPSEEK}:PART[,PART...] with parts {', '.join(PARTS)}"


class KernelsUnavailable(RuntimeError):
    """A DeepSeek library the chosen kernels need does not import."""


@dataclass(frozen=True)
class KernelChoice:
    """A parsed `kernels` value: the parts asked of DeepSeek's libraries; named, whether the
    value names them (else "deepseek": every part the model has, or "ours": none)."""

    spec: str
    parts: tuple[str, ...]
    named: bool

    def parts_in(self, *, fp8: bool, expert_parallel: bool) -> tuple[str, ...]:
        """The parts DeepSeek's libraries run in a model with FP8 weights (fp8) or not, its
        experts over several ranks (expert_parallel) or not. ValueError for a named part the
        model does not have."""
        lacks = {
            "gemm": None if fp8 else "its weights are not FP8 (weight_dtype 'fp8')",
            "exchange": None if expert_parallel else "its experts are on one rank",
        }
        if self.named:
            problems = [f"{part}: {lacks[part]}" for part in self.parts if lacks.get(part)]
            if problems:
                raise ValueError(
                    f"kernels {self.spec!r} names parts this model does not have: "
                    + "; ".join(problems)
                )
        return tuple(part for part in self.parts if not lacks.get(part))


def parse(spec: str) -> KernelChoice:
    """One `kernels` value (see the module docstring); ValueError naming what is wrong."""
    if not isinstance(spec, str):
        raise ValueError(f"kernels must be a string ({FORMS}), got {spec!r}")
    if spec == OURS:
        return KernelChoice(spec, (), False)
    if spec == DEEPSEEK:
        return KernelChoice(spec, PARTS, False)
    name, colon, listed = spec.partition(":")
    if name != DEEPSEEK or not colon:
        raise ValueError(f"unknown kernels {spec!r}: expected {FORMS}")
    parts = listed.split(",")
    unknown = [part for part in parts if part not in PARTS]
    if unknown:
        raise ValueError(f"kernels {spec!r}: unknown parts {unknown}; the parts are {PARTS}")
    if len(set(parts)) < len(parts):
        raise ValueError(f"kernels {spec!r} names a part twice")
    return KernelChoice(spec, tuple(part for part in PARTS if part in parts), True)


def parse_list(text: str) -> list[KernelChoice]:
    """Several values separated by commas, for side-by-side runs ("ours,deepseek"); a part
    name after a comma continues the value before ("ours,deepseek:attention,gemm" is two)."""
    specs: list[str] = []
    for word in text.split(","):
        if word in PARTS and specs and specs[-1].startswith(DEEPSEEK + ":"):
            specs[-1] += "," + word
        else:
            specs.append(word)
    choices = [parse(spec) for spec in specs]
    if len({c.spec for c in choices}) < len(choices):
        raise ValueError(f"kernels {text!r} names a set twice")
    return choices


def unavailable(parts: tuple[str, ...], spec: str, problems: dict[str, str]) -> str:
    """One line: which libraries of `parts` do not import (problems: part to why), how to get
    each, and how to run without them."""
    missing = [
        f"{LIBRARIES[part].module} ({LIBRARIES[part].name}, {LIBRARIES[part].runs}) does not "
        f"import ({problems[part]}): build it from {LIBRARIES[part].source}"
        for part in parts
        if part in problems
    ]
    present = [part for part in parts if part not in problems]
    instead = f"{DEEPSEEK}:{','.join(present)}" if present else OURS
    return f"kernels {spec!r}: " + "; ".join(missing) + f"; or choose kernels {instead!r}"


def check_findable(parts: tuple[str, ...], spec: str) -> None:
    """KernelsUnavailable unless every part's module is installed (found, not imported: a
    check that costs nothing before starting processes that would import them)."""
    problems = {
        part: f"no module named {LIBRARIES[part].module!r}"
        for part in parts
        if importlib.util.find_spec(LIBRARIES[part].module) is None
    }
    if problems:
        raise KernelsUnavailable(unavailable(parts, spec, problems))
