#!/usr/bin/env bash
# Every GPU test and benchmark whose code changed since it last ran on a GPU, as stages that
# each fit one device call (10 minutes). Run on the GPU machine from the repository root, after
# tools/gpu/prepare.sh here, with `.whl` carried:
#
#   BENCH_COMMIT=<commit> bash tools/gpu/pending.sh STAGE [STAGE ...]
#
# Each stage's log (and JSON) and summary.txt go to $OUT (the device call's folder; 8 files
# come back at most) or ./gpu-logs. A stage that fails is reported and the next one still runs;
# the exit status is the number of failures. Each stage is stopped after STAGE_LIMIT_S seconds
# (default 540) and each test after TEST_LIMIT_S (default 240, pytest-timeout); tests are listed
# one a line as they finish, so a stopped stage's log still says which passed and failed.
# Before a call that builds changed CUDA code (any csrc/), run tools/check_cuda_build.py on the
# CPU machine: it compiles and links each extension as the GPU machine will (docs/development.md).
# When a stage's figures are in docs/benchmarks.md, take it off PENDING below.
# Calls that fit the 10-minute limit, most wanted first: `ref-model mtp-bench`, `mtp-sampled
# indexer`, `ref-serving`, `elastic`, `mla-sparse` (with the sparse peer), then `ep-tests
# ep-nvshmem-watchdog ref-kernels`, `mla-peer mla-fp8-registers`, `ref-model-ab`,
# `deepseek-kernels`.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
logs=${OUT:-$root/gpu-logs}
mkdir -p "$logs"
export BENCH_COMMIT=${BENCH_COMMIT:-unknown}
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export MLA_KERNELS_CACHE_DIR=/tmp/mla-kernels EP_COMM_CACHE_DIR=/tmp/ep-comm
export REF_SERVER_CACHE_DIR=/tmp/ref-server
gpu_pytest=(python3 -m pytest -v -rfE -m gpu --timeout="${TEST_LIMIT_S:-240}")
sources=$(printf "$root/packages/%s/src:" mla-kernels ep-comm overlap-sched ref-server)

# What each stage checks, and why it is pending.
declare -A PENDING=(
  [mla-tests]="mla-kernels GPU tests (test_cuda.py): the kernel on every page size, dtype, FP8 cache, both narrow FP8 kernels"
  [mla-sparse]="test_sparse_cuda.py and bench_sparse.py (--peer with FLASHMLA_SPARSE_PEER: tools/gpu/build_flashmla_sparse_peer.py, 37 s): rerun after any change to the sparse kernels; the Triton kernels ran at 0.27-0.51x FlashMLA on an H100 (1e328a7)"
  [mla-peer]="bench_decode.py --peer: every table of the 0.2 goals (uniform, mixed lengths, s_q 2-4, page sizes, FP8) under both timings, FlashMLA built beside"
  [ep-tests]="ep-comm's GPU tests (CUDA IPC rings, NVSHMEM low-latency kernels): the FP8 cast and the low-latency contract moved modules (ep_comm.fp8, ep_comm.low_latency_backend); outputs are allocated before the ranks agree on a call (allocation_fails_between_kernels expects every rank to raise at the dispatch now); host collectives after kernels wait 2 x timeout + 5 s; EP_COMM_OVERFLOW_RETURNS_ROWS (an overflowed rank's combine returns NaN rows, combine.cu) and its test; the low-latency backend vote now carries each rank's NVSHMEM world (nvshmem.world)"
  [ep-nvshmem-watchdog]="ep-comm's low-latency GPU tests with EP_COMM_NVSHMEM_WATCHDOG=1: NVSHMEM init, malloc and free on a watchdog thread (the thread sets the CUDA device); when they pass, turn the watchdog on by default"
  [ref-kernels]="ref-server's GPU tests of its kernels, expert_swiglu's fused epilogue (REF_SERVER_FUSED_SWIGLU) among them, then bench_expert_gemm.py's SwiGLU table"
  [ref-model]="ref-server's GPU tests of the model and engine (25 of 26 passed on an H100 at 7bc1a51): test_prefill_graphs_gpu.py's bf16 case failed there (a bucket's logits not bit-identical to the eager step's)"
  [ref-serving]="ref-server's GPU tests of the deployment (test_serving_gpu.py; its first test ran out of memory on an 80 GB H100, now the one-process reference runs before the instances start): the router's limits and defaults; V3.2 deployments moving index keys through CUDA IPC and NIXL; the MTP module's pages and the prompt's last hidden state through CUDA IPC, a decode engine drafting from it; instances of two ranks drafting with two-batch overlap through ep_comm's cuda backend; then prefill attention, expert balancing, expert-parallel recovery, repro's run"
  [ref-model-ab]="bench_model.py (v2-lite, bf16, batches 1, 32, 128) as is, with REF_SERVER_FUSED_SWIGLU=1, and with --overlap-steps on, one after another in one call"
  [mla-fp8-registers]="bench_decode.py --peer --tables fp8,fp8-registers: the FP8 cache against its bf16 twin with the narrow kernel that dequantizes in registers (MLA_KERNELS_FP8_IN_REGISTERS=1) beside the default one; its tests are in mla-tests"
  [indexer]="ref-server's V3.2 indexer kernels (on by default on CUDA now): test_indexer_kernels.py's gpu tests (the kernel now held to logits_error_bound, the FP8 accumulation's error, per logit: at 1e-4 of the largest logit 5 of 7 failed on an H100 at 7bc1a51), then bench_indexer.py on the current kernel (its last run was 25edc27's)"
  [mtp-sampled]="bench_speculative.py --temperature 0.8: sampled requests drafting eagerly (each draft step's rows drawn at once since f02f0b7, not GPU-timed) and in draft graphs that sample (REF_SERVER_MTP_SAMPLED_GRAPHS=1, off by default until this runs; its test is test_speculative_gpu.py's test_sampled_requests_draft_in_graphs_as_eagerly, in ref-model)"
  [mtp-bench]="bench_speculative.py: rerun after any change to the speculative engine's host path (at 7bc1a51 on an H100 its verify phase took 31-64 ms a round at batch 128 against 15-17 ms replays, and MTP gave 0.72-0.91x plain there)"
  [elastic]="ref-server's elastic instances on the GPU (test_elastic.py's two gpu tests, REF_SERVER_ELASTIC_GPU's path, after building ep_comm's extensions): four ranks sharing the GPU lose rank 2 (SIGKILL, just before its third decode step's graph replays) or rank 0 (SIGSTOP, mid-prefill) and go on over new ep_comm buffers among the others; each test prints every rank's phases (-s) and fails within 100 s naming the state a rank did not reach, so the stage takes at most about 250 s. At 7bc1a51 the kill never came (decode replayed from graphs) and the test hung 300 s; expected now: the survivors' regroup fails with ValueError 'NVSHMEM already runs in this process' (packages/ref-server/NOTES.md)"
  [deepseek-kernels]="ref-server's --kernels deepseek: test_deepseek_kernels_gpu.py (FlashMLA, DeepGEMM, DeepEP against ours; DeepEP's test takes 2 GPUs) and bench_model.py --kernels ours,deepseek:... (V2-Lite's first 9 layers in FP8), with the libraries built beside into DEEPSEEK_LIBS"
)

