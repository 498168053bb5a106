// Host side of the cuda backend: the IPC buffers, the status word, and the kernels' launches.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>

#include "intranode.h"

namespace ep_comm {

namespace {

int64_t aligned16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

void check_cuda(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous() && t.scalar_type() == dtype, name, ": contiguous CUDA ", dtype);
}

}  // namespace

Intranode::Intranode(int64_t rank, int64_t num_ranks, int64_t num_bytes, double timeout_s) : num_bytes_(num_bytes) {
  TORCH_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "the cuda backend runs 1 to ", kMaxRanks, " ranks");
  TORCH_CHECK(num_bytes > kControlBytes, "num_nvl_bytes must exceed ", kControlBytes);
  peers_.rank = static_cast<int>(rank);
  peers_.num_ranks = static_cast<int>(num_ranks);
  peers_.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
  C10_CUDA_CHECK(cudaGetDevice(&device_));
  C10_CUDA_CHECK(cudaMalloc(&buffer_, num_bytes));
  C10_CUDA_CHECK(cudaMemset(buffer_, 0, num_bytes));
  C10_CUDA_CHECK(cudaHostAlloc(&status_, kStatusInts * sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(status_, 0, kStatusInts * sizeof(int));
  C10_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&peers_.status), status_, 0));
  C10_CUDA_CHECK(cudaDeviceSynchronize());  // the zeroed buffer is visible before peers map it
}

at::Tensor Intranode::ipc_handle() const {
  cudaIpcMemHandle_t handle;
  C10_CUDA_CHECK(cudaIpcGetMemHandle(&handle, buffer_));
  at::Tensor bytes = at::empty({static_cast<int64_t>(sizeof(handle))}, at::kByte);
  std::memcpy(bytes.data_ptr(), &handle, sizeof(handle));
  return bytes;
}

void Intranode::connect(const std::vector<at::Tensor>& handles) {
  TORCH_CHECK(static_cast<int>(handles.size()) == peers_.num_ranks, "one IPC handle per rank");
  for (int r = 0; r < peers_.num_ranks; ++r) {
    if (r == peers_.rank) {
      peers_.base[r] = static_cast<uint8_t*>(buffer_);
      continue;
    }
    TORCH_CHECK(handles[r].numel() == sizeof(cudaIpcMemHandle_t), "an IPC handle is ", sizeof(cudaIpcMemHandle_t),
                " bytes");
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, handles[r].contiguous().data_ptr(), sizeof(handle));
    void* ptr = nullptr;
    C10_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess));
    peers_.base[r] = static_cast<uint8_t*>(ptr);
  }
  connected_ = true;
}

void Intranode::close_peers() {
  if (!connected_) return;
  c10::cuda::CUDAGuard guard(device_);
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  for (int r = 0; r < peers_.num_ranks; ++r)
    if (r != peers_.rank) C10_CUDA_CHECK(cudaIpcCloseMemHandle(peers_.base[r]));
  connected_ = false;
}

void Intranode::free_buffer() {
  if (buffer_ == nullptr) return;
  TORCH_CHECK(!connected_, "close_peers() first");
  c10::cuda::CUDAGuard guard(device_);
  C10_CUDA_CHECK(cudaFree(buffer_));
  C10_CUDA_CHECK(cudaFreeHost(status_));
  buffer_ = nullptr;
}

std::vector<int64_t> Intranode::status() const {
  const volatile int* status = status_;
  std::vector<int64_t> values(kStatusInts);
  for (int i = 0; i < kStatusInts; ++i) values[i] = status[i];
  return values;
}

int64_t Intranode::dispatch_slot_bytes(const std::vector<int64_t>& row_bytes) {
  int64_t slot = 16;  // the source token index
  for (int64_t bytes : row_bytes) slot += aligned16(bytes);
  return slot;
}

int64_t Intranode::combine_slot_bytes(int64_t hidden, int64_t num_topk) {
  return aligned16(hidden * 2) + aligned16(num_topk * 4);
}

