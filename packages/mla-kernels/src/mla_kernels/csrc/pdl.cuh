// Programmatic dependent launch (sm90): a kernel launched with `launch_with_pdl` may be scheduled
// while the kernel before it in the stream still runs, so its launch latency hides behind that
// kernel's tail. It must call `wait_for_previous_grid` before it reads what earlier kernels
// wrote; `allow_next_grid` lets the kernel after it be scheduled early in turn (that one waits
// for this grid's completion before reading anything).
#pragma once

#include <cuda_runtime.h>

namespace mla {

__device__ __forceinline__ void wait_for_previous_grid() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

__device__ __forceinline__ void allow_next_grid() { asm volatile("griddepcontrol.launch_dependents;" :::); }

template <typename... KernelArgs, typename... Args>
void launch_with_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t shared_bytes,
                     cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace mla
