// Split-KV MLA decode attention for sm_90a.
//
// Grid: (query-row blocks of 64, KV heads, scheduler partitions). Each CTA walks the 64-token
// KV tiles of its partition (tile_cursor.cuh) with three warpgroups: a producer that fills a
// two-stage ring of K tiles in shared memory (producer.cuh), and two consumers that turn them
// into attention (consumer.cuh).
// A sequence the scheduler split across partitions is written as normalized fp32 pieces plus
// their lse, which combine_kernel.cuh merges; an unsplit one goes straight to `out`.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "consumer.cuh"
#include "decode_common.cuh"
#include "producer.cuh"

namespace mla {

constexpr uint32_t kLaunchRegisters = 65536 / kThreads / 8 * 8;  // 168

template <typename T, bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_kernel(const __grid_constant__ DecodeParams p) {
  auto& s = shared_storage<T>();
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int head = blockIdx.y;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      ClusterBarrier::init(&s.k_full[i], kFp8 ? 128 : 1);
      ClusterBarrier::init(&s.k_empty[i], kConsumerThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  // Each thread starts with kLaunchRegisters; the consumers can take only what the producer
  // gives back (a larger request would wait forever), and the FP8 producer keeps a tile of raw
  // tokens in registers (82 per thread).
  constexpr uint32_t kProducerRegisters = kFp8 ? 112 : 40, kConsumerRegisters = kFp8 ? 192 : 232;
  static_assert(2 * kConsumerRegisters + kProducerRegisters <= 3 * kLaunchRegisters);
  if (wg == 2) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if constexpr (kFp8) {
      produce_from_fp8<T>(p, s, head, tid);
    } else if (tid == 0) {
      produce_by_tma<T>(p, s, head);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
    consume<T>(p, s, head, wg, tid);
  }
}

template <typename T, bool kFp8>
void run_decode(const DecodeParams& params, cudaStream_t stream) {
  auto kernel = mla_decode_kernel<T, kFp8>;
  constexpr int bytes = shared_bytes<T>();
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  const dim3 grid((params.rows_per_kv + kBlockM - 1) / kBlockM, params.h_kv, params.num_parts);
  kernel<<<grid, kThreads, bytes, stream>>>(params);
}

}  // namespace mla