Rings Intranode::rings(int64_t num_channels, int64_t ring_tokens, int64_t send_chunk, int64_t slot_bytes) const {
  TORCH_CHECK(buffer_ != nullptr && connected_, "the buffer was destroyed or never connected");
  TORCH_CHECK(num_channels >= 1 && num_channels <= kMaxChannels, "1 to ", kMaxChannels, " channels");
  TORCH_CHECK(0 < send_chunk && send_chunk <= ring_tokens, "need 0 < send chunk <= ring tokens");
  const int64_t needed = kControlBytes + num_channels * peers_.num_ranks * ring_tokens * slot_bytes;
  TORCH_CHECK(needed <= num_bytes_, "rings need ", needed, " bytes, the buffer has ", num_bytes_);
  return Rings{static_cast<int>(num_channels), static_cast<int>(ring_tokens), static_cast<int>(send_chunk),
               slot_bytes};
}

void Intranode::barrier() {
  c10::cuda::CUDAGuard guard(device_);
  rings(1, 1, 1, 0);
  launch_barrier(peers_, c10::cuda::getCurrentCUDAStream());
}

void Intranode::notify(const at::Tensor& is_token_in_rank, const at::Tensor& num_tokens_per_expert,
                       at::Tensor& rank_counts, at::Tensor& channel_counts, at::Tensor& expert_counts) {
  check_cuda(is_token_in_rank, "is_token_in_rank", at::kBool);
  check_cuda(num_tokens_per_expert, "num_tokens_per_expert", at::kInt);
  for (const at::Tensor* t : {&rank_counts, &channel_counts, &expert_counts}) check_cuda(*t, "counts", at::kInt);
  const int64_t num_experts = num_tokens_per_expert.numel(), num_channels = channel_counts.size(1);
  TORCH_CHECK(peers_.num_ranks + num_channels + num_experts / peers_.num_ranks <= kNotifySlots,
              "too many channels and experts per rank for the notify area");
  rings(num_channels, 1, 1, 0);
  c10::cuda::CUDAGuard guard(device_);
  NotifyParams p{};
  p.peers = peers_;
  p.is_token_in_rank = is_token_in_rank.data_ptr<bool>();
  p.num_tokens_per_expert = num_tokens_per_expert.data_ptr<int>();
  p.num_tokens = static_cast<int>(is_token_in_rank.size(0));
  p.num_experts = static_cast<int>(num_experts);
  p.num_channels = static_cast<int>(num_channels);
  p.rank_counts = rank_counts.data_ptr<int>();
  p.channel_counts = channel_counts.data_ptr<int>();
  p.expert_counts = expert_counts.data_ptr<int>();
  launch_notify(p, c10::cuda::getCurrentCUDAStream());
}

void Intranode::dispatch(const std::vector<at::Tensor>& sources, const std::vector<at::Tensor>& outputs,
                         at::Tensor& recv_src_idx, const at::Tensor& is_token_in_rank,
                         const at::Tensor& channel_counts, int64_t ring_tokens, int64_t send_chunk) {
  TORCH_CHECK(sources.size() == outputs.size() && sources.size() <= kMaxFields, "1 to 4 (source, output) pairs");
  check_cuda(recv_src_idx, "recv_src_idx", at::kInt);
  check_cuda(is_token_in_rank, "is_token_in_rank", at::kBool);
  check_cuda(channel_counts, "channel_counts", at::kInt);
  DispatchParams p{};
  std::vector<int64_t> widths;
  int64_t offset = 0;
  for (size_t f = 0; f < sources.size(); ++f) {
    const at::Tensor &src = sources[f], &dst = outputs[f];
    TORCH_CHECK(src.is_cuda() && dst.is_cuda() && src.is_contiguous() && dst.is_contiguous(), "contiguous CUDA rows");
    const int64_t bytes = (src.dim() > 1 ? src.stride(0) : 1) * src.element_size();
    TORCH_CHECK(bytes % 4 == 0 && dst.numel() * dst.element_size() == dst.size(0) * bytes, "row widths");
    p.fields[f] = Field{static_cast<const uint8_t*>(src.data_ptr()), static_cast<uint8_t*>(dst.data_ptr()), bytes,
                        offset};
    offset += aligned16(bytes);
    widths.push_back(bytes);
  }
  p.peers = peers_;
  p.rings = rings(channel_counts.size(1), ring_tokens, send_chunk, dispatch_slot_bytes(widths));
  p.num_fields = static_cast<int>(sources.size());
  p.index_offset = offset;
  p.is_token_in_rank = is_token_in_rank.data_ptr<bool>();
  p.channel_counts = channel_counts.data_ptr<int>();
  p.num_tokens = static_cast<int>(is_token_in_rank.size(0));
  p.recv_src_idx = recv_src_idx.data_ptr<int32_t>();
  p.capacity = recv_src_idx.numel();
  c10::cuda::CUDAGuard guard(device_);
  launch_dispatch(p, c10::cuda::getCurrentCUDAStream());
}

