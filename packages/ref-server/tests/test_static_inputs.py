"""`StaticInputs`: a captured step's per-token inputs, filled in one copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ref_server.model.static_inputs import StaticInputs

PAD_SLOT = 7 * 64


def values(inputs: StaticInputs, size: int) -> list[list]:
    return [
        getattr(inputs, name)[:size].cpu().tolist()
        for name in ("input_ids", "positions", "slot_mapping", "real_rows")
    ]


def test_padding_before_the_first_fill():
    inputs = StaticInputs(5, "cpu", PAD_SLOT)
    assert values(inputs, 5) == [[0] * 5, [0] * 5, [PAD_SLOT] * 5, [False] * 5]
    assert inputs.input_ids.dtype == torch.long and inputs.real_rows.dtype == torch.bool


@pytest.mark.parametrize("rows", [1, 3, 9])  # bool views of lengths that are no multiple of 8
def test_fill_writes_the_step_then_padding_and_leaves_later_rows(rows):
    inputs = StaticInputs(rows + 2, "cpu", PAD_SLOT)
    ids = torch.randint(0, 1000, (rows + 2,))
    positions = torch.randint(0, 1000, (rows + 2,))
    slots = torch.randint(0, 1000, (rows + 2,))
    inputs.fill(rows + 2, rows + 2, ids, positions, slots)
    inputs.fill(rows - 1, rows, ids[: rows - 1], positions[: rows - 1], slots[: rows - 1])
    got = values(inputs, rows + 2)
    head = rows - 1
    assert got[0] == [*ids[:head].tolist(), 0, *ids[rows:].tolist()]
    assert got[1] == [*positions[:head].tolist(), 0, *positions[rows:].tolist()]
    assert got[2] == [*slots[:head].tolist(), PAD_SLOT, *slots[rows:].tolist()]
    assert got[3] == [True] * head + [False] + [True, True]


def test_fill_of_padding_only():
    inputs = StaticInputs(4, "cpu", PAD_SLOT)
    ones = torch.ones(4, dtype=torch.long)
    inputs.fill(4, 4, ones, ones, ones)
    nothing = torch.zeros(0, dtype=torch.long)
    inputs.fill(0, 3, nothing, nothing, nothing)
    assert values(inputs, 4) == [
        [0, 0, 0, 1],
        [0, 0, 0, 1],
        [PAD_SLOT] * 3 + [1],
        [False] * 3 + [True],
    ]


def test_fill_takes_real_rows_and_numpy_rows():
    """Rows the caller lays out itself (padding among them): its real_rows, numpy arrays."""
    inputs = StaticInputs(6, "cpu", PAD_SLOT)
    gen = np.random.default_rng()
    ids, positions, slots = (gen.integers(0, 1000, 5) for _ in range(3))
    real = gen.integers(0, 2, 5).astype(bool)
    inputs.fill(5, 6, ids, positions, slots, real)
    assert values(inputs, 6) == [
        [*ids.tolist(), 0],
        [*positions.tolist(), 0],
        [*slots.tolist(), PAD_SLOT],
        [*real.tolist(), False],
    ]


@pytest.mark.parametrize("n, size", [(3, 2), (-1, 2), (2, 5)])
def test_fill_rejects_rows_outside_the_buffer(n, size):
    inputs = StaticInputs(4, "cpu", PAD_SLOT)
    rows = torch.zeros(max(n, 0), dtype=torch.long)
    with pytest.raises(ValueError, match="rows"):
        inputs.fill(n, size, rows, rows, rows)


@pytest.mark.gpu
def test_fill_on_cuda_takes_host_and_device_rows_in_stream_order():
    """Host rows go through the pinned mirror, device rows are copied after it; fills queued
    behind a slow kernel land in order (the mirror is rewritten only after its copy)."""
    inputs = StaticInputs(64, "cuda", PAD_SLOT)
    seen = []
    for step in range(4):
        busy = torch.randn(4096, 4096, device="cuda")
        busy @ busy  # keeps the stream busy while the host fills again
        ids = torch.arange(step, step + 40, device="cuda")  # on the device
        positions = torch.arange(40) * (step + 1)  # on the host
        slots = torch.arange(40) + 100 * step
        inputs.fill(40, 48, ids, positions, slots)
        seen.append(
            [
                t.clone()
                for t in (inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.real_rows)
            ]
        )
    for step, (ids, positions, slots, real) in enumerate(seen):
        assert ids[:40].tolist() == list(range(step, step + 40))
        assert ids[40:48].tolist() == [0] * 8
        assert positions[:40].tolist() == [i * (step + 1) for i in range(40)]
        assert slots[:40].tolist() == [i + 100 * step for i in range(40)]
        assert slots[40:48].tolist() == [PAD_SLOT] * 8
        assert real[:48].tolist() == [True] * 40 + [False] * 8
