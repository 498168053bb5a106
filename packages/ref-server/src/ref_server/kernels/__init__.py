"""ref-server's own GPU kernels, one module per op family, apart from `ref_server.model` so that
the model reads as the model: each module registers its ops with `torch.library` (schema, CUDA
implementation, the plain-torch reference for every other device, a fake implementation) and
holds that reference path beside its Triton or CUDA kernel.

- `norm` (RMSNorm and the residual add), `rope`, `latent` (a step's latent rows into the paged
  cache, with the queries' rope), `activation` (SwiGLU, with the FP8 cast of its output)
- `routing` (the MoE gate's scores and group-limited top-k), `expert_sort` (rows grouped by
  expert), `moe` (the routed experts' weighted sum)
- `fp8_cast` (the block-scaled FP8 formats and the activations' cast), `fp8_gemm` (the block-
  scaled GEMM: Triton, torch._scaled_mm or `cutlass_gemm`), `expert_gemm` (bf16 grouped and
  batched expert GEMMs), `expert_swiglu` (gate, up and SwiGLU in one GEMM's epilogue)
- `pdl`: programmatic dependent launch for the Triton kernels
- `deepseek`: adapters that run DeepSeek's own FlashMLA, DeepGEMM and DeepEP in their place
"""
