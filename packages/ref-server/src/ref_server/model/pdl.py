"""Programmatic dependent launch (Hopper) for the model's Triton kernels: an experiment.

In a CUDA graph of a small decode step most kernels are short, and the GPU idles a microsecond
or two between one kernel's end and the next one's start. A kernel launched with programmatic
stream serialization may be scheduled while the one before it still runs; it waits for that
kernel's writes (`griddepcontrol.wait`) before it does anything, then lets the kernel after it
be scheduled in turn (`griddepcontrol.launch_dependents`): the launches overlap, the work does
not. Every kernel that takes `PDL` waits first, so each still sees all the writes of the
kernels before it (each of which waited for its own predecessor before it ended).

WIP A/B switch (remove once measured): REF_SERVER_EXP_PDL=1 turns it on, on sm90 and later.
"""

from __future__ import annotations

import functools
import os

import torch

ENABLED = os.environ.get("REF_SERVER_EXP_PDL", "0") == "1"


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for the launch of a Triton kernel that takes `PDL: tl.constexpr` and,
    with it, starts with gdc_wait and gdc_launch_dependents: on where the experiment is on and
    the device has programmatic dependent launch."""
    if not ENABLED or device.type != "cuda":
        return {"PDL": False}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"PDL": True, "launch_pdl": True} if _has_pdl(index) else {"PDL": False}


@functools.cache
def _has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9
