// The two consumer warpgroups, for 64 query rows per CTA. Consumer 0 computes S = Q K^T
// (64 x kBlockN), the online softmax and P; both then add P V into their half of O (64 x 256).
// They meet twice per tile on named barriers: kPReady (P and the row factors are in shared
// memory) and kPFree (consumer 1 is done reading them).
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>

#include "decode_common.cuh"
#include "numeric.cuh"
#include "producer.cuh"

namespace mla {

template <typename T, bool kFp8>
__device__ void consume(const DecodeParams& p, SharedStorage<T>& s, int head, int wg, int tid) {
  constexpr int kChunkBytes = kBlockN * kChunkCols * sizeof(T);
  const Fragment frag(tid);
  const QueryRow query_rows[2] = {QueryRow(p, frag.row, head), QueryRow(p, frag.row + 8, head)};
  // Descriptors advance by byte offset / 16; all offsets below are compile-time constants.
  // Stage 1's descriptors are stage 0's plus the stage size (both 1024-byte aligned).
  const uint64_t q_desc = k_major_desc(s.q), p_desc = k_major_desc(s.p);
  const uint64_t k_desc0 = k_major_desc(s.k[0]);
  const uint64_t v_desc0 = mn_major_desc(s.k[0] + wg * 4 * kBlockN * kChunkCols, kChunkBytes);
  constexpr uint64_t kStageStep = sizeof(s.k[0]) / 16;

  float o[128];              // this warpgroup's 64 x 256 slice of O
  float row_max[2], row_sum[2];  // consumer 0: running max (raw scores) and partial sum per row
  bool first_handoff = true;
  int j = 0;

  // FP8: consumer 1's thread 0 refills each stage once both consumers are done with it.
  const bool issues = kFp8 && wg == 1 && tid == 0;
  Fp8CopyIssuer<T> issuer(p, 0, 1);
  if (issues) {
    for (int i = 0; i < kStages; ++i) issuer.issue(p, s, head);
  }

  TileCursor tile(p, blockIdx.z);
  while (!tile.done()) {
    const Segment segment = tile.segment();
    if (wg == 0) {
      load_q(p, s.q, segment.batch, head, kBlockM, tid, 128);
      cutlass::arch::fence_view_async_shared();
      NamedBarrier::arrive_and_wait(128, kQReady);
    }
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;

    bool segment_done = false;
    while (!segment_done) {
      const int stage = j % kStages;
      const int first_token = tile.token;
      ClusterBarrier::wait(&s.k_full[stage], (j / kStages) & 1);
      const uint64_t attended = s.attended[stage];
      const uint64_t k_desc = k_desc0 + stage * kStageStep, v_desc = v_desc0 + stage * kStageStep;
      float factor[2];
      if (wg == 0) {
        float scores[kBlockN / 2];
        fence_accumulators(scores);
        cute::warpgroup_arrive();
#pragma unroll
        for (int k = 0; k < kHeadDim / 16; ++k) {
          constexpr int kStep = 16 * sizeof(T) / 16;  // 16 columns
          gmma<T, kBlockN, Major::K, Major::K>(q_desc + (k / 4) * (kBlockM * kChunkCols * sizeof(T) / 16) + (k % 4) * kStep,
                                     k_desc + (k / 4) * (kChunkBytes / 16) + (k % 4) * kStep, scores,
                                     k > 0);
        }
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<0>();
        fence_accumulators(scores);

        // Mask, then the online softmax in base 2.
        float tile_max[2] = {row_max[0], row_max[1]};
#pragma unroll
        for (int i = 0; i < kBlockN / 2; ++i) {
          const int half = (i % 4) / 2;
          const int col = (i / 4) * 8 + frag.col + (i % 2);
          const int last_visible = query_rows[half].last_visible(p, segment.seqlen);
          if (!((attended >> col) & 1) || first_token + col > last_visible) scores[i] = -INFINITY;
          tile_max[half] = fmaxf(tile_max[half], scores[i]);
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffff, tile_max[half], 1));
          tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffff, tile_max[half], 2));
          const float shift = tile_max[half] == -INFINITY ? 0.f : tile_max[half] * p.scale_log2;
          factor[half] = exp2f(row_max[half] * p.scale_log2 - shift);
          row_max[half] = tile_max[half];
          row_sum[half] *= factor[half];
          tile_max[half] = shift;
        }
        uint32_t probs[kBlockN / 4];
#pragma unroll
        for (int i = 0; i < kBlockN / 2; i += 2) {
          const int half = (i % 4) / 2;
          const float p0 = exp2f(fmaf(scores[i], p.scale_log2, -tile_max[half]));
          const float p1 = exp2f(fmaf(scores[i + 1], p.scale_log2, -tile_max[half]));
          row_sum[half] += p0 + p1;
          probs[i / 2] = pack2<T>(p0, p1);
        }

