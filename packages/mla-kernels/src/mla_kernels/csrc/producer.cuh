// Filling the two-stage ring of K tiles in shared memory.
//
// A 16-bit cache goes straight into a stage by TMA, issued by the producer's thread 0 as soon
// as the consumers free the stage. An FP8 cache lands raw, by TMA issued by the consumer
// thread that frees the stage: each token's 512 e4m3 values in the stage's columns 256-511,
// its scales next to the ring, its bf16 rope in the stage's last chunk. The producer
// warpgroup then dequantizes the latent columns in place (and converts the rope for fp16
// queries). The copies of one stage are in flight while the other is dequantized or read, and
// no registers wait on them.
// Rows of a tile with no token to attend (past its length, or on a page the block table gives
// no cache block) are not copied; the tile's `attended` bits say which rows are, and the
// consumers mask the others and zero their V columns.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>

#include "decode_common.cuh"
#include "numeric.cuh"

namespace mla {

// Where an FP8 tile's raw e4m3 values land: 64 rows of 512 bytes, in the bytes of the stage's
// latent columns 256-511.
constexpr int kFp8RawOffset = kBlockN * kHeadDimV;
constexpr int kFp8RowBytes = kHeadDimV;

// The cache slot holding token `token` of sequence `batch`, or -1 where there is none: a page
// past the block table, or a table entry outside the cache. Such tokens are not attended (a
// TMA box at a negative slot would fill only its rows before slot 0 with zeros and read block
// 0 into the rest).
__device__ __forceinline__ int cache_slot(const DecodeParams& p, int batch, int token) {
  const int page = token / p.page_size;
  if (page >= p.max_blocks_per_seq) return -1;
  const int block = __ldg(p.block_table + batch * p.max_blocks_per_seq + page);
  if (block < 0 || block >= p.num_blocks) return -1;
  return block * p.page_size + token % p.page_size;
}

// The TMA copies of one tile into `stage`, completing `full`, and the tile's attended rows (by
// one thread). A 16-bit tile is nine 64-column boxes per page; an FP8 tile is a raw box and a
// rope box per page. A box lies within one page: pages are whole tiles or divide one.
template <typename T, bool kFp8>
__device__ void issue_tile_copies(const DecodeParams& p, SharedStorage<T>& s, const TileCursor& tile, int stage,
                                  int head, uint64_t* full) {
  constexpr int kChunkBytes = kBlockN * kChunkCols * sizeof(T);
  constexpr int kFirstChunk = kFp8 ? kHeadDimV / kChunkCols : 0;  // FP8: only the rope is 16-bit
  constexpr int kColumnShift = kFp8 ? (kFp8TokenBytes - 128) / 2 - kHeadDimV : 0;  // column 512 in the map
  constexpr int kTokenBytes = kFp8 ? kFp8TokenBytes : kHeadDim * sizeof(T);
  const int box_rows = min(p.page_size, kBlockN);  // whole pages, or tile-sized pieces of one
  const int length = tile.length(), boxes = (length + box_rows - 1) / box_rows;
  const uint64_t box_bits = box_rows == kBlockN ? kAllRows : (1ull << box_rows) - 1;
  uint64_t attended = length == kBlockN ? kAllRows : (1ull << length) - 1;
  int copied = 0;
  for (int i = 0; i < boxes; ++i) {
    if (cache_slot(p, tile.batch, tile.token + i * box_rows) < 0) {
      attended &= ~(box_bits << (i * box_rows));
    } else {
      ++copied;
    }
  }
  s.attended[stage] = attended;  // published by the arrive below (release semantics)
  ClusterTransactionBarrier::arrive_and_expect_tx(full, copied * box_rows * kTokenBytes);
  uint8_t* tile_bytes = reinterpret_cast<uint8_t*>(s.k[stage]);
  for (int i = 0; i < boxes; ++i) {
    const int row = i * box_rows;
    const int slot = cache_slot(p, tile.batch, tile.token + row);
    if (slot < 0) continue;
#pragma unroll
    for (int c = kFirstChunk; c < kHeadDim / kChunkCols; ++c) {
      cute::SM90_TMA_LOAD_3D::copy(&p.kv_tensor_map, full, kCacheHint,
                                   tile_bytes + c * kChunkBytes + row * kChunkCols * sizeof(T),
                                   c * kChunkCols + kColumnShift, head, slot);
    }
    if constexpr (kFp8) {
      cute::SM90_TMA_LOAD_3D::copy(&p.fp8_latent_map, full, kCacheHint,
                                   tile_bytes + kFp8RawOffset + row * kFp8RowBytes, 0, head, slot);
      cute::SM90_TMA_LOAD_3D::copy(&p.fp8_scale_map, full, kCacheHint, s.fp8_scales[stage] + row * 4,
                                   kHeadDimV / 4, head, slot);
    }
  }
}

// A 16-bit cache: the producer's one thread fills each stage as soon as the consumers free it.
template <typename T>
__device__ void produce_by_tma(const DecodeParams& p, SharedStorage<T>& s, int head) {
  int j = 0;
  for (TileCursor tile(p, blockIdx.z); !tile.done(); tile.advance(), ++j) {
    const int stage = j % kStages;
    ClusterBarrier::wait(&s.k_empty[stage], ((j / kStages) & 1) ^ 1);
    issue_tile_copies<T, false>(p, s, tile, stage, head, &s.k_full[stage]);
  }
}

// An FP8 cache: the consumer thread that frees a stage refills it at once with the raw tile
// kStages ahead, so that the copies never wait for the producer's dequantization.
// `first`, `stride`: the tiles (in partition order) this issuer is responsible for.
template <typename T>
struct Fp8CopyIssuer {
  TileCursor next;
  int index, stride;
  __device__ Fp8CopyIssuer(const DecodeParams& p, int first, int stride_)
      : next(p, blockIdx.z), index(first), stride(stride_) {
    for (int i = 0; i < first && !next.done(); ++i) next.advance();
  }
  __device__ void issue(const DecodeParams& p, SharedStorage<T>& s, int head) {
    if (next.done()) return;
    const int stage = index % kStages;
    issue_tile_copies<T, true>(p, s, next, stage, head, &s.raw_full[stage]);
    for (int i = 0; i < stride && !next.done(); ++i) next.advance();
    index += stride;
  }
};

// Scale groups `first_group` and + 1 of every row of an FP8 tile, from its raw values to T:
// eight threads per (row, group), one 16-value piece each, so that eight threads of a
// shared-memory phase read one row's contiguous 128 bytes. `in_place`: the raw values lie in
// the columns written, so every thread reads before any writes. Rows past the tile's length
// are converted too (whatever they hold): no branches, and the consumers mask or zero them.
template <typename T>
__device__ __forceinline__ void dequantize_groups(T* tile, const uint8_t* raw, const float* scales, int tid,
                                                  int first_group, bool in_place) {
  constexpr int kUnits = 8;  // (row, group) units per thread; 16 per step of the warpgroup
  const int piece = tid % 8;
  uint4 values[kUnits];
  float scale[kUnits];
#pragma unroll
  for (int k = 0; k < kUnits; ++k) {
    const int unit = k * 16 + tid / 8, row = unit % kBlockN, group = first_group + unit / kBlockN;
    values[k] = *reinterpret_cast<const uint4*>(raw + row * kFp8RowBytes + group * 128 + piece * 16);
    scale[k] = scales[row * 4 + group];
  }
  if (in_place) NamedBarrier::arrive_and_wait(128, kRawRead);
  // Threads with pieces 4-7 write their two halves in the other order: then the eight threads
  // of a store phase hit eight different bank groups.
  const int swap = piece / 4;
#pragma unroll
  for (int k = 0; k < kUnits; ++k) {
    const int unit = k * 16 + tid / 8, row = unit % kBlockN, group = first_group + unit / kBlockN;
    const uint4 v = values[k];
    const uint2 first = swap ? make_uint2(v.z, v.w) : make_uint2(v.x, v.y);
    const uint2 second = swap ? make_uint2(v.x, v.y) : make_uint2(v.z, v.w);
    const int col = group * 128 + piece * 16;
    *reinterpret_cast<uint4*>(tile + swizzled_offset(kBlockN, row, col + 8 * swap)) = fp8x8_to<T>(first, scale[k]);
    *reinterpret_cast<uint4*>(tile + swizzled_offset(kBlockN, row, col + 8 - 8 * swap)) =
        fp8x8_to<T>(second, scale[k]);
  }
}

// By the producer warpgroup: each tile's latent columns from the raw values, in place.
template <typename T>
__device__ void dequantize_fp8_tiles(const DecodeParams& p, SharedStorage<T>& s, int tid) {
  int j = 0;
  for (TileCursor tile(p, blockIdx.z); !tile.done(); tile.advance(), ++j) {
    const int stage = j % kStages;
    ClusterTransactionBarrier::wait(&s.raw_full[stage], (j / kStages) & 1);
    T* dst = s.k[stage];
    const uint8_t* raw = reinterpret_cast<const uint8_t*>(dst) + kFp8RawOffset;
    dequantize_groups(dst, raw, s.fp8_scales[stage], tid, 0, false);  // columns 0-255
    dequantize_groups(dst, raw, s.fp8_scales[stage], tid, 2, true);   // columns 256-511
    if constexpr (!std::is_same_v<T, __nv_bfloat16>) {  // the rope landed as bf16
      uint4* rope = reinterpret_cast<uint4*>(dst + kHeadDimV * kBlockN);
#pragma unroll
      for (int i = tid; i < kBlockN * kChunkCols / 8; i += 128) rope[i] = bf16x8_to<T>(rope[i]);
    }
    cutlass::arch::fence_view_async_shared();  // the tensor cores read what plain stores wrote
    ClusterBarrier::arrive(&s.k_full[stage]);
  }
}

}  // namespace mla
