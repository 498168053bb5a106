// Split-KV MLA decode attention for sm_90a.
//
// Grid: (query-row blocks of 64, KV heads, scheduler partitions). Each CTA walks the 64-token
// KV tiles of its partition (tile_cursor.cuh) with three warpgroups: a producer that fills a
// two-stage ring of K tiles in shared memory (producer.cuh), and two consumers that turn them
// into attention (consumer.cuh; consumer_narrow.cuh for an FP8 cache and at most 16 query rows
// per KV head).
// A sequence the scheduler split across partitions is written as normalized fp32 pieces plus
// their lse, which combine_kernel.cuh merges; an unsplit one goes straight to `out`.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "consumer.cuh"
#include "consumer_narrow.cuh"
#include "decode_common.cuh"
#include "pdl.cuh"
#include "producer.cuh"

namespace mla {

template <typename T, bool kFp8, int kNarrow>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_kernel(const __grid_constant__ DecodeParams p) {
  static_assert(kFp8 || kNarrow == 0, "the narrow consumers are built for an FP8 cache only");
  auto& s = shared_storage<T>();
  const int wg = cutlass::canonical_warp_group_idx(), tid = threadIdx.x % 128;  // wg: warp-uniform
  const int head = blockIdx.y;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      ClusterBarrier::init(&s.k_full[i], kFp8 ? 128 : 1);
      ClusterBarrier::init(&s.k_empty[i], kConsumerThreads);
      ClusterBarrier::init(&s.raw_full[i], 1);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  wait_for_previous_grid();  // everything above touches no global memory
  allow_next_grid();

  // Each thread starts with kLaunchRegisters; the consumers can take only what the producer
  // gives back (a larger request would wait forever), and the FP8 producer holds half a tile's
  // raw values (40 registers) and converts many of them at once.
  constexpr uint32_t kProducerRegisters = kFp8 ? 104 : 40, kConsumerRegisters = kFp8 ? 200 : 232;
  static_assert(2 * kConsumerRegisters + kProducerRegisters <= 3 * kLaunchRegisters);
  if (wg == 2) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if constexpr (kFp8) {
      dequantize_fp8_tiles<T>(p, s, tid);
    } else if (tid == 0) {
      produce_by_tma<T>(p, s, head);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
    if constexpr (kNarrow > 0) {
      consume_narrow<T, kNarrow>(p, s, head, wg, tid);
    } else {
      consume<T, kFp8>(p, s, head, wg, tid);
    }
  }
}

template <typename T, bool kFp8, int kNarrow>
void run_decode(const DecodeParams& params, cudaStream_t stream) {
  auto kernel = mla_decode_kernel<T, kFp8, kNarrow>;
  constexpr int bytes = shared_bytes<T>();
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  const dim3 grid((params.rows_per_kv + kBlockM - 1) / kBlockM, params.h_kv, params.num_parts);
  launch_with_pdl(kernel, grid, dim3(kThreads), bytes, stream, params);
}

}  // namespace mla
