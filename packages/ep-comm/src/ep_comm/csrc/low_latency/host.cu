// NVSHMEM bootstrap and symmetric memory for the low-latency mode, as a C ABI (see ll.h).
//
// Host-side NVSHMEM calls here are the ones that work when several PEs share a GPU without MPS
// ("limited MPG"): init, malloc/free and barrier_all. Team barriers and collectives exit the
// process there.
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "ll.h"

extern "C" int ep_ll_unique_id_bytes(void) { return sizeof(nvshmemx_uniqueid_t); }

extern "C" int ep_ll_get_unique_id(void* out) {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  const int status = nvshmemx_get_uniqueid(&id);
  *static_cast<nvshmemx_uniqueid_t*>(out) = id;
  return status;
}

// nvshmemx_init_attr, without its exit(-1) on failure: the status goes back to Python.
extern "C" int ep_ll_init(int rank, int num_ranks, const void* unique_id) {
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  int status = nvshmemx_set_attr_uniqueid_args(rank, num_ranks, static_cast<const nvshmemx_uniqueid_t*>(unique_id),
                                               &attr);
  if (status != 0) return status;
  nvshmemx_init_init_attr_ver_only(attr);
  const nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                      NVSHMEM_VENDOR_PATCH_VERSION};
  int provided = 0;
  return nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version);
}

extern "C" int ep_ll_my_pe(void) { return nvshmem_my_pe(); }
extern "C" int ep_ll_num_pes(void) { return nvshmem_n_pes(); }
extern "C" int ep_ll_init_status(void) { return nvshmemx_init_status(); }

extern "C" void* ep_ll_malloc(uint64_t bytes) {
  void* ptr = nvshmem_align(128, bytes);
  if (ptr == nullptr) return nullptr;
  const bool zeroed = cudaMemset(ptr, 0, bytes) == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess;
  nvshmem_barrier_all();  // zeroed everywhere before any peer writes (and no peer left waiting)
  return zeroed ? ptr : nullptr;
}

// Completes every put and signal this PE's kernels issued (a kernel's last signals have no
// quiet after them), then waits for the GPU: before clean or free, nothing may still land.
extern "C" int ep_ll_quiet(void) {
  cudaError_t status = cudaDeviceSynchronize();  // every kernel has issued what it will
  if (status != cudaSuccess) return static_cast<int>(status);
  nvshmemx_quiet_on_stream(0);
  return static_cast<int>(cudaDeviceSynchronize());
}

extern "C" void ep_ll_free(void* ptr) { nvshmem_free(ptr); }

extern "C" void ep_ll_barrier_all(void) { nvshmem_barrier_all(); }
