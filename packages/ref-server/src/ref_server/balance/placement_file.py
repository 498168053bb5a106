"""A saved expert placement: JSON that `ref-server serve --expert-placement FILE` loads.

    {"num_logical_experts": 64, "physical_to_logical": [[3, 17, ...], ...]}

one row per MoE layer, the logical expert of each physical slot (`Placement.phy2log`), so a
restarted instance starts from the balance its predecessor reached.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np


def write_placement(path: Path | str, phy2log, num_logical: int) -> None:
    """Write atomically (a reader never sees half a file)."""
    path = Path(path)
    rows = np.asarray(phy2log, dtype=np.int64).tolist()
    text = json.dumps({"num_logical_experts": int(num_logical), "physical_to_logical": rows})
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text + "\n")
    os.replace(partial, path)


def read_placement(path: Path | str, num_logical: int | None = None) -> np.ndarray:
    """`[MoE layers, slots]` int64; ValueError naming what is wrong with the file (against
    num_logical, the model's routed experts, when given)."""
    path = Path(path)
    try:
        saved = json.loads(path.read_text())
        rows = saved["physical_to_logical"]
        logical = saved["num_logical_experts"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not an expert placement file: {error!r}") from None
    if not rows or not all(isinstance(r, list) and len(r) == len(rows[0]) for r in rows):
        raise ValueError(f"{path}: physical_to_logical must be equal rows, one per MoE layer")
    if not all(isinstance(e, int) for r in rows for e in r):
        raise ValueError(f"{path}: physical_to_logical must hold expert ids (integers)")
    if num_logical is not None and logical != num_logical:
        raise ValueError(f"{path} places {logical} experts; the model routes to {num_logical}")
    table = np.asarray(rows, dtype=np.int64)
    for layer, row in enumerate(table):
        missing = sorted(set(range(logical)) - set(row.tolist()))
        if missing or row.min() < 0 or row.max() >= logical:
            raise ValueError(
                f"{path}: MoE layer {layer} must hold every expert of 0..{logical - 1} "
                f"and nothing else (missing {missing[:8]})"
            )
    return table
