// The consumers of the kernel that dequantizes in registers (decode_kernel_fp8_registers.cuh):
// at most 16 query rows per KV head, an FP8 cache, and the products swapped as in
// consumer_narrow.cuh,
//     S^T = K Q^T   (64 x 16),   O^T += V^T P^T   (512 x 16, as 8 tiles of 64 x 16),
// but K and V^T, the A operands, go to the tensor cores from registers: the consumer converts
// the raw tile's e4m3 values times their scales to T (value * scale rounded to T, as the
// reference reads them) straight into wgmma's fragment layout (raw_tile_layout.h), four k-steps
// at a time while the tensor cores work on the four before. Each consumer takes every other
// tile, keeps its own softmax state, and writes its normalized piece and lse to out_accum, slot
// 2 * piece + consumer, which the combine kernel merges.
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>

#include "consumer_narrow.cuh"
#include "numeric.cuh"
#include "raw_ring.cuh"

namespace mla {

// The online softmax of a consumer warpgroup whose products have the tokens in M and the query
// rows (its "columns") in N: a column's 64 scores of a tile lie in 8 lanes of each of the 4
// warps, so its maxima and sums meet in shared memory (`maxima`, `sums`: [warp][kN] floats).
// (consume_narrow has the same steps inline; it stays as it was until this kernel replaces it.)
template <int kN>
struct NarrowSoftmax {
  static constexpr int kCols = kN / 4;  // query columns per thread: column(c) for c < kCols
  const int lane, warp, barrier;
  float* const maxima;
  float* const sums;
  int last_visible_offset[kCols];  // a column's last visible token is seqlen + this
  float col_max[kCols], col_sum[kCols];

  __device__ NarrowSoftmax(const DecodeParams& p, int head, int tid, int wg, float* maxima_, float* sums_)
      : lane(tid % 32), warp(tid / 32), barrier(kWarpgroupSync + wg), maxima(maxima_), sums(sums_) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      last_visible_offset[c] = p.causal ? QueryRow(p, column(c), head).s - p.s_q : kHeadDim * 1024 * 1024;
    }
  }

  __device__ int column(int c) const { return (c / 2) * 8 + (lane % 4) * 2 + c % 2; }

  __device__ void start() {
#pragma unroll
    for (int c = 0; c < kCols; ++c) col_max[c] = -INFINITY, col_sum[c] = 0.f;
  }

  // One tile's scores (scores[4 i + 2 half + e]: token tokens[half] of the tile, column(2 i + e))
  // masked and turned into P^T (columns `position` and + 8 for tokens[0] and [1]) in `sp`; the
  // state and O (o[m][4 i + 2 half + e]: column(2 i + e)) rescaled to the new maxima.
  template <typename T, int kVTiles>
  __device__ void tile(const DecodeParams& p, float (&scores)[kN / 2], const int (&tokens)[2], int position,
                       uint64_t attended, int first_token, int seqlen, T* sp, float (&o)[kVTiles][kN / 2]) {
    float tile_max[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) tile_max[c] = col_max[c];
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) {
      const int c = (i / 4) * 2 + i % 2, token = tokens[(i % 4) / 2];
      if (!((attended >> token) & 1) || first_token + token > seqlen + last_visible_offset[c]) scores[i] = -INFINITY;
      tile_max[c] = fmaxf(tile_max[c], scores[i]);
    }
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      tile_max[c] = max_over_token_lanes(tile_max[c]);
      if (lane < 4) maxima[warp * kN + column(c)] = tile_max[c];
    }
    NamedBarrier::arrive_and_wait(128, barrier);
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
      const int c = (i / 4) * 2 + i % 2;
      const float prob = exp2f(fmaf(scores[i], p.scale_log2, -shift[c]));
      col_sum[c] += prob;
      sp[swizzled_offset(kN, column(c), position + ((i % 4) / 2) * 8)] = from_float<T>(prob);
    }
