// Low-latency dispatch. Send: cast each token once into a message in the send area, put it to
// every chosen expert's receive slot, then tell every expert how many rows it got from us.
// Receive: per (local expert, source rank), wait for the count and copy the rows out.
//
// A message is [16-byte header: source token index, 3 ints unused][payload: hidden e4m3 or
// hidden bf16][fp8 only: hidden/128 fp32 scales].
#pragma once

#include <cuda_fp8.h>

#include "common.cuh"

namespace ep_comm::ll {

constexpr int kDispatchSendThreads = 512;
constexpr int kDispatchRecvThreads = 256;
constexpr int kScaleBlock = 128;
constexpr float kE4m3Max = 448.0f;

// The per-128-channel scale (what a value is multiplied by to get back the input), as
// per_token_cast_to_fp8 in low_latency.py computes it: amax floored at 1e-4, divided by 448;
// round_scale rounds it up to a power of two (exactly, from the bits, not with log2).
__device__ __forceinline__ float fp8_scale_inv(float amax, bool round_scale) {
  float scale_inv = fmaxf(amax, 1e-4f) / kE4m3Max;
  if (round_scale) {
    const uint32_t bits = __float_as_uint(scale_inv);
    const uint32_t exponent = (bits >> 23) + ((bits & 0x7fffffu) != 0);
    scale_inv = __uint_as_float(exponent << 23);
  }
  return scale_inv;
}

__device__ __forceinline__ int64_t payload_bytes(const LLDispatchParams& p) {
  return p.use_fp8 ? p.hidden + p.hidden / kScaleBlock * 4 : p.hidden * 2;
}

// Token t's message, written by the whole block: 8 channels per thread, a 128-channel group per
// 16 lanes (half a warp, so the amax reduction stays inside the warp).
__device__ inline void write_message(const LLDispatchParams& p, int t, uint8_t* msg) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int chunks = p.hidden / 8;
  const int4* row = reinterpret_cast<const int4*>(p.x + int64_t(t) * p.hidden);
  for (int base = warp * kWarpSize; base < chunks; base += num_warps * kWarpSize) {
    const int i = base + lane;
    const bool active = i < chunks;
    int4 packed = active ? __ldg(row + i) : make_int4(0, 0, 0, 0);
    if (!p.use_fp8) {
      if (active) reinterpret_cast<int4*>(msg + 16)[i] = packed;
      continue;
    }
    const uint16_t* halves = reinterpret_cast<const uint16_t*>(&packed);
    float v[8], amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      v[j] = bf16_to_float(halves[j]);
      amax = fmaxf(amax, fabsf(v[j]));
    }
#pragma unroll
    for (int offset = 8; offset >= 1; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    const float scale_inv = fp8_scale_inv(amax, p.round_scale);
    const float scale = 1.0f / scale_inv;
    uint32_t out[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float* q = v + 4 * j;
      const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(q[0] * scale, q[1] * scale), __NV_SATFINITE, __NV_E4M3);
      const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(q[2] * scale, q[3] * scale), __NV_SATFINITE, __NV_E4M3);
      out[j] = lo | (hi << 16);
    }
    if (!active) continue;
    reinterpret_cast<uint2*>(msg + 16)[i] = make_uint2(out[0], out[1]);
    if (i % (kScaleBlock / 8) == 0) reinterpret_cast<float*>(msg + 16 + p.hidden)[i / (kScaleBlock / 8)] = scale_inv;
  }
  if (threadIdx.x == 0) *reinterpret_cast<int4*>(msg) = make_int4(t, 0, 0, 0);
}

__global__ void __launch_bounds__(kDispatchSendThreads, 1) dispatch_send_kernel(const LLDispatchParams p) {
  const LLSlot& s = p.slot;
  const uint32_t use = load_volatile(s.use) + 1;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int R = s.num_ranks, experts_per_rank = p.num_experts / R;
  const int64_t message_used = 16 + payload_bytes(p);

  // Every destination must have finished reading this slot's previous use before we write it.
  __shared__ int acked;
  if (threadIdx.x == 0) acked = 1;
  __syncthreads();
  for (int r = threadIdx.x; r < R; r += blockDim.x)
    if (!wait_signal(s, kDispatchSend, r, -1, s.acks + r, [&](uint64_t v) { return acked_at_least(v, use - 1); })) acked = 0;
  __syncthreads();

  for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    uint8_t* msg = s.send + int64_t(t) * p.message_bytes;
    write_message(p, t, msg);
    __syncthreads();
    if (acked && warp < p.num_topk) {
      const int64_t e = p.topk_idx[int64_t(t) * p.num_topk + warp];
      if (e >= 0) {
        int index = 0;
        if (lane == 0) index = atomicAdd(p.expert_counters + e, 1);
        index = __shfl_sync(0xffffffffu, index, 0);
        const int dst = static_cast<int>(e / experts_per_rank), local = static_cast<int>(e % experts_per_rank);
        if (index < p.max_tokens) {  // a token choosing one expert twice could overflow it
          uint8_t* slot = s.recv + ((int64_t(local) * R + s.rank) * p.max_tokens + index) * p.message_bytes;
          nvshmemx_putmem_nbi_warp(slot, msg, message_used, dst);
        }
      }
    }
  }

  if (!last_block(s.done + kKernelDispatchSend)) return;
  if (threadIdx.x == 0) nvshmem_quiet();
  __syncthreads();
  const bool healthy = !buffer_failed(s);
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) {
    const int count = min(atomicExch(p.expert_counters + e, 0), p.max_tokens);
    const int dst = e / experts_per_rank, local = e % experts_per_rank;
    const uint64_t signal = (uint64_t(use) << 32) | uint64_t(count + 1);
    if (healthy) nvshmemx_signal_op(s.dispatch_counts + int64_t(local) * R + s.rank, signal, NVSHMEM_SIGNAL_SET, dst);
  }
  if (threadIdx.x == 0) *reinterpret_cast<volatile uint32_t*>(s.use) = use;
}

