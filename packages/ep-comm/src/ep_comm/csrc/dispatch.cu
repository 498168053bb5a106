// Dispatch: 2 blocks per channel. The sender block's groups each send the channel's tokens bound
// for one rank into that rank's ring; the receiver block's groups each drain one source's ring
// into the outputs, at the rows notify's counts give them.
#include <c10/cuda/CUDAException.h>

#include "ring.cuh"

namespace ep_comm {

__device__ void send_tokens(const DispatchParams& p, const Group& g, int channel, int* shared_ok,
                            uint64_t* shared_head) {
  const int num_ranks = p.peers.num_ranks;
  RingWriter writer = open_ring(p.peers, p.rings, g.peer, channel);
  const int end = channel_begin(channel + 1, p.rings.num_channels, p.num_tokens);
  for (int first = channel_begin(channel, p.rings.num_channels, p.num_tokens); first < end; first += 32) {
    const int token = first + g.lane;
    uint32_t bound = __ballot_sync(0xffffffffu, token < end && p.is_token_in_rank[int64_t(token) * num_ranks + g.peer]);
    while (bound) {
      const int n = min(__popc(bound), p.rings.send_chunk);
      const bool ok = send_rows(g, p.peers, p.rings, kDispatchSend, channel, n, shared_ok, shared_head, writer,
                                [&](uint8_t* slot, int i) {
                                  const int t = first + static_cast<int>(__fns(bound, 0, i + 1));
                                  for (int f = 0; f < p.num_fields; ++f) {
                                    const Field& field = p.fields[f];
                                    copy_row(slot + field.offset, field.src + t * field.bytes, field.bytes, g.lane, 32);
                                  }
                                  if (g.lane == 0) *reinterpret_cast<int*>(slot + p.index_offset) = t;
                                });
      if (!ok) return;
      for (int i = 0; i < n; ++i) bound &= bound - 1;
    }
  }
}

__device__ void receive_tokens(const DispatchParams& p, const Group& g, int channel, int* shared_ok,
                               uint64_t* shared_available) {
  const Peers& peers = p.peers;
  const int num_channels = p.rings.num_channels;
  uint8_t* own = peers.base[peers.rank];
  uint64_t* head = head_of(own, channel, g.peer);
  uint64_t* tail = tail_of(own, channel, g.peer);
  const uint8_t* ring = ring_of(own, p.rings, peers.num_ranks, channel, g.peer);
  const int64_t expected = p.channel_counts[g.peer * num_channels + channel];
  const int64_t offset = receive_offset(p.channel_counts, num_channels, g.peer, channel);
  uint64_t read = load_acquire(head);
  for (int64_t done = 0; done < expected;) {
    const bool ok = group_wait(g, peers, kDispatchReceive, channel, shared_ok, [&] {
      const uint64_t written = load_acquire(tail);
      *shared_available = written - read;
      return written > read;
    });
    if (!ok) return;
    const int64_t n = min(static_cast<int64_t>(*shared_available), expected - done);
    for (int64_t i = g.warp; i < n; i += g.num_warps) {
      const uint8_t* slot = ring + int64_t((read + i) % p.rings.ring_tokens) * p.rings.slot_bytes;
      const int64_t row = offset + done + i;
      if (row >= p.capacity) {
        if (g.lane == 0) record_overflow(peers, row + 1);
        continue;
      }
      for (int f = 0; f < p.num_fields; ++f) {
        const Field& field = p.fields[f];
        copy_row(field.dst + row * field.bytes, slot + field.offset, field.bytes, g.lane, 32);
      }
      if (g.lane == 0) p.recv_src_idx[row] = __ldcg(reinterpret_cast<const int*>(slot + p.index_offset));
    }
    g.sync();  // the slots are read before they are freed, and *shared_available before it changes
    read += n;
    done += n;
    if (g.leader()) store_release(head, read);
  }
}

__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(DispatchParams p) {
  __shared__ int shared_ok[kMaxRanks];
  __shared__ uint64_t shared_counter[kMaxRanks];  // a head (senders), rows available (receivers)
  const Group g = group_of_this_thread(p.peers.num_ranks);
  if (g.peer >= p.peers.num_ranks || already_failed(p.peers)) return;
  const int channel = blockIdx.x / 2;
  if (blockIdx.x % 2 == 0) {
    send_tokens(p, g, channel, shared_ok + g.peer, shared_counter + g.peer);
  } else {
    receive_tokens(p, g, channel, shared_ok + g.peer, shared_counter + g.peer);
  }
}

void launch_dispatch(const DispatchParams& params, cudaStream_t stream) {
  dispatch_kernel<<<2 * params.rings.num_channels, kThreads, 0, stream>>>(params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ep_comm
