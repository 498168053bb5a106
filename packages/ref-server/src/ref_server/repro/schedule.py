"""Step times of a layer stack from per-part times: one microbatch after the other, or two
overlapped as the two-batch executor runs them (`overlap_sched.run_overlapped`).

A step is the model's op list written in the projection's terms: "dense_layer" for each dense
layer, then each MoE layer's parts in the order of SGLang's DeepSeek schedules (the model's
`ref_server.model.transformer.SCHEDULES`; `OPS_OF_ITEM` names the ops behind each item and the
tests hold the two to each other). "|" is a `Yield`; "dispatch>" starts a transfer and
">dispatch" waits for it, where the model's `dispatch_a` and `dispatch_b` do.
"""

from __future__ import annotations

from collections.abc import Mapping

SCHEDULES = {
    "prefill": "attention_prepare attention_core gate dispatch> | >dispatch routed_experts "
    "combine> | shared_expert >combine moe_output",
    "decode": "attention_prepare | attention_core gate | dispatch> shared_expert | >dispatch "
    "routed_experts combine> | >combine | moe_output",
}
DELTA_STAGES = {"prefill": 0, "decode": 2}
COMMUNICATION = ("dispatch", "combine")
COMPUTE = (
    "attention_prepare",
    "attention_core",
    "gate",
    "routed_experts",
    "shared_expert",
    "moe_output",
    "dense_layer",
)
OPS_OF_ITEM = {
    "attention_prepare": ("comm_prepare_attn", "attn.prepare"),
    "attention_core": ("attn.core",),
    "gate": ("comm_prepare_mlp", "gate", "select_experts"),
    "dispatch>": ("dispatch_a",),
    ">dispatch": ("dispatch_b",),
    "routed_experts": ("experts",),
    "combine>": ("combine_a",),
    "shared_expert": ("shared_experts",),
    ">combine": ("combine_b",),
    "moe_output": ("output", "postprocess"),
    "|": ("|",),
}


def stages(schedule: str, dense_layers: int, moe_layers: int) -> list[list[str]]:
    """One microbatch's items cut at the Yields (layers follow each other inside a stage)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {list(SCHEDULES)}")
    if dense_layers < 0 or moe_layers < 1:
        raise ValueError(
            f"need dense_layers >= 0 and moe_layers >= 1, got {dense_layers} and {moe_layers}"
        )
    items = ["dense_layer"] * dense_layers + SCHEDULES[schedule].split() * moe_layers
    cut: list[list[str]] = [[]]
    for item in items:
        if item == "|":
            cut.append([])
        else:
            cut[-1].append(item)
    return cut


def _check(seconds: Mapping[str, float]) -> None:
    for name in (*COMPUTE, *COMMUNICATION):
        if name not in seconds:
            raise ValueError(f"no time given for {name!r}")
        if not seconds[name] >= 0:
            raise ValueError(f"{name} must not be negative, got {seconds[name]}")


def sequential_seconds(
    schedule: str, seconds: Mapping[str, float], dense_layers: int, moe_layers: int
) -> float:
    """Two microbatches one after the other, each transfer waited for as it starts.
    seconds: each compute part and transfer of one microbatch in one layer."""
    _check(seconds)
    items = [item for stage in stages(schedule, dense_layers, moe_layers) for item in stage]
    one = sum(seconds[item.strip(">")] for item in items if not item.startswith(">"))
    return 2 * one


def overlapped_seconds(
    schedule: str, seconds: Mapping[str, float], dense_layers: int, moe_layers: int
) -> float:
    """Two microbatches in the executor's order (`delta` stages of A, then a stage of A and one
    of B in turn, then B's last `delta`), as an ideal machine runs them: compute back to back
    on one stream; each transfer starts when issued or when the previous one ends (one at a
    time, taking no compute time) and is waited for where the schedule consumes it."""
    _check(seconds)
    cut = stages(schedule, dense_layers, moe_layers)
    delta = DELTA_STAGES[schedule]
    if len(cut) < delta:
        raise ValueError(f"{schedule} runs {delta} stages ahead but the step has {len(cut)}")
    order = [0] * delta + [0, 1] * (len(cut) - delta) + [1] * delta
    done = [0, 0]  # stages each microbatch has run
    in_flight: list[dict[str, float]] = [{}, {}]  # transfer -> when it ends
    compute = link = 0.0  # when the compute stream and the link are next free
    for microbatch in order:
        for item in cut[done[microbatch]]:
            if item.endswith(">"):
                link = max(compute, link) + seconds[item[:-1]]
                in_flight[microbatch][item[:-1]] = link
            elif item.startswith(">"):
                compute = max(compute, in_flight[microbatch].pop(item[1:]))
            else:
                compute += seconds[item]
        done[microbatch] += 1
    return compute