// Block b receives local expert b / R from source rank b % R.
__global__ void __launch_bounds__(kDispatchRecvThreads) dispatch_recv_kernel(const LLDispatchParams p) {
  const LLSlot& s = p.slot;
  const uint32_t use = load_volatile(s.use);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int R = s.num_ranks, experts_per_rank = p.num_experts / R;
  const int local = blockIdx.x / R, source = blockIdx.x % R;
  const int64_t rows_per_expert = int64_t(R) * p.max_tokens;
  const int groups = p.hidden / kScaleBlock;

  __shared__ int count, begin;
  if (threadIdx.x == 0) {
    uint64_t word = 0, waited = 0;
    uint64_t* signal = s.dispatch_counts + int64_t(local) * R + source;
    const bool ok = wait_signal(
        s, kDispatchRecv, source, s.rank * experts_per_rank + local, signal,
        [&](uint64_t v) {
          word = v;
          return (v >> 32) == use;
        },
        &waited);
    count = ok ? min(static_cast<int>(word & 0xffffffffu) - 1, p.max_tokens) : 0;
    begin = atomicAdd(p.recv_count + local, count);
    p.recv_layout_range[int64_t(local) * R + source] = (int64_t(begin) << 32) | count;
    if (p.cumulative_stats != nullptr) atomicAdd(p.cumulative_stats + local, count);
    if (p.wait_cost_stats != nullptr)
      atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_cost_stats + source), waited);
  }
  __syncthreads();

  const int64_t x_row_bytes = p.use_fp8 ? p.hidden : p.hidden * 2;
  for (int i = warp; i < count; i += num_warps) {
    const uint8_t* msg = s.recv + ((int64_t(local) * R + source) * p.max_tokens + i) * p.message_bytes;
    const int64_t row = int64_t(local) * rows_per_expert + begin + i;
    if (lane == 0) p.recv_src_info[row] = __ldcg(reinterpret_cast<const int*>(msg));
    warp_copy(static_cast<uint8_t*>(p.recv_x) + row * x_row_bytes, msg + 16, x_row_bytes, lane);
    if (!p.use_fp8) continue;
    const float* scales = reinterpret_cast<const float*>(msg + 16 + p.hidden);
    // Scales are stored token-major transposed: [E_local, groups, R*T].
    if (!p.use_ue8m0) {
      float* out = static_cast<float*>(p.recv_scales) + int64_t(local) * groups * rows_per_expert + begin + i;
      for (int g = lane; g < groups; g += kWarpSize) out[g * rows_per_expert] = __ldcg(scales + g);
    } else {
      int32_t* out = static_cast<int32_t*>(p.recv_scales) + int64_t(local) * (groups / 4) * rows_per_expert + begin + i;
      for (int g = lane; g < groups / 4; g += kWarpSize) {
        uint32_t packed = 0;
        for (int j = 0; j < 4; ++j) packed |= ((__float_as_uint(__ldcg(scales + 4 * g + j)) >> 23) & 0xffu) << (8 * j);
        out[g * rows_per_expert] = static_cast<int32_t>(packed);
      }
    }
  }

  if (!last_block(s.done + kKernelDispatchRecv)) return;
  for (int r = threadIdx.x; r < R; r += blockDim.x) nvshmemx_signal_op(s.acks + s.rank, use, NVSHMEM_SIGNAL_SET, r);
  if (!buffer_failed(s)) return;
  const int64_t rows = int64_t(experts_per_rank) * rows_per_expert;
  block_fill(p.recv_x, rows * x_row_bytes, p.use_fp8 ? kNaNE4m3x4 : kNaNBf16x2);
  if (p.use_fp8) block_fill(p.recv_scales, rows * (p.use_ue8m0 ? groups / 4 : groups) * 4, p.use_ue8m0 ? 0xffffffffu : kNaNFloat);
  if (threadIdx.x == 0) *s.error_flag = 1;
}

}  // namespace ep_comm::ll
