// Device routines shared by the notify, dispatch and combine kernels.
#pragma once

#include <cuda/atomic>

#include "layout.h"

namespace ep_comm {

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void group_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

using SystemU64 = cuda::atomic_ref<uint64_t, cuda::thread_scope_system>;

__device__ __forceinline__ uint64_t load_acquire(uint64_t* p) {
  return SystemU64(*p).load(cuda::memory_order_acquire);
}

__device__ __forceinline__ void store_release(uint64_t* p, uint64_t v) {
  SystemU64(*p).store(v, cuda::memory_order_release);
}

__device__ __forceinline__ uint64_t* head_of(uint8_t* buffer, int channel, int source) {
  return reinterpret_cast<uint64_t*>(buffer + kCountersOffset + (int64_t(channel) * kMaxRanks + source) * 16);
}

__device__ __forceinline__ uint64_t* tail_of(uint8_t* buffer, int channel, int source) {
  return head_of(buffer, channel, source) + 1;
}

__device__ __forceinline__ uint8_t* ring_of(uint8_t* buffer, const Rings& rings, int num_ranks, int channel,
                                            int source) {
  return buffer + kControlBytes + (int64_t(channel) * num_ranks + source) * rings.ring_tokens * rings.slot_bytes;
}

__device__ __forceinline__ int* timed_out_flag(const Peers& peers) {
  return reinterpret_cast<int*>(peers.base[peers.rank] + kTimedOutOffset);
}

// A buffer whose wait timed out stays failed: its kernels return at once, so that a rank out of
// step with its peers never writes into their buffers again (nor waits out another timeout).
__device__ __forceinline__ bool already_failed(const Peers& peers) {
  return *reinterpret_cast<volatile int*>(timed_out_flag(peers));
}

// Spin until `ready()`; false after the buffer's timeout (recorded, and said on stdout: the host
// raises it on the next call), or soon after another wait of this buffer timed out. The status
// the host reads is in host memory: spinning threads check a copy in device memory instead, and
// only every so often.
template <typename Ready>
__device__ bool wait_until(const Peers& peers, Step step, int peer, int channel, Ready ready) {
  const uint64_t start = global_timer_ns();
  for (uint32_t polls = 1; !ready(); ++polls) {
    if (polls % 128) continue;
    if (*reinterpret_cast<volatile int*>(timed_out_flag(peers))) return false;
    if (global_timer_ns() - start > peers.timeout_ns) {
      if (atomicExch(timed_out_flag(peers), 1) == 0) {
        peers.status[1] = peer;
        peers.status[2] = channel;
        __threadfence_system();
        peers.status[0] = step;
        printf("ep_comm rank %d/%d: step %d timed out waiting for rank %d (channel %d)\n", peers.rank,
               peers.num_ranks, step, peer, channel);
      }
      return false;
    }
  }
  return true;
}

// This buffer dropped rows in a dispatch (now or earlier): what it returns in combine is poison.
__device__ __forceinline__ bool overflowed(const Peers& peers) {
  return *reinterpret_cast<volatile int*>(peers.base[peers.rank] + kOverflowedOffset);
}

__device__ __forceinline__ void record_overflow(const Peers& peers, int64_t received_rows) {
  atomicMax(peers.status + kStatusReceivedRows, static_cast<int>(received_rows));
  atomicExch(reinterpret_cast<int*>(peers.base[peers.rank] + kOverflowedOffset), 1);
}

constexpr uint32_t kBf16NaNPair = 0x7FC07FC0;  // the poison patterns (cuda_backend.POISON)
constexpr uint32_t kFp32NaN = 0x7FC00000;

// Fill `bytes` (a multiple of 4) with a 32-bit pattern, with `lanes` threads.
__device__ __forceinline__ void fill_row(uint8_t* dst, int64_t bytes, uint32_t pattern, int lane, int lanes) {
  uint32_t* words = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = lane; i < bytes / 4; i += lanes) words[i] = pattern;
}

// Copy `bytes` (a multiple of 4; of 16 for the wide path) with `lanes` threads; ring-side reads
// bypass L1 (slots are rewritten by peers during the kernel). Four 16-byte loads in flight per
// thread before their stores.
__device__ __forceinline__ void copy_row(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane, int lanes) {
  if (bytes % 16 == 0) {
    constexpr int kInFlight = 4;
    const int4* from = reinterpret_cast<const int4*>(src);
    int4* to = reinterpret_cast<int4*>(dst);
    const int64_t units = bytes / 16;
    int64_t i = lane;
    for (; i + (kInFlight - 1) * lanes < units; i += kInFlight * lanes) {
      int4 values[kInFlight];
      for (int k = 0; k < kInFlight; ++k) values[k] = __ldcg(from + i + k * lanes);
      for (int k = 0; k < kInFlight; ++k) to[i + k * lanes] = values[k];
    }
    for (; i < units; i += lanes) to[i] = __ldcg(from + i);
  } else {
    for (int64_t i = lane; i < bytes / 4; i += lanes)
      reinterpret_cast<int*>(dst)[i] = __ldcg(reinterpret_cast<const int*>(src) + i);
  }
}

// The warps of a block, split into one group per peer rank: kWarps / num_ranks warps each (the
// rest idle). Groups synchronize on their own named barrier.
struct Group {
  int peer;
  int warp;  // within the group
  int num_warps;
  int lane;
  __device__ bool leader() const { return warp == 0 && lane == 0; }
  __device__ void sync() const { group_barrier(peer + 1, num_warps * 32); }
};

__device__ __forceinline__ Group group_of_this_thread(int num_ranks) {
  const int num_warps = kWarps / num_ranks;
  const int warp = threadIdx.x / 32;
  return Group{warp / num_warps, warp % num_warps, num_warps, static_cast<int>(threadIdx.x % 32)};
}

// The group's leader waits; everyone learns whether it succeeded.
template <typename Ready>
__device__ bool group_wait(const Group& g, const Peers& peers, Step step, int channel, int* shared_ok, Ready ready) {
  if (g.leader()) *shared_ok = wait_until(peers, step, g.peer, channel, ready);
  g.sync();
  return *shared_ok;
}

// Received rows from (source, channel) land at this offset: sources in rank order, channels in
// order within a source. channel_counts: [num_ranks, num_channels] rows received.
__device__ __forceinline__ int64_t receive_offset(const int* channel_counts, int num_channels, int source,
                                                  int channel) {
  int64_t offset = 0;
  for (int i = 0; i < source * num_channels + channel; ++i) offset += channel_counts[i];
  return offset;
}

// Channel c of n covers tokens [channel_begin(c), channel_begin(c + 1)).
__device__ __forceinline__ int channel_begin(int channel, int num_channels, int num_tokens) {
  return static_cast<int>(int64_t(num_tokens) * channel / num_channels);
}

}  // namespace ep_comm
