// Merges the pieces of sequences the scheduler split across partitions:
//   out = sum_i exp(lse_i - lse) * out_i,  lse = log(sum_i exp(lse_i)),
// one warp per (sequence, query position, head) row. Sequences with no tokens get out = 0 and
// lse = +inf; those in one piece were written by the decode kernel and are left alone.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "numeric.cuh"
#include "params.h"
#include "pdl.cuh"

namespace mla {

constexpr int kCombineWarps = 8;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, offset));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffff, v, offset);
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kCombineWarps * 32) mla_combine_kernel(const __grid_constant__ CombineParams p) {
  wait_for_previous_grid();
  allow_next_grid();
  const int batch = blockIdx.x, lane = threadIdx.x % 32;
  const int rows = p.s_q * p.h_q;
  const int row = blockIdx.y * kCombineWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int first = p.slots_per_piece * p.num_splits[batch];
  const int pieces = p.slots_per_piece * p.num_splits[batch + 1] - first;
  if (pieces == 1) return;

  const int s = row / p.h_q, h = row % p.h_q;
  const float* lse_of = p.lse_accum + int64_t(first) * rows + row;  // piece i's at [i * rows]
  float max_lse = -INFINITY;
  for (int i = lane; i < pieces; i += 32) max_lse = fmaxf(max_lse, lse_of[int64_t(i) * rows]);
  max_lse = warp_max(max_lse);
  float sum = 0.f;
  if (max_lse != -INFINITY) {
    for (int i = lane; i < pieces; i += 32) sum += __expf(lse_of[int64_t(i) * rows] - max_lse);
    sum = warp_sum(sum);
  }

  // Lane j weighs piece chunk + j; the pieces' loads are independent of one another (their
  // weights arrive by shuffle), so unrolled they are in flight together, not one at a time.
  float acc[16] = {};
  const float4* pieces_out = reinterpret_cast<const float4*>(p.out_accum + (int64_t(first) * rows + row) * kHeadDimV);
  for (int chunk = 0; chunk < pieces && sum > 0.f; chunk += 32) {
    const int count = min(32, pieces - chunk);
    const float my_weight = lane < count ? __expf(lse_of[int64_t(chunk + lane) * rows] - max_lse) / sum : 0.f;
#pragma unroll 4
    for (int j = 0; j < count; ++j) {
      const float weight = __shfl_sync(0xffffffff, my_weight, j);
      const float4* piece = pieces_out + int64_t(chunk + j) * rows * (kHeadDimV / 4);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float4 v = piece[k * 32 + lane];
        acc[k * 4 + 0] += weight * v.x;
        acc[k * 4 + 1] += weight * v.y;
        acc[k * 4 + 2] += weight * v.z;
        acc[k * 4 + 3] += weight * v.w;
      }
    }
  }
  T* out = static_cast<T*>(p.out) + (int64_t(batch) * rows + row) * kHeadDimV;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    *reinterpret_cast<uint2*>(out + (k * 32 + lane) * 4) =
        make_uint2(pack2<T>(acc[k * 4], acc[k * 4 + 1]), pack2<T>(acc[k * 4 + 2], acc[k * 4 + 3]));
  }
  if (lane == 0) p.lse[(int64_t(batch) * p.h_q + h) * p.s_q + s] = sum > 0.f ? max_lse + logf(sum) : INFINITY;
}

template <typename T>
void run_combine(const CombineParams& params, cudaStream_t stream) {
  const dim3 grid(params.batch, (params.s_q * params.h_q + kCombineWarps - 1) / kCombineWarps);
  launch_with_pdl(mla_combine_kernel<T>, grid, dim3(kCombineWarps * 32), 0, stream, params);
}

}  // namespace mla
