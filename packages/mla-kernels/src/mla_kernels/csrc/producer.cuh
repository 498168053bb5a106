// The producer warpgroup: fills the two-stage ring of K tiles, straight by TMA (16-bit cache)
// or through a staging ring of raw FP8 tokens that it dequantizes.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>

#include "decode_common.cuh"
#include "numeric.cuh"

namespace mla {

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

// The staging buffer's FP8-layout tokens into the swizzled 16-bit tile. Thread t converts
// latent piece t % 64 (8 values) of every other row and two of the rope pieces; rows at or past
// `length` become zeros (the slots past a sequence may hold NaN).
template <typename T, int kBlockN>
__device__ __forceinline__ void dequantize_tile(const uint8_t* staging, T* tile, int length, int tid) {
  constexpr int kLatentPieces = kHeadDimV / 8, kRopePieces = (kHeadDim - kHeadDimV) / 8;
  constexpr int kRowsPerStep = 128 / kLatentPieces;
  const int piece = tid % kLatentPieces, first_row = tid / kLatentPieces;
  const uint8_t* source = staging + first_row * kFp8TokenBytes;
#pragma unroll
  for (int i = 0; i < kBlockN / kRowsPerStep; ++i) {
    const int row = first_row + i * kRowsPerStep;
    const uint8_t* token = source + i * kRowsPerStep * kFp8TokenBytes;
    uint4 packed = make_uint4(0, 0, 0, 0);
    if (row < length) {
      const float scale = reinterpret_cast<const float*>(token + kHeadDimV)[piece / 16];
      packed = fp8x8_to<T>(*reinterpret_cast<const uint2*>(token + piece * 8), scale);
    }
    *reinterpret_cast<uint4*>(tile + swizzled_offset(kBlockN, row, piece * 8)) = packed;
  }
#pragma unroll
  for (int i = 0; i < kBlockN * kRopePieces / 128; ++i) {
    const int row = (tid + i * 128) / kRopePieces, rope_piece = tid % kRopePieces;
    uint4 packed = make_uint4(0, 0, 0, 0);
    if (row < length) {
      const uint8_t* rope = staging + row * kFp8TokenBytes + kFp8TokenBytes - 2 * (kHeadDim - kHeadDimV);
      packed = bf16x8_to<T>(*reinterpret_cast<const uint4*>(rope + rope_piece * 16));
    }
    *reinterpret_cast<uint4*>(tile + swizzled_offset(kBlockN, row, kHeadDimV + rope_piece * 8)) = packed;
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

}  // namespace mla
