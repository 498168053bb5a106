// The consumers for at most kN = 16 query rows per KV head (s_q * h_q / h_kv <= 16) with an
// FP8 cache. Padding those rows to the 64 rows of a wgmma makes the tile's products
// slower than the FP8 tile's memory time, so the products are swapped: the 64 tokens of a
// tile are the M dimension and the query rows the N dimension,
//     S^T = K Q^T   (64 x kN),   O^T += V^T P^T   (512 x kN, as 8 tiles of 64 x kN).
// Each consumer takes every other tile (the one in its own ring stage), refills that stage
// itself, and keeps its own softmax state; both write their normalized piece and its lse to
// out_accum, slot 2 * piece + consumer, and the combine kernel merges them.
// (With a 16-bit cache the 64-row consumers are as fast: that kernel is memory-bound.)
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>

#include "decode_common.cuh"
#include "numeric.cuh"
#include "producer.cuh"

namespace mla {

__device__ __forceinline__ float max_over_token_lanes(float v) {  // lanes sharing lane % 4
  v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, 4));
  v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, 8));
  return fmaxf(v, __shfl_xor_sync(0xffffffff, v, 16));
}

__device__ __forceinline__ float sum_over_token_lanes(float v) {
  v += __shfl_xor_sync(0xffffffff, v, 4);
  v += __shfl_xor_sync(0xffffffff, v, 8);
  return v + __shfl_xor_sync(0xffffffff, v, 16);
}

template <typename T, int kN>
__device__ void consume_narrow(const DecodeParams& p, SharedStorage<T>& s, int head, int wg, int tid) {
  constexpr int kChunkBytes = kBlockN * kChunkCols * sizeof(T);
  constexpr int kCols = kN / 4;  // query columns per thread: 8 * (c / 2) + 2 * (lane % 4) + c % 2
  constexpr int kVTiles = kHeadDimV / 64;
  const int warp = tid / 32, lane = tid % 32;
  const int row = warp * 16 + lane / 4;  // accumulator rows row and row + 8: tokens, or latent dims
  auto column = [lane](int c) { return (c / 2) * 8 + (lane % 4) * 2 + c % 2; };
  int last_visible_offset[kCols];  // a column's last visible token is seqlen + this
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    last_visible_offset[c] = p.causal ? QueryRow(p, column(c), head).s - p.s_q : kHeadDim * 1024 * 1024;
  }
  // Q rows kN..63 are never read here: their first chunk holds the cross-warp exchanges,
  // [consumer][warp][kN] tile maxima, then [consumer][warp][kN] sums.
  float* exchange = reinterpret_cast<float*>(s.q + 32 * kChunkCols);
  float* maxima = exchange + wg * 4 * kN;
  float* sums = exchange + (2 + wg) * 4 * kN;
  T* sp = s.p + wg * 32 * kChunkCols;  // P^T: kN query rows x 64 tokens

  const uint64_t q_desc = k_major_desc(s.q), p_desc = k_major_desc(sp);
  // This consumer's stage is fixed (its index), so its descriptors are built once: the
  // products then read them from uniform registers without per-product moves.
  const uint64_t k_desc = k_major_desc(s.k[wg]), v_desc = mn_major_desc(s.k[wg], kChunkBytes);
  constexpr int kStep = 16 * sizeof(T) / 16;  // 16 columns of a K-major operand

  float o[kVTiles][kN / 2];
  float col_max[kCols], col_sum[kCols];
  Fp8CopyIssuer<T> issuer(p, wg, kStages);
  if (tid == 0) issuer.issue(p, s, head);
  int j = 0;
  TileCursor tile(p, blockIdx.z);
  while (!tile.done()) {
    const Segment segment = tile.segment();
    NamedBarrier::arrive_and_wait(kConsumerThreads, kQFree);
    load_q(p, s.q, segment.batch, head, kN, tid + 128 * wg, kConsumerThreads);
    cutlass::arch::fence_view_async_shared();
    NamedBarrier::arrive_and_wait(kConsumerThreads, kQReady);
#pragma unroll
    for (int m = 0; m < kVTiles; ++m)
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) o[m][i] = 0.f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) col_max[c] = -INFINITY, col_sum[c] = 0.f;

    bool segment_done = false;
    while (!segment_done) {
      const int stage = j % kStages;
      if (stage == wg) {
        const int first_token = tile.token;
        ClusterBarrier::wait(&s.k_full[stage], (j / kStages) & 1);
        const uint64_t attended = s.attended[stage];
        if (attended != kAllRows) zero_unattended_rows<T>(s.k[stage], attended, tid);

        float scores[kN / 2];  // scores[4 i + 2 half + e]: token row + 8 half, query column 2 i + e
        fence_accumulators(scores);
        cute::warpgroup_arrive();
#pragma unroll
        for (int k = 0; k < kHeadDim / 16; ++k) {
          gmma<T, kN, Major::K, Major::K>(k_desc + (k / 4) * (kChunkBytes / 16) + (k % 4) * kStep,
                                          q_desc + (k / 4) * (kBlockM * kChunkCols * sizeof(T) / 16) + (k % 4) * kStep,
                                          scores, k > 0);
        }
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<0>();
        fence_accumulators(scores);

        float tile_max[kCols];
#pragma unroll
        for (int c = 0; c < kCols; ++c) tile_max[c] = col_max[c];
#pragma unroll
        for (int i = 0; i < kN / 2; ++i) {
          const int c = (i / 4) * 2 + i % 2, token = row + ((i % 4) / 2) * 8;
          if (!((attended >> token) & 1) || first_token + token > segment.seqlen + last_visible_offset[c])
            scores[i] = -INFINITY;
          tile_max[c] = fmaxf(tile_max[c], scores[i]);
        }
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          tile_max[c] = max_over_token_lanes(tile_max[c]);
          if (lane < 4) maxima[warp * kN + column(c)] = tile_max[c];
        }
        NamedBarrier::arrive_and_wait(128, kWarpgroupSync + wg);
        float factor[kCols], shift[kCols];
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
#pragma unroll
          for (int w = 0; w < 4; ++w) tile_max[c] = fmaxf(tile_max[c], maxima[w * kN + column(c)]);
          shift[c] = tile_max[c] == -INFINITY ? 0.f : tile_max[c] * p.scale_log2;
          factor[c] = exp2f(col_max[c] * p.scale_log2 - shift[c]);
          col_max[c] = tile_max[c];
          col_sum[c] *= factor[c];
        }
