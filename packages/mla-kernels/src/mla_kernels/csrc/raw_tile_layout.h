// Where the narrow FP8 kernel that dequantizes in registers (decode_kernel_fp8_registers.cuh)
// finds the values of its wgmma A fragments in a raw FP8 tile, and where it puts Q's columns.
// Plain C++ with no CUDA headers, so that a host compiler can check it against the PTX ISA's
// fragment layout (tests/test_raw_tile_layout.py).
//
// A raw tile holds 64 tokens as the TMA engine lands them: the 512 e4m3 latent values in four
// 128-byte chunks of 64 rows, the 64 bf16 rope values in one such chunk, all with the 128-byte
// swizzle (16-byte piece p of row r at piece p ^ (r % 8)), then the 4 fp32 scales of each token.
//
// wgmma's A fragment of a 64 x 16 step gives thread (warp w, lane 4 g + t) rows 16 w + g and
// + 8, columns 2 t, 2 t + 1, 2 t + 8 and 2 t + 9. Both products use the freedom to number the
// reduction and row dimensions as they like, as long as both operands agree:
//  - S^T = K Q^T: row `position` of S^T is token token_of(position); Q's column q_column(d)
//    holds dim d, chosen so that thread t's values of four consecutive k-steps are 16
//    consecutive latent bytes of its token (one 16-byte load), or two 16-byte rope pieces.
//  - O^T += V^T P^T: column `position` of P^T (written from S^T's row `position`) is the same
//    token token_of(position); row 16 w + g + 8 i of 64-channel tile m is channel
//    value_channel(w, g, m, i), so a thread's 16 channels are one 16-byte piece of each token.
// token_of spreads the two rows that a shared-memory phase of 16-byte loads pairs (lanes g and
// g ^ 1) four rows apart, so that under the swizzle their pieces lie in different banks.
#pragma once

#ifdef __CUDACC__
#define MLA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MLA_HOST_DEVICE inline
#endif

namespace mla::raw_tile {

constexpr int kRows = 64;
constexpr int kChunkBytes = kRows * 128;
constexpr int kLatentBytes = 4 * kChunkBytes;
constexpr int kRopeOffset = kLatentBytes;
constexpr int kScaleOffset = kRopeOffset + kChunkBytes;
constexpr int kStageBytes = kScaleOffset + kRows * 4 * 4;  // 41,984: a multiple of 1,024

// Byte `byte` (0-127) of row `row` in a swizzled 128-byte chunk.
MLA_HOST_DEVICE constexpr int swizzled_byte(int row, int byte) {
  return row * 128 + ((byte / 16) ^ (row % 8)) * 16 + byte % 16;
}

// Byte `byte` (0-511) of token `token`'s latent values.
MLA_HOST_DEVICE constexpr int latent_offset(int token, int byte) {
  return byte / 128 * kChunkBytes + swizzled_byte(token, byte % 128);
}

// Byte `byte` (0-127) of token `token`'s rope values.
MLA_HOST_DEVICE constexpr int rope_offset(int token, int byte) { return kRopeOffset + swizzled_byte(token, byte); }

MLA_HOST_DEVICE constexpr int scale_offset(int token, int group) { return kScaleOffset + (token * 4 + group) * 4; }

MLA_HOST_DEVICE constexpr int spread(int g) { return (g & 1) << 2 | g >> 1; }

// The token of S^T's row / P^T's column `position`.
MLA_HOST_DEVICE constexpr int token_of(int position) { return (position & ~7) | spread(position & 7); }

// The column of Q that holds dim `dim` (0-575).
MLA_HOST_DEVICE constexpr int q_column(int dim) {
  if (dim < 512) {  // thread t, k-step 4 group + s, values 4 s .. 4 s + 3 of its 16 bytes
    const int group = dim / 64, t = dim % 64 / 16, s = dim % 16 / 4, upper = dim % 4 / 2;
    return group * 64 + s * 16 + upper * 8 + t * 2 + dim % 2;
  }
  const int r = dim - 512, piece = r / 8, t = piece % 4, s = piece / 4 * 2 + r % 8 / 4, upper = r % 4 / 2;
  return 512 + s * 16 + upper * 8 + t * 2 + r % 2;
}

// O^T: row 16 warp + g + 8 i of tile m is this channel; a thread's 16 channels start at
// value_channel(warp, g, 0, 0).
MLA_HOST_DEVICE constexpr int value_channel(int warp, int g, int m, int i) {
  return warp * 128 + spread(g) * 16 + 2 * m + i;
}

// Where thread (warp, lane) of a consumer warpgroup loads its fragments' bytes, as offsets in a
// raw tile computed once: the tile loop only adds constants to them.
struct ThreadOffsets {
  int key_latent_[2][2], key_rope_[2][2], key_scales_[2], value_latent_[4], value_scale_[4];

  MLA_HOST_DEVICE ThreadOffsets(int warp, int lane) {
    const int g = lane / 4, t = lane % 4;
    for (int half = 0; half < 2; ++half) {
      const int token = token_of(16 * warp + g + 8 * half);
      for (int i = 0; i < 2; ++i) {
        key_latent_[half][i] = latent_offset(token, i * 64 + t * 16);
        key_rope_[half][i] = rope_offset(token, (i * 4 + t) * 16);
      }
      key_scales_[half] = scale_offset(token, 0);
    }
    for (int k = 0; k < 4; ++k) {
      const int token = token_of(2 * t + k % 2 + 8 * (k / 2));
      value_latent_[k] = latent_offset(token, value_channel(warp, g, 0, 0));
      value_scale_[k] = scale_offset(token, warp);
    }
  }

  // S^T, k-steps 4 group .. 4 group + 3 (group 0-7): 16 latent bytes of row 16 warp + g + 8 half,
  // its values 4 s .. 4 s + 3 for k-step 4 group + s (columns 2 t, + 1 and 2 t + 8, + 9).
  MLA_HOST_DEVICE int key_latent(int half, int group) const {
    return key_latent_[half][group % 2] + group / 2 * kChunkBytes;
  }
  // S^T, k-steps 32 + 2 piece, + 1: 8 rope values of that row, 4 for each k-step.
  MLA_HOST_DEVICE int key_rope(int half, int piece) const { return key_rope_[half][piece]; }
  MLA_HOST_DEVICE int key_scales(int half) const { return key_scales_[half]; }  // the row's 4 scales
  // O^T, P^T's columns 16 s .. 16 s + 15: 16 latent bytes (channels value_channel(warp, g, m, i) for
  // m 0-7, i 0-1) and the scale of the token of column 16 s + 2 t + k % 2 + 8 (k / 2).
  MLA_HOST_DEVICE int value_latent(int s, int k) const { return value_latent_[k] + s * 16 * 128; }
  MLA_HOST_DEVICE int value_scale(int s, int k) const { return value_scale_[k] + s * 16 * 16; }
};

}  // namespace mla::raw_tile
