// Split-KV MLA decode attention for sm_90a.
//
// Grid: (query-row blocks of 64, KV heads, scheduler partitions). Each CTA walks the KV tiles
// of its partition (tile_cursor.cuh) for its 64 query rows with three warpgroups:
//
//   producer   fills a two-stage ring of K tiles: TMA straight into the swizzled tile (bf16/fp16
//              cache), or TMA into a staging ring of raw FP8 tokens that its 128 threads then
//              dequantize into the tile (FP8 cache).
//   consumer 0 S = Q K^T (wgmma, 64 x kBlockN x 576), online softmax, P to shared memory,
//              then O[:, 0:256] += P V[:, 0:256].
//   consumer 1 O[:, 256:512] += P V[:, 256:512] with the row rescale consumer 0 hands over.
//
// The two consumers meet twice per tile on named barriers: kPReady (P and the row factors are
// in shared memory) and kPFree (consumer 1 is done reading them). A sequence the scheduler
// split across partitions is written as normalized fp32 pieces plus their lse, which
// combine_kernel.cuh merges; an unsplit one goes straight to `out`.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <climits>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "gmma.cuh"
#include "numeric.cuh"
#include "params.h"
#include "smem_layout.cuh"
#include "tile_cursor.cuh"

namespace mla {

using cutlass::arch::ClusterBarrier;
using cutlass::arch::ClusterTransactionBarrier;
using cutlass::arch::NamedBarrier;

constexpr int kThreads = 384;
constexpr int kConsumerThreads = 256;
constexpr int kStages = 2;
constexpr int kStagingStages = 3;
constexpr uint64_t kCacheHint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);

enum NamedBarriers : uint32_t { kQReady = 1, kPReady = 2, kPFree = 3, kStagingRead = 4 };

template <typename T, bool kFp8>
struct SharedStorage {
  static constexpr int kBlockN = block_n<kFp8>();
  T q[kBlockM * kHeadDim];
  T k[kStages][kBlockN * kHeadDim];
  T p[kBlockM * kChunkCols];  // only the first kBlockN columns are used
  alignas(128) uint8_t staging[kFp8 ? kStagingStages : 1][kFp8 ? kBlockN * kFp8TokenBytes : 128];
  float row_factor[kBlockM];
  uint64_t k_full[kStages], k_empty[kStages], staging_full[kStagingStages];
};

template <typename T, bool kFp8>
constexpr int shared_bytes() {
  return sizeof(SharedStorage<T, kFp8>) + 1024;  // room to align the start to 1024 bytes
}

template <typename T, bool kFp8>
__device__ __forceinline__ SharedStorage<T, kFp8>& shared_storage() {
  extern __shared__ uint8_t smem[];
  const uint32_t misalignment = smem_address(smem) % 1024;
  return *reinterpret_cast<SharedStorage<T, kFp8>*>(smem + (misalignment ? 1024 - misalignment : 0));
}

// ---------------------------------------------------------------------------------------------
// Producer

// The cache slot (row of the tensor map) holding token `token` of sequence `batch`; -1, which
// the TMA engine reads as zeros, for a page index past the block table.
__device__ __forceinline__ int cache_row(const DecodeParams& p, int batch, int token) {
  const int page = token / p.page_size;
  if (page >= p.max_blocks_per_seq) return -1;
  const int block = __ldg(p.block_table + batch * p.max_blocks_per_seq + page);
  return block * p.page_size + token % p.page_size;
}

// Issue the TMA copies of one tile (whole pages, or whole tile-sized pieces of a page) and
// arm `barrier` with the bytes they will deliver. `row_bytes` is one token's size in the box.
template <int kBlockN, int kColumnBoxes>
__device__ __forceinline__ void load_tile(const DecodeParams& p, const TileCursor<kBlockN>& tile,
                                          int head, uint64_t* barrier, uint8_t* dst,
                                          int box_bytes_per_row, int column_box_stride) {
  const int box_rows = min(p.page_size, kBlockN);
  const int boxes = (tile.length() + box_rows - 1) / box_rows;
  ClusterTransactionBarrier::arrive_and_expect_tx(barrier, boxes * box_rows * box_bytes_per_row);
  for (int i = 0; i < boxes; ++i) {
    const int row = cache_row(p, tile.batch, tile.token + i * box_rows);
#pragma unroll
    for (int j = 0; j < kColumnBoxes; ++j) {
      cute::SM90_TMA_LOAD_3D::copy(&p.kv_tensor_map, barrier, kCacheHint,
                                   dst + j * column_box_stride + i * box_rows * (box_bytes_per_row / kColumnBoxes),
                                   j * kChunkCols, head, row);
    }
  }
}

