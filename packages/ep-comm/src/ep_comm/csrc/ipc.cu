// Host side of the cuda backend: IPC buffers and the launches of kernels.cuh's routines.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>

#include "kernels.cuh"

namespace ep_comm {

// A zeroed device buffer of `bytes` and its IPC handle (64 bytes, CPU uint8).
std::tuple<int64_t, at::Tensor> ipc_alloc(int64_t bytes) {
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaMalloc(&ptr, bytes));
  C10_CUDA_CHECK(cudaMemset(ptr, 0, bytes));
  cudaIpcMemHandle_t handle;
  C10_CUDA_CHECK(cudaIpcGetMemHandle(&handle, ptr));
  at::Tensor bytes_out = at::empty({static_cast<int64_t>(sizeof(handle))}, at::kByte);
  std::memcpy(bytes_out.data_ptr(), &handle, sizeof(handle));
  return {reinterpret_cast<int64_t>(ptr), bytes_out};
}

int64_t ipc_open(const at::Tensor& handle) {
  TORCH_CHECK(handle.numel() == sizeof(cudaIpcMemHandle_t) && handle.scalar_type() == at::kByte,
              "an IPC handle is ", sizeof(cudaIpcMemHandle_t), " bytes");
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.contiguous().data_ptr(), sizeof(h));
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess));
  return reinterpret_cast<int64_t>(ptr);
}

void ipc_close(int64_t ptr) { C10_CUDA_CHECK(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr))); }

void ipc_free(int64_t ptr) { C10_CUDA_CHECK(cudaFree(reinterpret_cast<void*>(ptr))); }

// A uint8 tensor over [ptr, ptr + bytes) of this process's own buffer (no ownership).
at::Tensor view_bytes(int64_t ptr, int64_t bytes) {
  return at::from_blob(reinterpret_cast<void*>(ptr), {bytes},
                       at::TensorOptions().dtype(at::kByte).device(at::kCUDA, c10::cuda::current_device()));
}

void copy_segments(const at::Tensor& src, const at::Tensor& src_offsets, const at::Tensor& dst_ptrs,
                   const at::Tensor& lengths, int64_t num_sms) {
  TORCH_CHECK(src.is_cuda() && src.scalar_type() == at::kByte && src.is_contiguous(), "src: contiguous CUDA uint8");
  for (const at::Tensor* t : {&src_offsets, &dst_ptrs, &lengths}) {
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kLong && t->is_contiguous(), "segment tables: CUDA int64");
  }
  const int num_segments = static_cast<int>(lengths.numel());
  if (num_segments == 0) return;
  copy_segments_kernel<<<static_cast<unsigned>(std::max<int64_t>(num_sms, 1)), 512, 0,
                         c10::cuda::getCurrentCUDAStream()>>>(
      src.data_ptr<uint8_t>(), src_offsets.data_ptr<int64_t>(), dst_ptrs.data_ptr<int64_t>(),
      lengths.data_ptr<int64_t>(), num_segments);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void barrier(const at::Tensor& peer_flag_ptrs, int64_t own_flags_ptr, int64_t epoch, double timeout_s,
             const at::Tensor& status) {
  const int num_ranks = static_cast<int>(peer_flag_ptrs.numel());
  TORCH_CHECK(num_ranks <= 32, "at most 32 ranks");
  barrier_kernel<<<1, 32, 0, c10::cuda::getCurrentCUDAStream()>>>(
      peer_flag_ptrs.data_ptr<int64_t>(), reinterpret_cast<uint64_t*>(own_flags_ptr), num_ranks,
      static_cast<uint64_t>(epoch), static_cast<uint64_t>(timeout_s * 1e9), status.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ep_comm
