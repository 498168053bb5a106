// Shared-memory tiles in the layout the tensor cores and the TMA engine agree on.
//
// A tile of R rows x C columns (16-bit elements, C a multiple of 64) is stored as C / 64
// column chunks of R rows x 128 bytes; inside a chunk, row r holds its eight 16-byte pieces
// in the order piece ^ (r % 8) (the "128-byte swizzle"). The chunks must start at 1024-byte
// boundaries. wgmma reads such tiles through descriptors built here; TMA writes them with
// CU_TENSOR_MAP_SWIZZLE_128B.
#pragma once

#include <cute/arch/mma_sm90_desc.hpp>
#include <cstdint>

#include "params.h"

namespace mla {

// Element offset of 16-byte piece `piece` (8 columns) of column `col / 64` chunk, row `row`.
__device__ __forceinline__ int swizzled_offset(int rows, int row, int col) {
  const int chunk = col / kChunkCols, piece = (col % kChunkCols) / 8;
  return chunk * rows * kChunkCols + row * kChunkCols + ((piece ^ (row % 8)) * 8) + col % 8;
}

__device__ __forceinline__ uint32_t smem_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Operand whose reduction dimension (K) runs along the 128-byte rows: Q, K and P.
// 8-row groups sit 1024 bytes apart.
__device__ __forceinline__ uint64_t k_major_desc(const void* ptr) {
  cute::GmmaDescriptor desc;
  desc.bitfield.start_address_ = smem_address(ptr) >> 4;
  desc.bitfield.leading_byte_offset_ = 1;  // unused by swizzled K-major layouts
  desc.bitfield.stride_byte_offset_ = 1024 >> 4;
  desc.bitfield.layout_type_ = uint8_t(cute::SM90::GMMA::LayoutType::B128);
  return desc.desc_;
}

// Operand whose output dimension (N) runs along the rows: V, read straight out of the K tile.
// The reduction dimension steps over rows (8-row groups 1024 bytes apart); N steps over
// 64-column chunks, `chunk_bytes` apart.
__device__ __forceinline__ uint64_t mn_major_desc(const void* ptr, int chunk_bytes) {
  cute::GmmaDescriptor desc;
  desc.bitfield.start_address_ = smem_address(ptr) >> 4;
  desc.bitfield.leading_byte_offset_ = chunk_bytes >> 4;
  desc.bitfield.stride_byte_offset_ = 1024 >> 4;
  desc.bitfield.layout_type_ = uint8_t(cute::SM90::GMMA::LayoutType::B128);
  return desc.desc_;
}

}  // namespace mla
