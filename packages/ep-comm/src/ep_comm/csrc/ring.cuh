// A sender group's side of one ring in a peer's buffer, shared by dispatch and combine.
#pragma once

#include "device.cuh"

namespace ep_comm {

struct RingWriter {
  uint64_t* head;
  uint64_t* tail;
  uint8_t* ring;
  uint64_t written;
  uint64_t head_seen;  // the receiver's head when last read: room is re-read only when short
};

__device__ inline RingWriter open_ring(const Peers& peers, const Rings& rings, int peer, int channel) {
  uint8_t* buffer = peers.base[peer];
  RingWriter w{head_of(buffer, channel, peers.rank), tail_of(buffer, channel, peers.rank),
               ring_of(buffer, rings, peers.num_ranks, channel, peers.rank), 0, 0};
  w.written = load_acquire(w.tail);  // only we write it
  w.head_seen = w.written;  // the barrier starting the call: the receiver has read everything
  return w;
}

// Send n <= send_chunk rows once the ring has room for them; write_row(slot, i) fills the slot
// of row i (one warp per row), then the tail publishes them.
template <typename WriteRow>
__device__ bool send_rows(const Group& g, const Peers& peers, const Rings& rings, Step step, int channel, int n,
                          int* shared_ok, uint64_t* shared_head, RingWriter& w, WriteRow write_row) {
  const uint64_t end = w.written + n;  // room for it once head + ring_tokens reaches it
  if (w.head_seen + rings.ring_tokens < end) {
    const bool ok = group_wait(g, peers, step, channel, shared_ok, [&] {
      *shared_head = load_acquire(w.head);
      return *shared_head + rings.ring_tokens >= end;
    });
    if (!ok) return false;
    w.head_seen = *shared_head;
  }
  for (int i = g.warp; i < n; i += g.num_warps)
    write_row(w.ring + int64_t((w.written + i) % rings.ring_tokens) * rings.slot_bytes, i);
  g.sync();  // the leader's release then covers the whole group's writes
  w.written += n;
  if (g.leader()) store_release(w.tail, w.written);
  return true;
}

}  // namespace ep_comm