#pragma unroll
    for (int m = 0; m < kVTiles; ++m)
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) o[m][i] *= factor[(i / 4) * 2 + i % 2];
  }

  // After a segment's last tile: each column's sum over the warpgroup, through `sums`.
  __device__ void exchange_sums() {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      col_sum[c] = sum_over_token_lanes(col_sum[c]);
      if (lane < 4) sums[warp * kN + column(c)] = col_sum[c];
    }
    NamedBarrier::arrive_and_wait(128, barrier);
  }

  __device__ float total(int c) const {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) sum += sums[w * kN + column(c)];
    return sum;
  }

  // This consumer's lse of column c (-inf if it saw no token).
  __device__ float lse(const DecodeParams& p, int c, float total) const {
    return total > 0.f ? col_max[c] * p.softmax_scale + logf(total) : -INFINITY;
  }
};

// Q's 16 rows of this CTA's query block (zeros past rows_per_kv), dim d in column
// raw_tile::q_column(d), by `thread` of `threads` cooperating threads.
template <typename T>
__device__ void load_q_by_columns(const DecodeParams& p, T* sq, int batch, int head, int thread, int threads) {
  constexpr int kPieces = kHeadDim / 8;
  const T* q = static_cast<const T*>(p.q);
#pragma unroll 2
  for (int i = thread; i < kNarrowRows * kPieces; i += threads) {
    const int row = i / kPieces, dim = i % kPieces * 8;
    const QueryRow qr(p, row, head);
    uint4 value = make_uint4(0, 0, 0, 0);
    if (qr.valid) {
      const int64_t offset = ((int64_t(batch) * p.s_q + qr.s) * p.h_q + qr.h) * kHeadDim + dim;
      value = __ldg(reinterpret_cast<const uint4*>(q + offset));
    }
    const uint32_t pairs[4] = {value.x, value.y, value.z, value.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // dims dim + 2 k and + 1 stay side by side
      const int col = raw_tile::q_column(dim + 2 * k);
      *reinterpret_cast<uint32_t*>(sq + swizzled_offset(kNarrowRows, row, col)) = pairs[k];
    }
  }
}

// Zero the latent values and scales of the rows of a raw tile not `attended`: they may hold NaN
// (past the sequence, or left from an earlier tile), and a zero probability times NaN is NaN.
__device__ inline void zero_unattended_raw_rows(uint8_t* raw, uint64_t attended, int tid) {  // by one warpgroup
  constexpr int kPieces = kHeadDimV / 16 + 1;  // the latent values' 16-byte pieces, then the scales
  for (int i = tid; i < kBlockN * kPieces; i += 128) {
    const int row = i / kPieces, piece = i % kPieces;
    if (!((attended >> row) & 1)) {
      const int offset =
          piece < kPieces - 1 ? raw_tile::latent_offset(row, piece * 16) : raw_tile::scale_offset(row, 0);
      *reinterpret_cast<uint4*>(raw + offset) = make_uint4(0, 0, 0, 0);
    }
  }
  cutlass::arch::fence_view_async_shared();  // ordered before the TMA engine refills the stage
}

// S^T = K Q^T for one raw tile: scores[4 i + 2 half + e] is S^T's row 16 warp + g + 8 half
// (token tokens[half]), query column 8 i + 2 t + e.
template <typename T>
__device__ __forceinline__ void key_times_q(const uint8_t* raw, const raw_tile::ThreadOffsets& at, uint64_t q_desc,
                                            float (&scores)[kNarrowRows / 2]) {
  constexpr int kQChunk = kNarrowRows * kChunkCols * sizeof(T) / 16;  // descriptor steps: a chunk of Q
  constexpr int kStep = 16 * sizeof(T) / 16;                          // 16 columns
  float scales[2][4];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float4 v = *reinterpret_cast<const float4*>(raw + at.key_scales(half));
    scales[half][0] = v.x, scales[half][1] = v.y, scales[half][2] = v.z, scales[half][3] = v.w;
  }
  fence_accumulators(scores);