        if (!first_handoff) NamedBarrier::arrive_and_wait(kConsumerThreads, kPFree);
#pragma unroll
        for (int i = 0; i < kBlockN / 4; ++i) {
          const int row = frag.row + (i % 2) * 8, col = (i / 2) * 8 + frag.col;
          *reinterpret_cast<uint32_t*>(s.p + swizzled_offset(kBlockM, row, col)) = probs[i];
        }
        if (frag.col == 0) {
          s.row_factor[frag.row] = factor[0];
          s.row_factor[frag.row + 8] = factor[1];
        }
        cutlass::arch::fence_view_async_shared();
        NamedBarrier::arrive_and_wait(kConsumerThreads, kPReady);
      } else {
        if (attended != kAllRows) {
          zero_unattended_rows<T>(s.k[stage], attended, tid);
          cutlass::arch::fence_view_async_shared();
        }
        NamedBarrier::arrive_and_wait(kConsumerThreads, kPReady);
        factor[0] = s.row_factor[frag.row];
        factor[1] = s.row_factor[frag.row + 8];
      }
      first_handoff = false;

#pragma unroll
      for (int i = 0; i < 128; ++i) o[i] *= factor[(i % 4) / 2];
      fence_accumulators(o);
      cute::warpgroup_arrive();
#pragma unroll
      for (int k = 0; k < kBlockN / 16; ++k) {  // 16 tokens: 16 columns of P, 16 rows of V
        gmma<T, 256, Major::K, Major::MN>(p_desc + k * (16 * sizeof(T) / 16), v_desc + k * (16 * kChunkCols * sizeof(T) / 16),
                                o, true);
      }
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<0>();
      fence_accumulators(o);
      if (wg == 1) NamedBarrier::arrive(kConsumerThreads, kPFree);
      ClusterBarrier::arrive(&s.k_empty[stage]);
      if (issues) {
        ClusterBarrier::wait(&s.k_empty[stage], (j / kStages) & 1);
        issuer.issue(p, s, head);
      }

      ++j;
      segment_done = tile.last_in_segment();
      tile.advance();
    }

    // Epilogue: consumer 0 hands over 1 / rowsum, both write their half of O.
    float inverse[2], lse[2];
    if (wg == 0) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float sum = row_sum[half];
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        sum += __shfl_xor_sync(0xffffffff, sum, 2);
        inverse[half] = sum > 0.f ? 1.f / sum : 0.f;
        lse[half] = sum > 0.f ? row_max[half] * p.softmax_scale + logf(sum)
                              : (segment.split ? -INFINITY : INFINITY);
      }
      NamedBarrier::arrive_and_wait(kConsumerThreads, kPFree);
      if (frag.col == 0) {
        s.row_factor[frag.row] = inverse[0];
        s.row_factor[frag.row + 8] = inverse[1];
      }
      NamedBarrier::arrive_and_wait(kConsumerThreads, kPReady);
    } else {
      NamedBarrier::arrive_and_wait(kConsumerThreads, kPReady);
      inverse[0] = s.row_factor[frag.row];
      inverse[1] = s.row_factor[frag.row + 8];
      if (!segment.last) NamedBarrier::arrive(kConsumerThreads, kPFree);
    }

    const int rows = p.s_q * p.h_q;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const QueryRow& qr = query_rows[half];
      if (!qr.valid) continue;
      const int row = qr.index;
      const int col0 = wg * 256 + frag.col;
      if (segment.split) {
        float* out = p.out_accum + (int64_t(segment.slot) * rows + row) * kHeadDimV + col0;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
          *reinterpret_cast<float2*>(out + i * 8) =
              make_float2(o[i * 4 + half * 2] * inverse[half], o[i * 4 + half * 2 + 1] * inverse[half]);
        }
        if (wg == 0 && frag.col == 0) p.lse_accum[int64_t(segment.slot) * rows + row] = lse[half];
      } else {
        T* out = static_cast<T*>(p.out) + (int64_t(segment.batch) * rows + row) * kHeadDimV + col0;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
          *reinterpret_cast<uint32_t*>(out + i * 8) =
              pack2<T>(o[i * 4 + half * 2] * inverse[half], o[i * 4 + half * 2 + 1] * inverse[half]);
        }
        if (wg == 0 && frag.col == 0) {
          p.lse[(int64_t(segment.batch) * p.h_q + qr.h) * p.s_q + qr.s] = lse[half];
        }
      }
    }
  }
}

}  // namespace mla
