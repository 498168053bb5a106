"""Programmatic dependent launch (Hopper) for the model's Triton kernels.

In a CUDA graph of a small decode step most kernels are short, and the GPU idles a microsecond
or two between one kernel's end and the next one's start. A kernel launched with programmatic
stream serialization may be scheduled while the one before it still runs; it waits for that
kernel's writes (`griddepcontrol.wait`) before it does anything, then lets the kernel after it
be scheduled in turn (`griddepcontrol.launch_dependents`): the launches overlap, the work does
not. Every kernel that takes `PDL` waits first, so each still sees all the writes of the
kernels before it (each of which waited for its own predecessor before it ended).

Measured on the H200 (bench_model.py, V2-Lite decode graph replayed, 2026-12-03): alone it moved
no step by more than 1 %; with the shared experts on their own stream (`MoE.op_shared_experts`)
the two together took batch 1 from 3.28 to 2.75 ms a step and batch 128 from 10.29 to 9.92.
"""

from __future__ import annotations

import functools
import os

import torch


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for the launch of a Triton kernel that takes `PDL: tl.constexpr` and,
    with it, starts with gdc_wait and gdc_launch_dependents: on where the device has
    programmatic dependent launch (NVIDIA sm90 and later; not under Triton's interpreter, which
    runs no inline PTX)."""
    if device.type != "cuda" or torch.version.hip or os.environ.get("TRITON_INTERPRET") == "1":
        return {"PDL": False}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"PDL": True, "launch_pdl": True} if _has_pdl(index) else {"PDL": False}


@functools.cache
def _has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9
