// The two device routines of the cuda backend: copying byte segments into peers' buffers, and
// a barrier across ranks through flags in those buffers. Peers' buffers are CUDA IPC mappings
// (the same GPU or another one of the host), so flags use system-scope atomics.
#pragma once

#include <cuda/atomic>
#include <cstdint>

namespace ep_comm {

// Segment s: lengths[s] bytes (a multiple of 16) from src + src_offsets[s] to dst_ptrs[s].
// Every block works on every segment, so a few large segments still use the whole SM budget.
__global__ void copy_segments_kernel(const uint8_t* __restrict__ src, const int64_t* __restrict__ src_offsets,
                                     const int64_t* __restrict__ dst_ptrs, const int64_t* __restrict__ lengths,
                                     int num_segments) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int s = 0; s < num_segments; ++s) {
    const int4* from = reinterpret_cast<const int4*>(src + src_offsets[s]);
    int4* to = reinterpret_cast<int4*>(dst_ptrs[s]);
    const int64_t units = lengths[s] / 16;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < units; i += stride) to[i] = from[i];
  }
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Thread p < num_ranks raises this rank's flag in peer p's buffer to `epoch`, then waits until
// peer p has raised its flag in ours. A peer missing after `timeout_ns` sets *status = p + 1.
__global__ void barrier_kernel(const int64_t* __restrict__ peer_flag_ptrs, uint64_t* own_flags, int num_ranks,
                               uint64_t epoch, uint64_t timeout_ns, int* status) {
  const int peer = threadIdx.x;
  if (peer >= num_ranks) return;
  __threadfence_system();  // what this stream wrote before (the pushed data) is visible first
  cuda::atomic_ref<uint64_t, cuda::thread_scope_system> theirs(*reinterpret_cast<uint64_t*>(peer_flag_ptrs[peer]));
  theirs.store(epoch, cuda::memory_order_release);
  cuda::atomic_ref<uint64_t, cuda::thread_scope_system> mine(own_flags[peer]);
  const uint64_t start = global_timer_ns();
  while (mine.load(cuda::memory_order_acquire) < epoch) {
    if (global_timer_ns() - start > timeout_ns) {
      atomicExch(status, peer + 1);
      return;
    }
    __nanosleep(256);
  }
}

}  // namespace ep_comm