ep-tests() {
  "${gpu_pytest[@]}" packages/ep-comm/tests
}

ep-nvshmem-watchdog() {
  EP_COMM_NVSHMEM_WATCHDOG=1 "${gpu_pytest[@]}" packages/ep-comm/tests/test_low_latency_gpu.py
}

ref-kernels() {
  local tests=packages/ref-server/tests
  "${gpu_pytest[@]}" $tests/test_{activation,norm,rope,router,moe,latent}_kernels.py \
    $tests/test_expert_{gemm,sort,swiglu}.py $tests/test_fp8_{cast,gemm}.py \
    $tests/test_static_inputs.py || return 1
  python3 packages/ref-server/benchmarks/bench_expert_gemm.py --json "$logs/ref-kernels.json"
}

ref-model() {
  local tests=packages/ref-server/tests
  "${gpu_pytest[@]}" $tests/test_{model,two_batch,prefill_graphs,speculative}_gpu.py
}

ref-serving() {
  local tests=packages/ref-server/tests
  "${gpu_pytest[@]}" $tests/test_serving_gpu.py \
    $tests/test_{prefill_attention,expert_balancing,expert_parallel_recovery}_gpu.py \
    $tests/test_repro_run.py
}

ref-model-ab() {
  local bench="python3 packages/ref-server/benchmarks/bench_model.py --batches 1,32,128 --steps 10"
  echo "== as is" && $bench --json "$logs/ref-model-ab-base.json" &&
    echo "== REF_SERVER_FUSED_SWIGLU=1" &&
    REF_SERVER_FUSED_SWIGLU=1 $bench --json "$logs/ref-model-ab-swiglu.json" &&
    echo "== --overlap-steps on" &&
    $bench --overlap-steps on --json "$logs/ref-model-ab-overlap.json"
}

elastic() {
  # the builds every rank would otherwise wait for within the first test's budget
  python3 -c 'from ep_comm import extension, nvshmem; extension.load_extension(); nvshmem.build_library()' || return 1
  "${gpu_pytest[@]}" -s packages/ref-server/tests/test_elastic.py
}

mtp-bench() {
  python3 packages/ref-server/benchmarks/bench_speculative.py --json "$logs/mtp-bench.json"
}

mtp-sampled() {
  python3 packages/ref-server/benchmarks/bench_speculative.py --temperature 0.8 --batches 32 \
    --engine-batches 1,32,128 --draft-tokens 1,3 --rates 0,0.85,0.9 --json "$logs/mtp-sampled.json"
}

