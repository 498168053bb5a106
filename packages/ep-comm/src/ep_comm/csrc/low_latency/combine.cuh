// Low-latency combine. Send: every row a local expert produced goes back to its source rank's
// receive area, at [global expert][source token]; then a flag per expert tells each rank that
// all of that expert's rows for it have landed. Receive: per token, wait for the flags of its
// experts and sum the k rows in k order in fp32.
#pragma once

#include "common.cuh"

namespace ep_comm::ll {

constexpr int kCombineSendThreads = 256;
constexpr int kCombineRecvThreads = 256;

// Block b sends local expert b / R's rows for rank b % R.
__global__ void __launch_bounds__(kCombineSendThreads) combine_send_kernel(const LLCombineParams p) {
  const LLSlot& s = p.slot;
  const uint32_t use = load_volatile(s.use) + 1;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int R = s.num_ranks, experts_per_rank = p.num_experts / R;
  const int local = blockIdx.x / R, dst = blockIdx.x % R;
  const int64_t rows_per_expert = int64_t(R) * p.max_tokens, row_bytes = int64_t(p.hidden) * 2;

  __shared__ int acked;
  if (threadIdx.x == 0)
    acked = wait_signal(s, kCombineSend, dst, s.rank * experts_per_rank + local, s.acks + dst,
                        [&](uint64_t v) { return acked_at_least(v, use - 1); });
  __syncthreads();

  const int64_t range = p.layout_range[int64_t(local) * R + dst];
  const int begin = static_cast<int>(range >> 32), count = static_cast<int>(range & 0xffffffff);
  const int64_t expert = int64_t(s.rank) * experts_per_rank + local;
  for (int i = warp; i < count; i += num_warps) {
    const int64_t row = int64_t(local) * rows_per_expert + begin + i;
    uint8_t* staged = s.send + row * row_bytes;
    if (!p.zero_copy) {
      warp_copy(staged, reinterpret_cast<const uint8_t*>(p.x + row * p.hidden), row_bytes, lane);
      __syncwarp();
    }
    const int token = __ldg(p.src_info + row);
    if (acked) nvshmemx_putmem_nbi_warp(s.recv + (expert * p.max_tokens + token) * row_bytes, staged, row_bytes, dst);
  }

  if (!last_block(s.done + kKernelCombineSend)) return;
  if (threadIdx.x == 0) nvshmem_quiet();
  __syncthreads();
  const bool healthy = !buffer_failed(s);
  for (int i = threadIdx.x; i < experts_per_rank * R; i += blockDim.x) {
    const int e = s.rank * experts_per_rank + i / R, to = i % R;
    if (healthy) nvshmemx_signal_op(s.combine_flags + e, use, NVSHMEM_SIGNAL_SET, to);
  }
  if (threadIdx.x == 0) *reinterpret_cast<volatile uint32_t*>(s.use) = use;
}

// Block t combines token t (one block when there are no tokens: the last block acks).
__global__ void __launch_bounds__(kCombineRecvThreads) combine_recv_kernel(const LLCombineParams p) {
  const LLSlot& s = p.slot;
  const uint32_t use = load_volatile(s.use);
  const int R = s.num_ranks, experts_per_rank = p.num_experts / R;
  const int t = blockIdx.x;
  const int64_t row_bytes = int64_t(p.hidden) * 2;

  __shared__ int arrived;
  if (threadIdx.x == 0) {
    arrived = 1;
    for (int k = 0; t < p.num_tokens && k < p.num_topk; ++k) {
      const int64_t e = p.topk_idx[int64_t(t) * p.num_topk + k];
      if (e < 0) continue;
      const int owner = static_cast<int>(e / experts_per_rank);
      uint64_t waited = 0;
      if (!wait_signal(s, kCombineRecv, owner, static_cast<int>(e), s.combine_flags + e,
                       [&](uint64_t v) { return v == use; }, &waited)) {
        arrived = 0;
        break;
      }
      if (p.wait_cost_stats != nullptr)
        atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_cost_stats + owner), waited);
    }
  }
  __syncthreads();

  // out[t] = bf16(sum over k in order of w * row), each product and sum rounded separately
  // (no fused multiply-add), as the fp32 reference computes it.
  for (int c = threadIdx.x; arrived && t < p.num_tokens && c < p.hidden / 8; c += blockDim.x) {
    float acc[8] = {};
    for (int k = 0; k < p.num_topk; ++k) {
      const int64_t e = p.topk_idx[int64_t(t) * p.num_topk + k];
      if (e < 0) continue;
      const float w = p.topk_weights[int64_t(t) * p.num_topk + k];
      const int4 packed = __ldcg(reinterpret_cast<const int4*>(s.recv + (e * p.max_tokens + t) * row_bytes) + c);
      const uint16_t* halves = reinterpret_cast<const uint16_t*>(&packed);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(w, bf16_to_float(halves[j])));
    }
    uint16_t result[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) result[j] = float_to_bf16(acc[j]);
    reinterpret_cast<int4*>(p.out + int64_t(t) * p.hidden)[c] = *reinterpret_cast<const int4*>(result);
  }

  if (!last_block(s.done + kKernelCombineRecv)) return;
  for (int r = threadIdx.x; r < R; r += blockDim.x) nvshmemx_signal_op(s.acks + s.rank, use, NVSHMEM_SIGNAL_SET, r);
  if (!buffer_failed(s)) return;
  block_fill(p.out, int64_t(p.num_tokens) * row_bytes, kNaNBf16x2);
  if (threadIdx.x == 0) *s.error_flag = 1;
}

}  // namespace ep_comm::ll
