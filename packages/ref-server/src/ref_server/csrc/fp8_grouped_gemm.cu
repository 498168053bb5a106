// CUTLASS's grouped FP8 GEMM with 1 x 128 activation and 128 x 128 weight scales (Hopper), for
// groups whose sizes live on the device: a small kernel turns them into the per-group shapes,
// pointers and layouts CUTLASS reads, then the persistent kernel walks the groups' tiles.
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "fp8_grouped_gemm.h"

namespace ref_server {
namespace {

using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // M, N, K per group
using Shape3 = ProblemShape::UnderlyingProblemShape;
using ElementAB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // x [m, k]
using LayoutB = cutlass::layout::ColumnMajor;  // w [n, k]: k contiguous
using LayoutD = cutlass::layout::RowMajor;     // out [m, n]
constexpr int kAlignAB = 16;                   // elements: 16 bytes
constexpr int kAlignD = 8;
// Scales as DeepSeek-V3 keeps them: one per token and 128 channels, one per 128 x 128 weight
// block, both with k contiguous.
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K,
                                                              cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

// 128 x 128 tiles, each shared by two consumer warp groups, clusters of two along n (a 64-row
// ping-pong kernel measured slower than this one or the Triton kernel at every size:
// benchmarks/bench_fp8_gemm.py, docs/benchmarks.md).
using TileShape = Shape<_128, _128, _128>;
using ClusterShape = Shape<_1, _2, _1>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD,
    ElementD, LayoutD*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB,
    cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB, ElementAB, cute::tuple<LayoutB*, LayoutSFB*>,
    kAlignAB, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
using StrideA = typename Kernel::InternalStrideA;
using StrideB = typename Kernel::InternalStrideB;
using StrideD = typename Kernel::InternalStrideD;

// The per-group arrays CUTLASS reads, carved out of params.arrays in this order.
struct Arrays {
  Shape3* shapes;
  const ElementAB** a;
  const ElementAB** b;
  ElementD** d;
  const float** sfa;
  const float** sfb;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
};

template <class T>
T* carve(uintptr_t& cursor, int groups) {
  T* at = reinterpret_cast<T*>(cursor);
  cursor += (sizeof(T) * groups + 15) / 16 * 16;
  return at;
}

// Lays the arrays out from base; end: where they stop.
Arrays carve_arrays(void* base, int groups, uintptr_t* end = nullptr) {
  uintptr_t cursor = reinterpret_cast<uintptr_t>(base);
  Arrays arrays;
  arrays.shapes = carve<Shape3>(cursor, groups);
  arrays.a = carve<const ElementAB*>(cursor, groups);
  arrays.b = carve<const ElementAB*>(cursor, groups);
  arrays.d = carve<ElementD*>(cursor, groups);
  arrays.sfa = carve<const float*>(cursor, groups);
  arrays.sfb = carve<const float*>(cursor, groups);
  arrays.stride_a = carve<StrideA>(cursor, groups);
  arrays.stride_b = carve<StrideB>(cursor, groups);
  arrays.stride_d = carve<StrideD>(cursor, groups);
  arrays.layout_sfa = carve<LayoutSFA>(cursor, groups);
  arrays.layout_sfb = carve<LayoutSFB>(cursor, groups);
  if (end != nullptr) *end = cursor;
  return arrays;
}

__global__ void fill_arrays(GroupedGemmParams p, Arrays arrays) {
  int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= p.groups) return;
  int begin, m;
  if (p.offsets != nullptr) {
    int end = min(max(p.offsets[g], 0), p.rows);
    begin = g == 0 ? 0 : min(max(p.offsets[g - 1], 0), end);
    m = end - begin;
  } else {
    begin = g * p.group_rows;
    m = p.counts == nullptr ? p.group_rows : min(max(p.counts[g], 0), p.group_rows);
  }
  int64_t k_blocks = (p.k + 127) / 128;
  arrays.shapes[g] = Shape3{m, p.n, p.k};
  arrays.a[g] = static_cast<const ElementAB*>(p.x) + int64_t(begin) * p.k;
  arrays.b[g] = static_cast<const ElementAB*>(p.w) + int64_t(g) * p.n * p.k;
  arrays.d[g] = static_cast<ElementD*>(p.out) + int64_t(begin) * p.n;
  arrays.sfa[g] = p.x_scales + begin * k_blocks;
  arrays.sfb[g] = p.w_scales + int64_t(g) * ((p.n + 127) / 128) * k_blocks;
  arrays.stride_a[g] = cutlass::make_cute_packed_stride(StrideA{}, {m, p.k, 1});
  arrays.stride_b[g] = cutlass::make_cute_packed_stride(StrideB{}, {p.n, p.k, 1});
  arrays.stride_d[g] = cutlass::make_cute_packed_stride(StrideD{}, {m, p.n, 1});
  arrays.layout_sfa[g] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, p.n, p.k, 1));
  arrays.layout_sfb[g] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, p.n, p.k, 1));
}

Gemm::Arguments arguments(const GroupedGemmParams& p, const Arrays& arrays) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = 0;  // unused where sm_count is given
  hw.sm_count = p.sm_count;
  Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {p.groups, arrays.shapes, nullptr},  // sizes only on the device
      {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b, arrays.sfa, arrays.layout_sfa,
       arrays.sfb, arrays.layout_sfb},
      {{}, nullptr, nullptr, arrays.d, arrays.stride_d},
      hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return args;
}

}  // namespace

size_t grouped_gemm_arrays_bytes(int groups) {
  uintptr_t end = 0;
  carve_arrays(nullptr, groups, &end);
  return end;
}

size_t grouped_gemm_workspace_bytes(const GroupedGemmParams& params) {
  return Gemm::get_workspace_size(arguments(params, carve_arrays(params.arrays, params.groups)));
}

const char* grouped_gemm(const GroupedGemmParams& params) {
  Arrays arrays = carve_arrays(params.arrays, params.groups);
  constexpr int kThreads = 128;
  int blocks = (params.groups + kThreads - 1) / kThreads;
  fill_arrays<<<blocks, kThreads, 0, params.stream>>>(params, arrays);
  if (cudaGetLastError() != cudaSuccess) return "the kernel filling the group arrays failed to launch";
  Gemm gemm;
  auto args = arguments(params, arrays);
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return "CUTLASS cannot run these shapes";
  if (gemm.initialize(args, params.workspace, params.stream) != cutlass::Status::kSuccess)
    return "CUTLASS's initialize failed";
  if (gemm.run(params.stream) != cutlass::Status::kSuccess) return "CUTLASS's kernel failed to launch";
  return nullptr;
}

}  // namespace ref_server