template <typename T>
__device__ void produce_direct(const DecodeParams& p, SharedStorage<T, false>& s, int head) {
  constexpr int kBlockN = block_n<false>();
  int j = 0;
  for (TileCursor<kBlockN> tile(p, blockIdx.z); !tile.done(); tile.advance(), ++j) {
    const int stage = j % kStages;
    ClusterBarrier::wait(&s.k_empty[stage], ((j / kStages) & 1) ^ 1);
    load_tile<kBlockN, kHeadDim / kChunkCols>(p, tile, head, &s.k_full[stage],
                                               reinterpret_cast<uint8_t*>(s.k[stage]),
                                               kHeadDim * sizeof(T), kBlockN * kChunkCols * sizeof(T));
  }
}

// One FP8-layout token row of the staging buffer into the swizzled 16-bit tile, 8 columns per
// thread-step; rows at or past `length` become zeros (the slots past a sequence may hold NaN).
template <typename T, int kBlockN>
__device__ __forceinline__ void dequantize_tile(const uint8_t* staging, T* tile, int length, int tid) {
  constexpr int kPieces = kHeadDim / 8;  // 64 latent pieces of 8 values, then 8 rope pieces
#pragma unroll 2
  for (int i = tid; i < kBlockN * kPieces; i += 128) {
    const int row = i / kPieces, piece = i % kPieces;
    const uint8_t* token = staging + row * kFp8TokenBytes;
    uint4 packed = make_uint4(0, 0, 0, 0);
    if (row < length) {
      if (piece < kHeadDimV / 8) {
        const float scale = reinterpret_cast<const float*>(token + kHeadDimV)[piece / 16];
        packed = fp8x8_to<T>(*reinterpret_cast<const uint2*>(token + piece * 8), scale);
      } else {
        packed = bf16x8_to<T>(*reinterpret_cast<const uint4*>(token + kFp8TokenBytes - 128 + (piece - 64) * 16));
      }
    }
    *reinterpret_cast<uint4*>(tile + swizzled_offset(kBlockN, row, piece * 8)) = packed;
  }
}

template <typename T>
__device__ void produce_dequantized(const DecodeParams& p, SharedStorage<T, true>& s, int head, int tid) {
  constexpr int kBlockN = block_n<true>();
  TileCursor<kBlockN> ahead(p, blockIdx.z);
  auto issue = [&](int slot) {
    load_tile<kBlockN, 1>(p, ahead, head, &s.staging_full[slot], s.staging[slot], kFp8TokenBytes, 0);
    ahead.advance();
  };
  if (tid == 0) {
    for (int slot = 0; slot < kStagingStages && !ahead.done(); ++slot) issue(slot);
  }
  int j = 0;
  for (TileCursor<kBlockN> tile(p, blockIdx.z); !tile.done(); tile.advance(), ++j) {
    const int slot = j % kStagingStages, stage = j % kStages;
    ClusterBarrier::wait(&s.staging_full[slot], (j / kStagingStages) & 1);
    ClusterBarrier::wait(&s.k_empty[stage], ((j / kStages) & 1) ^ 1);
    dequantize_tile<T, kBlockN>(s.staging[slot], s.k[stage], tile.length(), tid);
    cutlass::arch::fence_view_async_shared();  // the tensor cores read what plain stores wrote
    ClusterBarrier::arrive(&s.k_full[stage]);
    NamedBarrier::arrive_and_wait(128, kStagingRead);
    if (tid == 0 && !ahead.done()) issue(slot);
  }
}

// ---------------------------------------------------------------------------------------------
// Consumers

// Where the accumulator fragments of a thread lie: rows `row` and `row + 8`, columns
// 8 * i + col and + 1 for each 8-column group i (the wgmma register layout).
struct Fragment {
  int row, col;
  __device__ explicit Fragment(int tid) : row((tid / 32) * 16 + (tid % 32) / 4), col((tid % 4) * 2) {}
};

// The (query position, head) a row of this CTA's query block stands for; valid is false for
// the padding rows past rows_per_kv.
struct QueryRow {
  int s, h;
  bool valid;
  __device__ QueryRow(const DecodeParams& p, int row, int head) {
    const int r = blockIdx.x * kBlockM + row;
    valid = r < p.rows_per_kv;
    s = r / p.heads_per_kv;
    h = head * p.heads_per_kv + r % p.heads_per_kv;
  }
};

template <typename T>
__device__ void load_q(const DecodeParams& p, T* sq, int batch, int head, int tid) {
  constexpr int kPieces = kHeadDim / 8;
  const T* q = static_cast<const T*>(p.q);
#pragma unroll 4
  for (int i = tid; i < kBlockM * kPieces; i += 128) {
    const int row = i / kPieces, piece = i % kPieces;
    const QueryRow qr(p, row, head);
    uint4 value = make_uint4(0, 0, 0, 0);
    if (qr.valid) {
      const int64_t offset = ((int64_t(batch) * p.s_q + qr.s) * p.h_q + qr.h) * kHeadDim + piece * 8;
      value = __ldg(reinterpret_cast<const uint4*>(q + offset));
    }
    *reinterpret_cast<uint4*>(sq + swizzled_offset(kBlockM, row, piece * 8)) = value;
  }
}

