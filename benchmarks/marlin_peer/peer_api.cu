// C entry for the peer probe: vLLM's Marlin MoE W4A16 kernel (vendored by vllm.cpp) on one expert with
// every token routed to it, i.e. a dense NVFP4 GEMM y = x @ W^T (bf16 x, e2m1 W, e4m3 scales per 16, fp32 global).
#include <cstdio>
#include <exception>
#include "core/scalar_type.hpp"
#include "libtorch_stable/moe/marlin_moe_wna16/marlin_mm.h"

static char g_err[2048];
extern "C" const char* kvs_marlin_error() { return g_err; }

extern "C" int kvs_marlin_dense(const void* A, const void* B, void* C, void* C_tmp, void* b_s, void* g_s,
                                void* sorted_ids, void* expert_ids, void* num_past_padded, void* topk_w,
                                int block, int m, int n, int k, void* workspace, int dev, void* stream, int sms,
                                int thread_k, int thread_n, int blocks_per_sm) {
  try {
    marlin_moe_wna16::marlin_mm(A, B, C, C_tmp, nullptr, nullptr, b_s, g_s, nullptr, nullptr, nullptr, nullptr,
                                sorted_ids, expert_ids, num_past_padded, topk_w, block, 1, 1, false, m, n, k,
                                workspace, vllm::kBFloat16, vllm::kFE2M1f, vllm::kBFloat16, vllm::kFE4M3fn,
                                false, false, true, false, k / 16, 16, dev, (cudaStream_t)stream,
                                thread_k, thread_n, sms, blocks_per_sm, false, true, false);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) { snprintf(g_err, sizeof g_err, "CUDA: %s", cudaGetErrorString(e)); return 2; }
    return 0;
  } catch (const std::exception& ex) {
    snprintf(g_err, sizeof g_err, "%s", ex.what());
    return 1;
  }
}