#pragma unroll
        for (int i = 0; i < kN / 2; ++i) {
          const int c = (i / 4) * 2 + i % 2, token = row + ((i % 4) / 2) * 8;
          const float prob = exp2f(fmaf(scores[i], p.scale_log2, -shift[c]));
          col_sum[c] += prob;
          sp[swizzled_offset(kBlockM, column(c), token)] = from_float<T>(prob);
        }
#pragma unroll
        for (int m = 0; m < kVTiles; ++m)
#pragma unroll
          for (int i = 0; i < kN / 2; ++i) o[m][i] *= factor[(i / 4) * 2 + i % 2];
        cutlass::arch::fence_view_async_shared();
        NamedBarrier::arrive_and_wait(128, kWarpgroupSync + wg);  // P^T and zeroed rows are complete

#pragma unroll
        for (int m = 0; m < kVTiles; ++m) fence_accumulators(o[m]);
        cute::warpgroup_arrive();
#pragma unroll
        for (int m = 0; m < kVTiles; ++m) {
#pragma unroll
          for (int k = 0; k < kBlockN / 16; ++k) {  // 16 tokens: 16 rows of V, 16 columns of P^T
            gmma<T, kN, Major::MN, Major::K>(v_desc + m * (kChunkBytes / 16) + k * (16 * kChunkCols * sizeof(T) / 16),
                                             p_desc + k * kStep, o[m], true);
          }
        }
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<0>();
#pragma unroll
        for (int m = 0; m < kVTiles; ++m) fence_accumulators(o[m]);
        NamedBarrier::arrive_and_wait(128, kWarpgroupSync + wg);  // the stage is read
        if (tid == 0) issuer.issue(p, s, head);
      }
      ++j;
      segment_done = tile.last_in_segment();
      tile.advance();
    }

    // Epilogue: this consumer's piece, normalized, and its lse (-inf if it saw no token).
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      col_sum[c] = sum_over_token_lanes(col_sum[c]);
      if (lane < 4) sums[warp * kN + column(c)] = col_sum[c];
    }
    NamedBarrier::arrive_and_wait(128, kWarpgroupSync + wg);
    const int rows = p.s_q * p.h_q;
    const int64_t slot = 2 * int64_t(segment.slot) + wg;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < 4; ++w) total += sums[w * kN + column(c)];
      const float inverse = total > 0.f ? 1.f / total : 0.f;
      const QueryRow query(p, column(c), head);
      if (!query.valid) continue;
      float* out = p.out_accum + (slot * rows + query.index) * kHeadDimV;
#pragma unroll
      for (int m = 0; m < kVTiles; ++m) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          out[m * 64 + row + half * 8] = o[m][(c / 2) * 4 + half * 2 + c % 2] * inverse;
        }
      }
      if (warp == 0 && lane < 4) {
        p.lse_accum[slot * rows + query.index] = total > 0.f ? col_max[c] * p.softmax_scale + logf(total) : -INFINITY;
      }
    }
  }
}

}  // namespace mla
