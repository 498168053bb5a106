// The producer warpgroup: fills the two-stage ring of K tiles in shared memory.
//
// A 16-bit cache goes straight in by TMA, issued by one thread. An FP8 cache goes through
// the registers of all 128 threads: raw tokens are loaded for the next tile while the ring
// slot is still in use, then dequantized into it. (Staging raw tiles in shared memory instead
// would leave room for 32-token tiles only, whose small products run at half the rate.)
// Slots past a tile's length are left as they are; the consumers zero their V columns.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>

#include "decode_common.cuh"
#include "numeric.cuh"

namespace mla {

// The cache slot holding token `token` of sequence `batch`; -1 for a page index past the block
// table (the TMA engine reads it as zeros; the FP8 loads skip it).
__device__ __forceinline__ int cache_slot(const DecodeParams& p, int batch, int token) {
  const int page = token / p.page_size;
  if (page >= p.max_blocks_per_seq) return -1;
  const int block = __ldg(p.block_table + batch * p.max_blocks_per_seq + page);
  return block * p.page_size + token % p.page_size;
}

template <typename T>
__device__ void produce_by_tma(const DecodeParams& p, SharedStorage<T>& s, int head) {
  constexpr int kColumnBoxes = kHeadDim / kChunkCols;
  constexpr int kChunkBytes = kBlockN * kChunkCols * sizeof(T);
  const int box_rows = min(p.page_size, kBlockN);  // whole pages, or tile-sized pieces of one
  int j = 0;
  for (TileCursor tile(p, blockIdx.z); !tile.done(); tile.advance(), ++j) {
    const int stage = j % kStages;
    ClusterBarrier::wait(&s.k_empty[stage], ((j / kStages) & 1) ^ 1);
    const int boxes = (tile.length() + box_rows - 1) / box_rows;
    ClusterTransactionBarrier::arrive_and_expect_tx(&s.k_full[stage], boxes * box_rows * kHeadDim * sizeof(T));
    uint8_t* tile_bytes = reinterpret_cast<uint8_t*>(s.k[stage]);
    for (int i = 0; i < boxes; ++i) {
      const int slot = cache_slot(p, tile.batch, tile.token + i * box_rows);
#pragma unroll
      for (int c = 0; c < kColumnBoxes; ++c) {
        cute::SM90_TMA_LOAD_3D::copy(&p.kv_tensor_map, &s.k_full[stage], kCacheHint,
                                     tile_bytes + c * kChunkBytes + i * box_rows * kChunkCols * sizeof(T),
                                     c * kChunkCols, head, slot);
      }
    }
  }
}

// One tile of FP8-layout tokens in registers. Thread t holds, for rows t % 32 and t % 32 + 32,
// the 128 latent values of scale group t / 32 (one group per warp, so the eight threads of a
// shared-memory store phase write eight rows: no bank conflicts) and their scale, and four
// 16-byte pieces of rope.
struct Fp8Tile {
  static constexpr int kRowsPerThread = 2, kRopePieces = 4;
  uint4 latent[kRowsPerThread][8];
  float scale[kRowsPerThread];
  uint4 rope[kRopePieces];
};

__device__ __forceinline__ int fp8_latent_row(int tid, int r) { return tid % 32 + r * 32; }
__device__ __forceinline__ int fp8_rope_row(int tid, int i) { return (tid + i * 128) / 8; }

__device__ __forceinline__ const uint8_t* fp8_token(const DecodeParams& p, const TileCursor& tile, int head,
                                                    int row) {
  if (row >= tile.length()) return nullptr;
  const int slot = cache_slot(p, tile.batch, tile.token + row);
  if (slot < 0) return nullptr;
  return p.k_cache + (int64_t(slot) * p.h_kv + head) * kFp8TokenBytes;
}

__device__ __forceinline__ void load_fp8_tile(const DecodeParams& p, const TileCursor& tile, int head, int tid,
                                              Fp8Tile& t) {
  const int group = tid / 32;
#pragma unroll
  for (int r = 0; r < Fp8Tile::kRowsPerThread; ++r) {
    const uint8_t* token = fp8_token(p, tile, head, fp8_latent_row(tid, r));
    if (token == nullptr) continue;
#pragma unroll
    for (int i = 0; i < 8; ++i) t.latent[r][i] = __ldg(reinterpret_cast<const uint4*>(token + group * 128 + i * 16));
    t.scale[r] = __ldg(reinterpret_cast<const float*>(token + kHeadDimV) + group);
  }
#pragma unroll
  for (int i = 0; i < Fp8Tile::kRopePieces; ++i) {
    const uint8_t* token = fp8_token(p, tile, head, fp8_rope_row(tid, i));
    if (token != nullptr) {
      t.rope[i] = __ldg(reinterpret_cast<const uint4*>(token + kFp8TokenBytes - 128 + (tid % 8) * 16));
    }
  }
}

template <typename T>
__device__ __forceinline__ void store_fp8_tile(const Fp8Tile& t, int length, int tid, T* dst) {
  const int group = tid / 32;
#pragma unroll
  for (int r = 0; r < Fp8Tile::kRowsPerThread; ++r) {
    const int row = fp8_latent_row(tid, r);
    if (row >= length) continue;
#pragma unroll
    for (int piece = 0; piece < 16; ++piece) {
      const uint4 v = t.latent[r][piece / 2];
      const uint2 half = piece % 2 ? make_uint2(v.z, v.w) : make_uint2(v.x, v.y);
      *reinterpret_cast<uint4*>(dst + swizzled_offset(kBlockN, row, group * 128 + piece * 8)) =
          fp8x8_to<T>(half, t.scale[r]);
    }
  }
#pragma unroll
  for (int i = 0; i < Fp8Tile::kRopePieces; ++i) {
    const int row = fp8_rope_row(tid, i);
    if (row < length) {
      *reinterpret_cast<uint4*>(dst + swizzled_offset(kBlockN, row, kHeadDimV + (tid % 8) * 8)) = bf16x8_to<T>(t.rope[i]);
    }
  }
}

template <typename T>
__device__ void produce_from_fp8(const DecodeParams& p, SharedStorage<T>& s, int head, int tid) {
  TileCursor tile(p, blockIdx.z);
  Fp8Tile next;
  if (!tile.done()) load_fp8_tile(p, tile, head, tid, next);
  for (int j = 0; !tile.done(); ++j) {
    const int stage = j % kStages, length = tile.length();
    ClusterBarrier::wait(&s.k_empty[stage], ((j / kStages) & 1) ^ 1);
    store_fp8_tile(next, length, tid, s.k[stage]);
    cutlass::arch::fence_view_async_shared();  // the tensor cores read what plain stores wrote
    ClusterBarrier::arrive(&s.k_full[stage]);
    tile.advance();
    if (!tile.done()) load_fp8_tile(p, tile, head, tid, next);  // in flight while the ring drains
  }
}

}  // namespace mla
