// The narrow FP8 decode kernel that dequantizes in its consumers' registers. Experimental: off
// unless MLA_KERNELS_FP8_IN_REGISTERS=1 (mla_kernels/extension.py; its status in NOTES.md).
//
// For at most 16 query rows per KV head and an FP8 cache, as consumer_narrow.cuh, but the
// consumers convert the raw FP8 tiles themselves (consumer_fp8_registers.cuh): there is no bf16
// stage, so the shared memory of decode_kernel.cuh's two bf16 stages holds a ring of four raw
// tiles (raw_ring.cuh) beside a 16-row Q, and one producer thread only issues copies.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "consumer_fp8_registers.cuh"
#include "decode_common.cuh"
#include "pdl.cuh"
#include "raw_ring.cuh"

namespace mla {

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_fp8_registers_kernel(const __grid_constant__ DecodeParams p) {
  auto& s = shared_storage<T, RawRingStorage<T>>();
  const int wg = cutlass::canonical_warp_group_idx(), tid = threadIdx.x % 128;  // wg: warp-uniform
  if (threadIdx.x == 0) {
    for (int i = 0; i < kRawStages; ++i) {
      ClusterBarrier::init(&s.full[i], 1);
      ClusterBarrier::init(&s.empty[i], 128);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  wait_for_previous_grid();  // everything above touches no global memory
  allow_next_grid();

  // The consumers hold a tile's converted fragments beside their accumulators; the producer
  // thread needs few registers. (2 * consumer + producer <= 3 * kLaunchRegisters, see decode_kernel.cuh.)
  constexpr uint32_t kProducerRegisters = 40, kConsumerRegisters = 232;
  static_assert(2 * kConsumerRegisters + kProducerRegisters <= 3 * kLaunchRegisters);
  if (wg == 2) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if (tid == 0) produce_raw_tiles<T>(p, s, blockIdx.y);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
    consume_raw_tiles<T>(p, s, blockIdx.y, wg, tid);
  }
}

template <typename T>
void run_decode_fp8_registers(const DecodeParams& params, cudaStream_t stream) {
  auto kernel = mla_decode_fp8_registers_kernel<T>;
  constexpr int bytes = sizeof(RawRingStorage<T>);
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  const dim3 grid(1, params.h_kv, params.num_parts);  // one block of at most 16 query rows
  launch_with_pdl(kernel, grid, dim3(kThreads), bytes, stream, params);
}

}  // namespace mla
