// Registers the CUDA ops; torch.ops.mla_kernels.mla_decode (mla_kernels/decode.py) calls them.
#include <torch/library.h>

#include "api.h"

TORCH_LIBRARY(mla_kernels_cuda, m) {
  m.def(
      "mla_decode(Tensor q, Tensor k_cache, Tensor block_table, Tensor cache_seqlens, "
      "Tensor tile_scheduler_metadata, Tensor num_splits, float softmax_scale, bool causal, "
      "bool is_fp8_kvcache) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mla_kernels_cuda, CUDA, m) { m.impl("mla_decode", &mla::mla_decode); }
