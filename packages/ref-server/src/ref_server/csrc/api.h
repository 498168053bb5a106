#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace ref_server {

// torch.ops.ref_server_cuda.fp8_grouped_gemm; ref_server/model/cutlass_gemm.py documents the
// arguments.
at::Tensor fp8_grouped_gemm(const at::Tensor& x, const at::Tensor& x_scales, const at::Tensor& w,
                            const at::Tensor& w_scales, const std::optional<at::Tensor>& offsets,
                            const std::optional<at::Tensor>& counts, int64_t group_rows);

}  // namespace ref_server
