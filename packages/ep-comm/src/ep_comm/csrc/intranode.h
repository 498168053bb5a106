// The cuda backend's per-Buffer state: this rank's IPC buffer, the peers' mappings, the status.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "layout.h"

namespace ep_comm {

class Intranode {
 public:
  // Allocates `num_bytes` of zeroed memory on the current device; `connect` maps the peers'
  // buffers. Every launch runs on that device, whichever is current.
  Intranode(int64_t rank, int64_t num_ranks, int64_t num_bytes, double timeout_s);
  at::Tensor ipc_handle() const;  // 64 bytes, CPU uint8
  void connect(const std::vector<at::Tensor>& handles);
  // Destroying is collective (Python): every rank closes its mappings of the peers' buffers,
  // then, once all have, frees its own.
  void close_peers();
  void free_buffer();

  std::vector<int64_t> status() const;  // see kStatusInts

  // Wait (on the GPU) until every rank has finished its previous call; notify does it itself.
  void barrier();

  // After a failure of this buffer (a timeout or an overflow, now or earlier): fill `outputs`
  // (contiguous CUDA tensors of a multiple of 4 bytes; `patterns` their 4-byte fill: NaN, -1)
  // and set error_flag [1] int32. Otherwise nothing. Enqueued after every call's kernels.
  void poison(const std::vector<at::Tensor>& outputs, const std::vector<int64_t>& patterns, at::Tensor& error_flag);

  static int64_t control_bytes() { return kControlBytes; }
  static int64_t dispatch_slot_bytes(const std::vector<int64_t>& row_bytes);
  static int64_t combine_slot_bytes(int64_t hidden, int64_t num_topk);

  // is_token_in_rank [num_tokens, num_ranks] bool, num_tokens_per_expert [num_experts] int32 in;
  // rank_counts [num_ranks, num_ranks], channel_counts [num_ranks, num_channels],
  // expert_counts [num_experts / num_ranks] int32 out.
  void notify(const at::Tensor& is_token_in_rank, const at::Tensor& num_tokens_per_expert, at::Tensor& rank_counts,
              at::Tensor& channel_counts, at::Tensor& expert_counts);

  // sources[f]: [num_tokens, ...] rows sent; outputs[f]: [capacity, ...] rows received, by
  // source rank then channel (channel_counts from notify). recv_src_idx: [capacity] int32.
  void dispatch(const std::vector<at::Tensor>& sources, const std::vector<at::Tensor>& outputs,
                at::Tensor& recv_src_idx, const at::Tensor& is_token_in_rank, const at::Tensor& channel_counts,
                int64_t ring_tokens, int64_t send_chunk);

  // x [rows, hidden] bf16 and topk_weights [rows, num_topk] fp32 in dispatch's order; biases
  // [num_tokens, hidden] bf16; combined_x [num_tokens, hidden] bf16, combined_topk_weights
  // [num_tokens, num_topk] fp32 out.
  void combine(const at::Tensor& x, const c10::optional<at::Tensor>& topk_weights,
               const std::vector<at::Tensor>& biases, const at::Tensor& is_token_in_rank,
               const at::Tensor& channel_counts, at::Tensor& combined_x,
               const c10::optional<at::Tensor>& combined_topk_weights, int64_t ring_tokens, int64_t send_chunk);

 private:
  Rings rings(int64_t num_channels, int64_t ring_tokens, int64_t send_chunk, int64_t slot_bytes) const;

  Peers peers_{};
  int64_t num_bytes_;
  void* buffer_ = nullptr;
  int* status_ = nullptr;
  bool connected_ = false;
  int device_;
};

}  // namespace ep_comm
