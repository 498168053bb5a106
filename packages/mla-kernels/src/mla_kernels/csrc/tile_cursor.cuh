// Walks the KV tiles a partition of the tile scheduler (mla_kernels/scheduler.py) covers:
// sequence by sequence, kBlockN tokens at a time. Every warpgroup of a CTA walks the same
// sequence of tiles with its own cursor.
#pragma once

#include "params.h"

namespace mla {

// One sequence's stretch of tokens inside a partition.
struct Segment {
  int batch, seqlen;
  int token_end;  // one past the last token of the stretch
  bool split;     // the sequence is computed in several pieces, to be combined
  int slot;       // with split: this piece's row in out_accum / lse_accum
  bool last;      // the partition's last stretch
};

struct TileCursor {
  const DecodeParams& p;
  int end_batch, end_block;
  int batch, token;  // current tile: tokens [token, min(token + kBlockN, segment_end)) of batch
  int seqlen, segment_end, piece;

  __device__ TileCursor(const DecodeParams& params, int part) : p(params) {
    const int* m = p.metadata + part * kMetadataWidth;
    end_batch = m[2];
    end_block = m[3];
    batch = m[0];
    piece = m[4];
    start_segment(m[1]);
  }

  __device__ bool done() const { return batch > end_batch; }
  __device__ int length() const { return min(kBlockN, segment_end - token); }
  __device__ bool last_in_segment() const { return token + kBlockN >= segment_end; }

  __device__ Segment segment() const {
    const int first = p.num_splits[batch], pieces = p.num_splits[batch + 1] - first;
    return Segment{batch, seqlen, segment_end, pieces > 1, first + piece, batch == end_batch};
  }

  __device__ void advance() {
    token += kBlockN;
    if (token < segment_end) return;
    ++batch;
    piece = 0;
    start_segment(0);
  }

 private:
  // Position on the first tile of `batch` from block `begin_block`, skipping sequences with
  // nothing to do here (empty ones).
  __device__ void start_segment(int begin_block) {
    for (; batch <= end_batch; ++batch, begin_block = 0, piece = 0) {
      seqlen = __ldg(p.cache_seqlens + batch);
      const int blocks = (seqlen + kSchedBlock - 1) / kSchedBlock;
      const int stop = batch == end_batch ? end_block : blocks;
      if (begin_block < stop) {
        token = begin_block * kSchedBlock;
        segment_end = min(seqlen, stop * kSchedBlock);
        return;
      }
    }
  }
};

}  // namespace mla
