"""The per-token inputs that a captured step reads, filled for each replay in one copy.

A CUDA graph reads its inputs from fixed addresses, so each replay first writes the step's
tokens there. Written tensor by tensor from the CPU, that is a handful of copies from pageable
memory, each of which waits for the device's queue, and fills for the padding rows, all within
the host's part of a step. `StaticInputs` keeps input_ids, positions, slot_mapping and
real_rows as views of one device buffer with a pinned mirror on the host: the host writes the
step into the mirror through numpy (on the H200 machine's host a torch op on small CPU tensors
took 10-60 µs, a fill with the step's positions and slots 0.36 ms where a batch-1 decode
step replays in 2.6; 0.04 ms through numpy) and one asynchronous copy moves it.

    inputs = StaticInputs(rows=256, device=cache.device, pad_slot=pad * page)
    inputs.fill(n, size, batch.input_ids, batch.positions, batch.slot_mapping(page))
    graph.replay()  # captured over inputs.input_ids[:size], inputs.positions[:size], ...
"""

from __future__ import annotations

import torch

FIELDS = {
    "input_ids": torch.long,
    "positions": torch.long,
    "slot_mapping": torch.long,
    "real_rows": torch.bool,
}


class StaticInputs:
    """input_ids, positions, slot_mapping `[rows]` int64 and real_rows `[rows]` bool on
    `device` (CUDA; the CPU too, where the same steps run eagerly); before the first `fill`,
    every row is padding: token 0 at position 0 in `pad_slot` (a cache row that only padding
    writes and reads), not real."""

    def __init__(self, rows: int, device: torch.device, pad_slot: int) -> None:
        self.rows, self.pad_slot = rows, pad_slot
        spans, start = {}, 0
        for name, dtype in FIELDS.items():
            size = rows * dtype.itemsize
            spans[name] = (start, size)
            start += -(-size // 256) * 256  # views aligned as separate allocations were
        cuda = torch.device(device).type == "cuda"
        self._device = torch.zeros(start, dtype=torch.uint8, device=device)
        self._host = torch.zeros(start, dtype=torch.uint8, pin_memory=cuda)
        self._host_views = {}
        for name, (begin, size) in spans.items():
            setattr(self, name, self._device[begin : begin + size].view(FIELDS[name]))
            # numpy views: a write costs a microsecond where a torch op's dispatch costs several
            self._host_views[name] = self._host[begin : begin + size].view(FIELDS[name]).numpy()
        self._host_views["slot_mapping"].fill(pad_slot)
        self._device.copy_(self._host)
        self._copied = torch.cuda.Event() if cuda else None  # the last copy out of the mirror

    def fill(self, n: int, size: int, input_ids, positions, slot_mapping, real_rows=True) -> None:
        """Rows :n from the step (each a `[n]` tensor on the CPU or on the device, or a numpy
        array; real_rows `[n]` bool, or True: every one), rows n:size padding. Ordered on the
        current stream before what follows (a graph's replay); the host waits only for the
        previous fill's copy, before it rewrites the mirror."""
        if not 0 <= n <= size <= self.rows:
            raise ValueError(f"need 0 <= n ({n}) <= size ({size}) <= {self.rows} rows")
        if self._copied is not None:
            self._copied.synchronize()
        host = self._host_views
        on_device = []
        for name, values, padding in (
            ("input_ids", input_ids, 0),
            ("positions", positions, 0),
            ("slot_mapping", slot_mapping, self.pad_slot),
            ("real_rows", real_rows, False),
        ):
            if isinstance(values, torch.Tensor) and values.device.type != "cpu":
                on_device.append((getattr(self, name), values))
            else:
                host[name][:n] = values.numpy() if isinstance(values, torch.Tensor) else values
            host[name][n:size] = padding
        self._device.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self._device.device))
        for static, values in on_device:  # after the mirror's copy, which wrote stale rows there
            static[:n].copy_(values, non_blocking=True)