#pragma unroll
  for (int group = 0; group < kHeadDim / 64; ++group) {  // k-steps 4 group .. 4 group + 3
    // values[half][2 s], [2 s + 1]: k-step 4 group + s, columns 2 t, + 1 and 2 t + 8, + 9
    uint32_t values[2][8];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (group < kHeadDimV / 64) {
        const uint4 bytes = *reinterpret_cast<const uint4*>(raw + at.key_latent(half, group));
        const uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
        const float scale = scales[half][group / 2];
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const float4 f = fp8x4_to_float4(words[s]);
          values[half][2 * s] = pack2<T>(f.x * scale, f.y * scale);
          values[half][2 * s + 1] = pack2<T>(f.z * scale, f.w * scale);
        }
      } else {
        const uint4 low = bf16x8_to<T>(*reinterpret_cast<const uint4*>(raw + at.key_rope(half, 0)));
        const uint4 high = bf16x8_to<T>(*reinterpret_cast<const uint4*>(raw + at.key_rope(half, 1)));
        const uint32_t words[8] = {low.x, low.y, low.z, low.w, high.x, high.y, high.z, high.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) values[half][k] = words[k];
      }
    }
#pragma unroll
    // Converted before the fence (else the compiler may move conversions past it, and ptxas then
    // inserts a fence before each product).
    for (int k = 0; k < 16; ++k) cute::warpgroup_fence_operand(values[k / 8][k % 8]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint32_t fragment[4] = {values[0][2 * s], values[1][2 * s], values[0][2 * s + 1], values[1][2 * s + 1]};
      gmma_rs<T, kNarrowRows>(fragment, q_desc + group * kQChunk + s * kStep, scores, group + s > 0);
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<1>();  // the previous four k-steps' registers are free again
  }
  cute::warpgroup_wait<0>();
  fence_accumulators(scores);
}

// O^T += V^T P^T for one raw tile: o[m][4 i + 2 half + e] is channel
// raw_tile::value_channel(warp, g, m, half), query column 8 i + 2 t + e. Arrives on `empty` as
// soon as the tile's last bytes are read.
template <typename T>
__device__ __forceinline__ void values_times_p(const uint8_t* raw, const raw_tile::ThreadOffsets& at, uint64_t p_desc,
                                               float (&o)[kHeadDimV / 64][kNarrowRows / 2], uint64_t* empty) {
  constexpr int kStep = 16 * sizeof(T) / 16;  // 16 columns of P^T
#pragma unroll
  for (int m = 0; m < kHeadDimV / 64; ++m) fence_accumulators(o[m]);
#pragma unroll
  for (int s = 0; s < kBlockN / 16; ++s) {  // P^T's columns 16 s .. 16 s + 15
    uint4 bytes[4];  // [k]: this thread's 16 channels of the token of column 16 s + 2 t + k % 2 + 8 (k / 2)
    float scale[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      bytes[k] = *reinterpret_cast<const uint4*>(raw + at.value_latent(s, k));
      scale[k] = *reinterpret_cast<const float*>(raw + at.value_scale(s, k));
    }
    if (s == kBlockN / 16 - 1) arrive_after_reads(empty);
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // channels 8 half .. 8 half + 7: tiles 4 half .. 4 half + 3
      float v[4][8];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t words[2] = {half ? bytes[k].z : bytes[k].x, half ? bytes[k].w : bytes[k].y};
#pragma unroll
        for (int w = 0; w < 2; ++w) {
          const float4 f = fp8x4_to_float4(words[w]);
          v[k][4 * w] = f.x * scale[k], v[k][4 * w + 1] = f.y * scale[k];
          v[k][4 * w + 2] = f.z * scale[k], v[k][4 * w + 3] = f.w * scale[k];
        }
      }
      uint32_t fragments[4][4];
#pragma unroll
      for (int mm = 0; mm < 4; ++mm) {
        const int c = 2 * mm;
        const uint32_t fragment[4] = {pack2<T>(v[0][c], v[1][c]), pack2<T>(v[0][c + 1], v[1][c + 1]),
                                      pack2<T>(v[2][c], v[3][c]), pack2<T>(v[2][c + 1], v[3][c + 1])};
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          fragments[mm][r] = fragment[r];
          cute::warpgroup_fence_operand(fragments[mm][r]);  // as in key_times_q
        }
      }
      cute::warpgroup_arrive();
