// Combine: dispatch backwards. The sender block's groups return each source's rows (in the order
// they arrived) to that source's ring; the receiver block walks its channel's tokens and sums, in
// rank order, the row every rank it was dispatched to sends back, plus the biases.
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>

#include "ring.cuh"

namespace ep_comm {

__device__ void return_rows(const CombineParams& p, const Group& g, int channel, int* shared_ok,
                            uint64_t* shared_head) {
  const int num_channels = p.rings.num_channels;
  RingWriter writer = open_ring(p.peers, p.rings, g.peer, channel);
  const int64_t count = p.channel_counts[g.peer * num_channels + channel];
  const int64_t offset = receive_offset(p.channel_counts, num_channels, g.peer, channel);
  const int64_t x_bytes = int64_t(p.hidden) * 2, weight_bytes = int64_t(p.num_topk) * 4;
  // After an overflow every row still goes back (the peers wait for them), as NaN: x was
  // computed from poisoned rows, and the rows past x_rows were dropped.
  const bool poisoned = overflowed(p.peers);
  for (int64_t done = 0; done < count;) {
    const int n = static_cast<int>(min(int64_t(p.rings.send_chunk), count - done));
    const bool ok = send_rows(g, p.peers, p.rings, kCombineSend, channel, n, shared_ok, shared_head, writer,
                              [&](uint8_t* slot, int i) {
                                const int64_t row = offset + done + i;
                                if (poisoned || row >= p.x_rows) {
                                  fill_row(slot, x_bytes, kBf16NaNPair, g.lane, 32);
                                  if (weight_bytes) fill_row(slot + p.weights_offset, weight_bytes, kFp32NaN, g.lane, 32);
                                  return;
                                }
                                copy_row(slot, p.x + row * x_bytes, x_bytes, g.lane, 32);
                                if (weight_bytes)
                                  copy_row(slot + p.weights_offset, p.topk_weights + row * weight_bytes, weight_bytes,
                                           g.lane, 32);
                              });
    if (!ok) return;
    done += n;
  }
}

__device__ __forceinline__ void add_bf16x8(float (&sum)[8], int4 packed) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
  for (int k = 0; k < 4; ++k) {
    const float2 v = __bfloat1622float2(pairs[k]);
    sum[2 * k] += v.x;
    sum[2 * k + 1] += v.y;
  }
}

__device__ void sum_returned_rows(const CombineParams& p, int channel) {
  __shared__ uint64_t read[kMaxRanks];
  __shared__ int all_arrived;
  const Peers& peers = p.peers;
  const int num_ranks = peers.num_ranks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // A window needs at most `window` rows from a rank. A sender waits for room for a whole
  // piece (send_chunk rows), so it can always fill a ring to ring_tokens - send_chunk + 1 rows:
  // every row a window needs arrives.
  const int window = min(32, p.rings.ring_tokens - p.rings.send_chunk + 1);
  uint8_t* own = peers.base[peers.rank];
  if (threadIdx.x < num_ranks) read[threadIdx.x] = load_acquire(head_of(own, channel, threadIdx.x));
  if (threadIdx.x == 0) all_arrived = 1;
  __syncthreads();
  const int end = channel_begin(channel + 1, p.rings.num_channels, p.num_tokens);
  for (int first = channel_begin(channel, p.rings.num_channels, p.num_tokens); first < end; first += window) {
    uint32_t from[kMaxRanks];  // bit i: token first + i comes back from that rank
    for (int r = 0; r < num_ranks; ++r) {
      const int token = first + lane;
      from[r] = __ballot_sync(0xffffffffu, lane < window && token < end &&
                                               p.is_token_in_rank[int64_t(token) * num_ranks + r]);
    }
    for (int i = warp; i < window && first + i < end; i += kWarps) {
      const int64_t token = first + i;
      const uint8_t* slots[kMaxRanks];
      bool ok = true;
      for (int r = 0; r < num_ranks && ok; ++r) {
        if (!(from[r] >> i & 1)) continue;
        const uint64_t position = read[r] + __popc(from[r] & ((1u << i) - 1));
        uint64_t* tail = tail_of(own, channel, r);
        if (lane == 0) ok = wait_until(peers, kCombineReceive, r, channel, [&] { return load_acquire(tail) > position; });
        ok = __shfl_sync(0xffffffffu, ok, 0);
        __syncwarp();  // orders lane 0's acquire before the other lanes read the slot
        slots[r] = ring_of(own, p.rings, num_ranks, channel, r) +
                   int64_t(position % p.rings.ring_tokens) * p.rings.slot_bytes;
      }
      if (!ok) {
        all_arrived = 0;
        continue;
      }
      for (int unit = lane; unit < p.hidden / 8; unit += 32) {
        float sum[8] = {};
        for (int b = 0; b < 2; ++b)
          if (p.bias[b]) add_bf16x8(sum, reinterpret_cast<const int4*>(p.bias[b] + token * p.hidden * 2)[unit]);
        for (int r = 0; r < num_ranks; ++r)
          if (from[r] >> i & 1) add_bf16x8(sum, __ldcg(reinterpret_cast<const int4*>(slots[r]) + unit));
        __nv_bfloat162 out[4];
        for (int k = 0; k < 4; ++k) out[k] = __floats2bfloat162_rn(sum[2 * k], sum[2 * k + 1]);
        reinterpret_cast<int4*>(p.combined_x + token * p.hidden * 2)[unit] = *reinterpret_cast<int4*>(out);
      }
      for (int k = lane; k < p.num_topk; k += 32) {
        float sum = 0;
        for (int r = 0; r < num_ranks; ++r)
          if (from[r] >> i & 1) sum += __ldcg(reinterpret_cast<const float*>(slots[r] + p.weights_offset) + k);
        p.combined_topk_weights[token * p.num_topk + k] = sum;
      }
    }
    __syncthreads();  // the window's slots are read before they are freed
    if (!all_arrived) return;
    if (threadIdx.x < num_ranks) {
      read[threadIdx.x] += __popc(from[threadIdx.x]);
      store_release(head_of(own, channel, threadIdx.x), read[threadIdx.x]);
    }
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kThreads, 1) combine_kernel(CombineParams p) {
  __shared__ int shared_ok[kMaxRanks];
  __shared__ uint64_t shared_head[kMaxRanks];
  const int channel = blockIdx.x / 2;
  if (already_failed(p.peers)) return;
  if (blockIdx.x % 2 == 1) {
    sum_returned_rows(p, channel);
    return;
  }
  const Group g = group_of_this_thread(p.peers.num_ranks);
  if (g.peer < p.peers.num_ranks) return_rows(p, g, channel, shared_ok + g.peer, shared_head + g.peer);
}

void launch_combine(const CombineParams& params, cudaStream_t stream) {
  combine_kernel<<<2 * params.rings.num_channels, kThreads, 0, stream>>>(params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ep_comm
