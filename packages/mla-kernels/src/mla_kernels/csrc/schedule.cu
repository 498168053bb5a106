#include "schedule_kernel.cuh"

void mla::run_schedule(const mla::ScheduleParams& params, cudaStream_t stream) {
  mla::schedule_kernel<<<1, mla::kScheduleThreads, 0, stream>>>(params);
}
