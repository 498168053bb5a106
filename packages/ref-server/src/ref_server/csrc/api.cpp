// Tensors to GroupedGemmParams: the checks a direct caller needs, the output and the scratch
// memory from torch's allocator (so that CUDA graphs capture the call), then the launch.
#include "api.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>

#include "fp8_grouped_gemm.h"

namespace ref_server {

namespace {

void check(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dims) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dims, name, " must have ", dims, " dimensions, got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

}  // namespace

at::Tensor fp8_grouped_gemm(const at::Tensor& x, const at::Tensor& x_scales, const at::Tensor& w,
                            const at::Tensor& w_scales, const std::optional<at::Tensor>& offsets,
                            const std::optional<at::Tensor>& counts, int64_t group_rows) {
  check(x, "x", at::kFloat8_e4m3fn, 2);
  check(x_scales, "x_scales", at::kFloat, 2);
  check(w, "w", at::kFloat8_e4m3fn, 3);
  check(w_scales, "w_scales", at::kFloat, 3);
  const int64_t rows = x.size(0), k = x.size(1), groups = w.size(0), n = w.size(1);
  const int64_t k_blocks = (k + 127) / 128, n_blocks = (n + 127) / 128;
  TORCH_CHECK(w.size(2) == k, "x has k = ", k, " channels but w has k = ", w.size(2));
  TORCH_CHECK(n % 16 == 0 && k % 16 == 0, "n and k must be multiples of 16, got ", n, ", ", k);
  TORCH_CHECK(x_scales.size(0) == rows && x_scales.size(1) == k_blocks, "x_scales must be [",
              rows, ", ", k_blocks, "], got ", x_scales.sizes());
  TORCH_CHECK(w_scales.size(0) == groups && w_scales.size(1) == n_blocks &&
                  w_scales.size(2) == k_blocks,
              "w_scales must be [", groups, ", ", n_blocks, ", ", k_blocks, "], got ",
              w_scales.sizes());
  TORCH_CHECK(groups > 0 && rows < (int64_t(1) << 31), "need 0 < groups and rows < 2^31");
  TORCH_CHECK(!(offsets && counts), "pass offsets (grouped) or counts (batched), not both");
  for (const auto* sizes : {&offsets, &counts}) {
    if (*sizes) {
      check(**sizes, sizes == &offsets ? "offsets" : "counts", at::kInt, 1);
      TORCH_CHECK((*sizes)->size(0) == groups, "one offset or count per group: want ", groups,
                  ", got ", (*sizes)->size(0));
    }
  }
  TORCH_CHECK(offsets || group_rows * groups == rows, "batched: groups x group_rows = ",
              groups * group_rows, " but x has ", rows, " rows");

  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({rows, n}, x.options().dtype(at::kBFloat16));
  if (rows == 0) return out;
  GroupedGemmParams params{};
  params.x = x.data_ptr();
  params.x_scales = x_scales.data_ptr<float>();
  params.w = w.data_ptr();
  params.w_scales = w_scales.data_ptr<float>();
  params.offsets = offsets ? offsets->data_ptr<int32_t>() : nullptr;
  params.counts = counts ? counts->data_ptr<int32_t>() : nullptr;
  params.out = out.data_ptr();
  params.rows = static_cast<int>(rows);
  params.n = static_cast<int>(n);
  params.k = static_cast<int>(k);
  params.groups = static_cast<int>(groups);
  params.group_rows = static_cast<int>(group_rows);
  params.sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  params.stream = at::cuda::getCurrentCUDAStream();
  const size_t arrays = (grouped_gemm_arrays_bytes(params.groups) + 255) / 256 * 256;
  const size_t workspace = grouped_gemm_workspace_bytes(params);
  at::Tensor scratch =
      at::empty({static_cast<int64_t>(arrays + workspace)}, x.options().dtype(at::kByte));
  params.arrays = scratch.data_ptr();
  params.workspace = static_cast<char*>(scratch.data_ptr()) + arrays;
  const char* error = grouped_gemm(params);
  TORCH_CHECK(error == nullptr, "fp8_grouped_gemm: ", error);
  return out;
}

}  // namespace ref_server
