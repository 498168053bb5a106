"""The day-6 projection: from one GPU's measured per-layer times to tokens per second per node,
set beside DeepSeek's and SGLang's figures and priced with DeepSeek's cost model.

Pure arithmetic (no torch); the measurement that feeds it is `ref_server.repro.slices` (torch,
not imported here) and `ref-server repro` runs both (`ref_server.repro.run`). Every number is a
`Term` labelled measured, published, assumed or derived. See docs/reproduction.md.

    point = shapes.PREFILL_EP32
    phase = PhaseProjection(point, Device("cuda", "NVIDIA H200"), times, communication,
                            imbalance.PERFECT, measured_step=step)
    Reproduction(phase, decode_phase).to_json()

A decode phase may carry its KV length, its attention's work (`AttentionWork`) and MTP
(`Speculation`); `SideBySide` sets reproductions of several slices or kernel sets in columns.
"""

from ref_server.repro import communication, imbalance, published, schedule, shapes
from ref_server.repro.comparison import Comparison, comparisons, margin
from ref_server.repro.projection import (
    AttentionWork,
    Communication,
    LayerTimes,
    PhaseProjection,
    Speculation,
    implied_step_time,
    projected_verify,
)
from ref_server.repro.report import CAVEATS, Reproduction, SideBySide, tables
from ref_server.repro.shapes import (
    DECODE_EP144,
    PREFILL_EP32,
    OperatingPoint,
    RankWork,
    V3Dims,
    per_rank_work,
)
from ref_server.repro.terms import CPU_LABEL, Device, NotAGPUFigure, Term, derived

__all__ = [
    "CAVEATS",
    "CPU_LABEL",
    "DECODE_EP144",
    "PREFILL_EP32",
    "AttentionWork",
    "Communication",
    "Comparison",
    "Device",
    "LayerTimes",
    "NotAGPUFigure",
    "OperatingPoint",
    "PhaseProjection",
    "RankWork",
    "Reproduction",
    "SideBySide",
    "Speculation",
    "Term",
    "V3Dims",
    "communication",
    "comparisons",
    "derived",
    "imbalance",
    "implied_step_time",
    "margin",
    "per_rank_work",
    "projected_verify",
    "published",
    "schedule",
    "shapes",
    "tables",
]
