"""Two-microbatch overlap of computation and communication for Mixture-of-Experts layers.

    ops = [embed, attention, Yield(), dispatch, Yield(), experts, combine, Yield(), output]
    a, b = (State(hidden=x[r]) for r in split_rows)      # two halves of a batch
    run_overlapped(ops, [a, b], delta_stages=0)          # or run(ops, State(...)) for one

See docs/overlap-sched.md.
"""

from overlap_sched.executor import OpFailed, run, run_overlapped
from overlap_sched.gating import Thresholds, agree, wants_overlap
from overlap_sched.operations import Op, OpListError, OverlapError, Yield, stages
from overlap_sched.recorder import Recorder, summarize
from overlap_sched.split import Split, split_decode, split_prefill
from overlap_sched.state import State, StateError

__version__ = "0.1.0"

__all__ = [
    "Op",
    "OpFailed",
    "OpListError",
    "OverlapError",
    "Recorder",
    "Split",
    "State",
    "StateError",
    "Thresholds",
    "Yield",
    "agree",
    "run",
    "run_overlapped",
    "split_decode",
    "split_prefill",
    "stages",
    "summarize",
    "wants_overlap",
]
