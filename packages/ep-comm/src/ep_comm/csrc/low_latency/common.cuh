// Device routines every low-latency kernel uses: timed waits on signal words, the last-block
// pattern, row copies, bf16 helpers.
#pragma once

#include <cuda/atomic>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "ll.h"

namespace ep_comm::ll {

constexpr int kWarpSize = 32;

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t load_acquire(uint64_t* p) {
  return cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*p).load(cuda::memory_order_acquire);
}

__device__ __forceinline__ uint32_t load_volatile(const uint32_t* p) { return *reinterpret_cast<const volatile uint32_t*>(p); }

// The first failure seen by this rank goes to the host-mapped status, once.
__device__ inline void record_failure(const LLSlot& s, int step, int peer, int expert, int failed_rank) {
  if (atomicExch(s.recorded, 1u) != 0) return;
  s.status[kStatusPeer] = peer;
  s.status[kStatusExpert] = expert;
  s.status[kStatusFailedRank] = failed_rank;
  __threadfence_system();
  s.status[kStatusStep] = step;
}

// Spin until `ready(value of *word)`. False after the buffer's timeout, or as soon as the
// buffer has failed (here or on a peer: a rank that times out tells every peer), so a failed
// buffer never waits a whole timeout again. Returns the time waited in *waited_ns.
// Whether an ack of use `ack` covers use `wanted`. Uses count up in 32 bits and wrap (after
// 2^32 calls on a slot, weeks at decode rates): compare by difference, not magnitude.
__device__ __forceinline__ bool acked_at_least(uint64_t ack, uint32_t wanted) {
  return static_cast<int32_t>(static_cast<uint32_t>(ack) - wanted) >= 0;
}

template <typename Ready>
__device__ bool wait_signal(const LLSlot& s, int step, int peer, int expert, uint64_t* word, Ready ready,
                            uint64_t* waited_ns = nullptr) {
  const uint64_t start = global_timer_ns();
  bool ok = true;
  for (uint32_t polls = 0; !ready(load_acquire(word)); ++polls) {
    if (polls % 64) continue;
    const uint64_t failed = load_acquire(s.failed);
    if (failed != 0) {
      record_failure(s, step, peer, expert, static_cast<int>(failed) - 1);
      ok = false;
      break;
    }
    if (global_timer_ns() - start > s.timeout_ns) {
      const uint64_t mine = 1 + static_cast<uint64_t>(s.rank);
      if (atomicCAS(reinterpret_cast<unsigned long long*>(s.failed), 0ull, mine) == 0) {
        record_failure(s, step, peer, expert, s.rank);
        printf("ep_comm rank %d/%d: low-latency step %d timed out waiting for rank %d (expert %d)\n", s.rank,
               s.num_ranks, step, peer, expert);
        for (int pe = 0; pe < s.num_ranks; ++pe)
          if (pe != s.rank) nvshmemx_signal_op(s.failed, mine, NVSHMEM_SIGNAL_SET, pe);
        nvshmem_quiet();
      }
      ok = false;
      break;
    }
  }
  if (waited_ns != nullptr) *waited_ns = global_timer_ns() - start;
  return ok;
}

__device__ __forceinline__ bool buffer_failed(const LLSlot& s) { return load_acquire(s.failed) != 0; }

// True in every thread of the block that finishes last (its predecessors' writes, NVSHMEM puts
// included, are ordered before what it does next); resets the counter for the next launch.
__device__ inline bool last_block(uint32_t* done) {
  __shared__ bool last;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(done, 1u) == gridDim.x - 1;
    if (last) *done = 0;
  }
  __syncthreads();
  if (last) __threadfence_system();
  return last;
}

// Copy `bytes` (a multiple of 16) with the lanes of a warp; `src` is read through L2 (peers
// write it during the kernel's lifetime).
__device__ __forceinline__ void warp_copy(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
  const int4* from = reinterpret_cast<const int4*>(src);
  int4* to = reinterpret_cast<int4*>(dst);
  const int64_t units = bytes / 16;
  constexpr int kInFlight = 4;
  int64_t i = lane;
  for (; i + (kInFlight - 1) * kWarpSize < units; i += kInFlight * kWarpSize) {
    int4 v[kInFlight];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) v[k] = __ldcg(from + i + k * kWarpSize);
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) to[i + k * kWarpSize] = v[k];
  }
  for (; i < units; i += kWarpSize) to[i] = __ldcg(from + i);
}

// Fill `bytes` (a multiple of 4) with a 32-bit pattern, all threads of the grid's last block.
__device__ inline void block_fill(void* dst, int64_t bytes, uint32_t pattern) {
  for (int64_t i = threadIdx.x; i < bytes / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(dst)[i] = pattern;
}

__device__ __forceinline__ float bf16_to_float(uint16_t v) { return __uint_as_float(static_cast<uint32_t>(v) << 16); }

// Round to nearest even, as torch's float -> bfloat16 cast (NaN stays a quiet NaN).
__device__ __forceinline__ uint16_t float_to_bf16(float f) {
  const uint32_t bits = __float_as_uint(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

constexpr uint32_t kNaNBf16x2 = 0x7fc07fc0u;
constexpr uint32_t kNaNE4m3x4 = 0x7f7f7f7fu;
constexpr uint32_t kNaNFloat = 0x7fc00000u;

}  // namespace ep_comm::ll