void Intranode::combine(const at::Tensor& x, const c10::optional<at::Tensor>& topk_weights,
                        const std::vector<at::Tensor>& biases, const at::Tensor& is_token_in_rank,
                        const at::Tensor& channel_counts, at::Tensor& combined_x,
                        const c10::optional<at::Tensor>& combined_topk_weights, int64_t ring_tokens,
                        int64_t send_chunk) {
  check_cuda(x, "x", at::kBFloat16);
  check_cuda(combined_x, "combined_x", at::kBFloat16);
  check_cuda(is_token_in_rank, "is_token_in_rank", at::kBool);
  check_cuda(channel_counts, "channel_counts", at::kInt);
  TORCH_CHECK(biases.size() <= 2, "at most two biases");
  TORCH_CHECK(topk_weights.has_value() == combined_topk_weights.has_value(), "weights in and out go together");
  CombineParams p{};
  p.hidden = static_cast<int>(x.size(1));
  TORCH_CHECK(p.hidden % 8 == 0, "hidden must be a multiple of 8");
  if (topk_weights) {
    check_cuda(*topk_weights, "topk_weights", at::kFloat);
    check_cuda(*combined_topk_weights, "combined_topk_weights", at::kFloat);
    p.num_topk = static_cast<int>(topk_weights->size(1));
    p.topk_weights = static_cast<const uint8_t*>(topk_weights->data_ptr());
    p.combined_topk_weights = combined_topk_weights->data_ptr<float>();
  }
  for (size_t b = 0; b < biases.size(); ++b) {
    check_cuda(biases[b], "bias", at::kBFloat16);
    p.bias[b] = static_cast<const uint8_t*>(biases[b].data_ptr());
  }
  p.peers = peers_;
  p.rings = rings(channel_counts.size(1), ring_tokens, send_chunk, combine_slot_bytes(p.hidden, p.num_topk));
  p.is_token_in_rank = is_token_in_rank.data_ptr<bool>();
  p.channel_counts = channel_counts.data_ptr<int>();
  p.num_tokens = static_cast<int>(is_token_in_rank.size(0));
  p.x = static_cast<const uint8_t*>(x.data_ptr());
  p.x_rows = x.size(0);
  p.combined_x = static_cast<uint8_t*>(combined_x.data_ptr());
  p.weights_offset = aligned16(int64_t(p.hidden) * 2);
  c10::cuda::CUDAGuard guard(device_);
  launch_combine(p, c10::cuda::getCurrentCUDAStream());
}

void Intranode::poison(const std::vector<at::Tensor>& outputs, const std::vector<int64_t>& patterns,
                       at::Tensor& error_flag) {
  TORCH_CHECK(outputs.size() == patterns.size() && outputs.size() <= kMaxPoisoned, "1 to ", kMaxPoisoned,
              " outputs, one pattern each");
  check_cuda(error_flag, "error_flag", at::kInt);
  TORCH_CHECK(buffer_ != nullptr, "the buffer was destroyed");
  PoisonParams p{};
  p.own = static_cast<const uint8_t*>(buffer_);
  for (size_t o = 0; o < outputs.size(); ++o) {
    const at::Tensor& t = outputs[o];
    const int64_t bytes = t.numel() * t.element_size();
    TORCH_CHECK(t.is_cuda() && t.is_contiguous() && bytes % 4 == 0, "poisoned outputs: contiguous CUDA, 4-byte units");
    p.outputs[o] = Poisoned{static_cast<uint8_t*>(t.data_ptr()), bytes, static_cast<uint32_t>(patterns[o])};
  }
  p.num_outputs = static_cast<int>(outputs.size());
  p.error_flag = error_flag.data_ptr<int>();
  c10::cuda::CUDAGuard guard(device_);
  launch_poison(p, c10::cuda::getCurrentCUDAStream());
}

}  // namespace ep_comm