// Zero V's columns of the rows at or past `length` of a TMA-filled tile: those slots may hold
// NaN, and a zero probability times NaN is NaN.
template <typename T, int kBlockN>
__device__ void zero_tail_rows(T* tile, int length, int tid) {
  constexpr int kPieces = kHeadDimV / 8;
  for (int i = tid; i < (kBlockN - length) * kPieces; i += 128) {
    const int row = length + i / kPieces, piece = i % kPieces;
    *reinterpret_cast<uint4*>(tile + swizzled_offset(kBlockN, row, piece * 8)) = make_uint4(0, 0, 0, 0);
  }
}

template <typename T, bool kFp8>
__device__ void consume(const DecodeParams& p, SharedStorage<T, kFp8>& s, int head, int wg, int tid) {
  constexpr int kBlockN = block_n<kFp8>();
  constexpr int kChunkBytes = kBlockN * kChunkCols * sizeof(T);
  const Fragment frag(tid);
  const QueryRow query_rows[2] = {QueryRow(p, frag.row, head), QueryRow(p, frag.row + 8, head)};

  float o[128];              // this warpgroup's 64 x 256 slice of O
  float row_max[2], row_sum[2];  // consumer 0: running max (raw scores) and partial sum per row
  bool first_handoff = true;
  int j = 0;

  TileCursor<kBlockN> tile(p, blockIdx.z);
  while (!tile.done()) {
    const Segment segment = tile.segment();
    if (wg == 0) {
      load_q(p, s.q, segment.batch, head, tid);
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
      const int length = tile.length(), first_token = tile.token;
      ClusterBarrier::wait(&s.k_full[stage], (j / kStages) & 1);
      float factor[2];
      if (wg == 0) {
        float scores[kBlockN / 2];
        fence_accumulators(scores);
        cute::warpgroup_arrive();
#pragma unroll
        for (int k = 0; k < kHeadDim / 16; ++k) {
          gmma<T, kBlockN, Major::K>(k_major_desc(s.q + (k / 4) * kBlockM * kChunkCols + (k % 4) * 16),
                                     k_major_desc(s.k[stage] + (k / 4) * kBlockN * kChunkCols + (k % 4) * 16),
                                     scores, k > 0);
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
          const int last_visible = p.causal ? segment.seqlen - p.s_q + query_rows[half].s : INT_MAX;
          if (col >= length || first_token + col > last_visible) scores[i] = -INFINITY;
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
        if (!kFp8 && length < kBlockN) {
          zero_tail_rows<T, kBlockN>(s.k[stage], length, tid);
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
      for (int k = 0; k < kBlockN / 16; ++k) {
        gmma<T, 256, Major::MN>(k_major_desc(s.p + k * 16),
                                mn_major_desc(s.k[stage] + (wg * 4) * kBlockN * kChunkCols + k * 16 * kChunkCols,
                                              kChunkBytes),
                                o, true);
      }
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<0>();
      fence_accumulators(o);
      if (wg == 1) NamedBarrier::arrive(kConsumerThreads, kPFree);
      ClusterBarrier::arrive(&s.k_empty[stage]);

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
      const int row = qr.s * p.h_q + qr.h;
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

template <typename T, bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_kernel(const __grid_constant__ DecodeParams p) {
  auto& s = shared_storage<T, kFp8>();
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int head = blockIdx.y;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      ClusterBarrier::init(&s.k_full[i], kFp8 ? 128 : 1);
      ClusterBarrier::init(&s.k_empty[i], kConsumerThreads);
    }
    for (int i = 0; i < kStagingStages; ++i) ClusterBarrier::init(&s.staging_full[i], 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (wg == 2) {
    cutlass::arch::warpgroup_reg_dealloc<kFp8 ? 56 : 40>();
    if constexpr (kFp8) {
      produce_dequantized<T>(p, s, head, tid);
    } else if (tid == 0) {
      produce_direct<T>(p, s, head);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<kFp8 ? 224 : 232>();
    consume<T, kFp8>(p, s, head, wg, tid);
  }
}

template <typename T, bool kFp8>
void run_decode(const DecodeParams& params, cudaStream_t stream) {
  auto kernel = mla_decode_kernel<T, kFp8>;
  constexpr int bytes = shared_bytes<T, kFp8>();
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  const dim3 grid((params.rows_per_kv + kBlockM - 1) / kBlockM, params.h_kv, params.num_parts);
  kernel<<<grid, kThreads, bytes, stream>>>(params);
}

}  // namespace mla