indexer() {
  "${gpu_pytest[@]}" packages/ref-server/tests/test_indexer_kernels.py || return 1
  python3 packages/ref-server/benchmarks/bench_indexer.py --json "$logs/indexer.json"
}

mla-tests() {
  "${gpu_pytest[@]}" packages/mla-kernels/tests \
    --ignore=packages/mla-kernels/tests/test_sparse_cuda.py
}

mla-sparse() {
  "${gpu_pytest[@]}" packages/mla-kernels/tests/test_sparse_cuda.py || return 1
  # --peer once FlashMLA's sparse kernels are built beside ours: tools/gpu/build_flashmla_sparse_peer.py
  # into a folder on PYTHONPATH, with FLASHMLA_SPARSE_PEER=flashmla_sparse_peer
  python3 packages/mla-kernels/benchmarks/bench_sparse.py ${FLASHMLA_SPARSE_PEER:+--peer} \
    --json "$logs/mla-sparse.json"
}

# bench_decode.py --peer, its JSON named $1, with the arguments that follow.
peer-bench() {
  # FlashMLA is built beside ours on this machine as ../shared/peers/flashmla/README.md says;
  # its sources and build never enter this repository.
  if ! [ -d "${FLASHMLA_PEER_BUILD:-}" ]; then
    echo "FLASHMLA_PEER_BUILD is not a folder: build the peer first (../shared/peers/flashmla)"
    return 1
  fi
  local name=$1
  shift
  python3 packages/mla-kernels/benchmarks/bench_decode.py --peer "$@" --json "$logs/$name.json"
}

mla-peer() {
  peer-bench mla-peer
}

mla-fp8-registers() {
  peer-bench mla-fp8-registers --tables fp8,fp8-registers
}

# FlashMLA, DeepGEMM and DeepEP are built outside this repository, into $DEEPSEEK_LIBS
# (packages/ref-server/NOTES.md); the parts whose library imports are compared, the others'
# tests skip.
deepseek-kernels() {
  export PYTHONPATH=${DEEPSEEK_LIBS:+$DEEPSEEK_LIBS:}$PYTHONPATH
  local found=() one_rank=() part module
  for part in attention:flash_mla gemm:deep_gemm exchange:deep_ep; do
    module=${part#*:}
    if python3 -c "import $module" 2>/dev/null; then
      found+=("$module")
      [ "${part%%:*}" = exchange ] || one_rank+=("${part%%:*}")  # bench_model.py: one rank
    else
      echo "$module does not import: its tests skip"
    fi
  done
  if [ ${#found[@]} -eq 0 ]; then
    echo "none of flash_mla, deep_gemm, deep_ep imports: build them into DEEPSEEK_LIBS first (packages/ref-server/NOTES.md)"
    return 1
  fi
  "${gpu_pytest[@]}" packages/ref-server/tests/test_deepseek_kernels_gpu.py
  local status=$?
  if [ ${#one_rank[@]} -eq 0 ]; then
    echo "only deep_ep imports: bench_model.py (one rank) has nothing of DeepSeek's to run"
    return $status
  fi
  python3 packages/ref-server/benchmarks/bench_model.py --preset v2-lite --layers 9 \
    --weight-dtype fp8 --batches 1,32,128 --kernels "ours,deepseek:$(IFS=,; echo "${one_rank[*]}")" \
    --json "$logs/deepseek-kernels.json" || status=1
  return $status
}

if [ "${1:-}" = --stage ]; then  # one stage, run by the loop below under `timeout`
  "$2"
  exit $?
fi
if [ $# -eq 0 ]; then
  echo "usage: tools/gpu/pending.sh STAGE [STAGE ...]; pending:"
  for stage in "${!PENDING[@]}"; do echo "  $stage: ${PENDING[$stage]}"; done
  exit 2
fi
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl || exit 100
fi
export PYTHONPATH=${sources}/tmp/site${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "commit $BENCH_COMMIT"
} >> "$logs/summary.txt" 2>&1
failures=0
for stage in "$@"; do
  if [ -z "${PENDING[$stage]+set}" ]; then
    echo "unknown stage $stage" | tee -a "$logs/summary.txt"
    failures=$((failures + 1))
    continue
  fi
  start=$SECONDS
  timeout -k 10 "${STAGE_LIMIT_S:-540}" bash "$0" --stage "$stage" > "$logs/$stage.log" 2>&1
  status=$?
  [ $status -eq 0 ] || failures=$((failures + 1))
  [ $status -eq 124 ] && echo "$stage: stopped after ${STAGE_LIMIT_S:-540} s" >> "$logs/$stage.log"
  line="$stage: exit $status in $((SECONDS - start)) s; $(tail -n 1 "$logs/$stage.log")"
  echo "$line" | tee -a "$logs/summary.txt"
done
exit $failures