#pragma unroll
      for (int mm = 0; mm < 4; ++mm) gmma_rs<T, kNarrowRows>(fragments[mm], p_desc + s * kStep, o[4 * half + mm], true);
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<1>();
    }
  }
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int m = 0; m < kHeadDimV / 64; ++m) fence_accumulators(o[m]);
}

template <typename T>
__device__ void consume_raw_tiles(const DecodeParams& p, RawRingStorage<T>& s, int head, int wg, int tid) {
  constexpr int kN = kNarrowRows;
  constexpr int kVTiles = kHeadDimV / 64;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4;
  const int row = warp * 16 + g;  // S^T's rows row and row + 8, P^T's columns alike
  const int tokens[2] = {raw_tile::token_of(row), raw_tile::token_of(row + 8)};
  const raw_tile::ThreadOffsets at(warp, lane);
  NarrowSoftmax<kN> softmax(p, head, tid, wg, s.maxima[wg][0], s.sums[wg][0]);
  T* sp = s.p[wg];
  const uint64_t q_desc = k_major_desc(s.q), p_desc = k_major_desc(sp);

  float o[kVTiles][kN / 2];
  int j = 0;
  TileCursor tile(p, blockIdx.z);
  while (!tile.done()) {
    const Segment segment = tile.segment();
    NamedBarrier::arrive_and_wait(kConsumerThreads, kQFree);
    load_q_by_columns(p, s.q, segment.batch, head, tid + 128 * wg, kConsumerThreads);
    cutlass::arch::fence_view_async_shared();
    NamedBarrier::arrive_and_wait(kConsumerThreads, kQReady);
#pragma unroll
    for (int m = 0; m < kVTiles; ++m)
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) o[m][i] = 0.f;
    softmax.start();

    bool segment_done = false;
    while (!segment_done) {
      if (j % 2 == wg) {
        const int stage = j % kRawStages, first_token = tile.token;
        wait_then_read(&s.full[stage], (j / kRawStages) & 1);
        const uint64_t attended = s.attended[stage];
        uint8_t* raw = s.stage[stage];
        float scores[kN / 2];
        key_times_q<T>(raw, at, q_desc, scores);
        if (attended != kAllRows) zero_unattended_raw_rows(raw, attended, tid);
        softmax.tile(p, scores, tokens, row, attended, first_token, segment.seqlen, sp, o);
        cutlass::arch::fence_view_async_shared();
        NamedBarrier::arrive_and_wait(128, kWarpgroupSync + wg);  // P^T and zeroed rows are complete
        values_times_p<T>(raw, at, p_desc, o, &s.empty[stage]);
      }
      ++j;
      segment_done = tile.last_in_segment();
      tile.advance();
    }

    // Epilogue: this consumer's piece, normalized, and its lse (-inf if it saw no token); a
    // thread's 16 channels are contiguous.
    softmax.exchange_sums();
    const int rows = p.s_q * p.h_q;
    const int64_t slot = 2 * int64_t(segment.slot) + wg;
#pragma unroll
    for (int c = 0; c < NarrowSoftmax<kN>::kCols; ++c) {
      const float total = softmax.total(c);
      const float inverse = total > 0.f ? 1.f / total : 0.f;
      const QueryRow query(p, softmax.column(c), head);
      if (!query.valid) continue;
      float* out = p.out_accum + (slot * rows + query.index) * kHeadDimV + raw_tile::value_channel(warp, g, 0, 0);
      const int i = (c / 2) * 4 + c % 2;  // o[m][i], o[m][i + 2]: channels 2 m and 2 m + 1 of the 16
#pragma unroll
      for (int m = 0; m < kVTiles; m += 2) {
        *reinterpret_cast<float4*>(out + 2 * m) = make_float4(o[m][i] * inverse, o[m][i + 2] * inverse,
                                                              o[m + 1][i] * inverse, o[m + 1][i + 2] * inverse);
      }
      if (warp == 0 && lane < 4) p.lse_accum[slot * rows + query.index] = softmax.lse(p, c, total);
    }
  }
}

}  // namespace mla
