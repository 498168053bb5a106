#include <torch/extension.h>

#include <tuple>

namespace ep_comm {
std::tuple<int64_t, at::Tensor> ipc_alloc(int64_t bytes);
int64_t ipc_open(const at::Tensor& handle);
void ipc_close(int64_t ptr);
void ipc_free(int64_t ptr);
at::Tensor view_bytes(int64_t ptr, int64_t bytes);
void copy_segments(const at::Tensor& src, const at::Tensor& src_offsets, const at::Tensor& dst_ptrs,
                   const at::Tensor& lengths, int64_t num_sms);
void barrier(const at::Tensor& peer_flag_ptrs, int64_t own_flags_ptr, int64_t epoch, double timeout_s,
             const at::Tensor& status);
}  // namespace ep_comm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ipc_alloc", &ep_comm::ipc_alloc, "zeroed device buffer and its IPC handle");
  m.def("ipc_open", &ep_comm::ipc_open, "map a peer's buffer from its IPC handle");
  m.def("ipc_close", &ep_comm::ipc_close);
  m.def("ipc_free", &ep_comm::ipc_free);
  m.def("view_bytes", &ep_comm::view_bytes, "uint8 tensor over part of this process's buffer");
  m.def("copy_segments", &ep_comm::copy_segments, "copy byte segments to (peer) pointers");
  m.def("barrier", &ep_comm::barrier, "device-side barrier across ranks through buffer flags");
}
