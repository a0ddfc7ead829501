// Rotary position embedding, and Qwen3's per-head q/k RMSNorm fused with it.
//
// cos_sin_cache is [max_position, rotary_dim]: columns [0, rotary_dim/2) hold
// cos, [rotary_dim/2, rotary_dim) hold sin. For rotation pair i (0 <= i < rotary_dim/2):
//   NeoX style:  (x[i], x[i + rotary_dim/2])
//   GPT-J style: (x[2i], x[2i + 1])
//   x1' = x1 * cos_i - x2 * sin_i ;  x2' = x2 * cos_i + x1 * sin_i    (float32 maths)
// Features at and after rotary_dim are left as they are.
// qk_norm_rope first applies per-head RMSNorm with the rounding of norm.h
// (y = T(T(x * inv_rms) * w), or with unit_offset Gemma's y = T(x * inv_rms *
// (1 + w))), then rotates y in float32 and rounds once.
// A position outside [0, max_position) is an error on CPU; the CUDA kernel
// leaves such a token untouched (it cannot raise without a host sync).
#pragma once
#include "stagewise/common.h"

namespace stagewise {

struct RopeParams {
  void* q;                 // [num_tokens, num_q_heads, head_dim], last dim contiguous
  int64_t q_token_stride;
  int64_t q_head_stride;
  void* k;                 // [num_tokens, num_k_heads, head_dim], last dim contiguous
  int64_t k_token_stride;
  int64_t k_head_stride;
  const void* q_weight;    // [head_dim] per-head RMSNorm weight (qk_norm_rope only, else null)
  const void* k_weight;    // [head_dim]
  const void* positions;   // [num_tokens]
  IndexType position_type;
  const void* cos_sin_cache;  // [max_position, rotary_dim] contiguous
  DType cache_dtype;       // float32 or the same as dtype
  int64_t max_position;
  DType dtype;             // of q, k and the norm weights
  int64_t num_tokens;
  int64_t num_q_heads;
  int64_t num_k_heads;
  int64_t head_dim;
  int64_t rotary_dim;      // even, <= head_dim
  bool is_neox;
  float eps;               // qk_norm_rope only
  bool unit_offset;        // qk_norm_rope only: Gemma's (1 + w) norm (norm.h)
};

namespace cpu {
void rope(const RopeParams& p);
void qk_norm_rope(const RopeParams& p);
}  // namespace cpu

#ifdef STAGEWISE_HAS_CUDA_DECLS
namespace cuda {
cudaError_t rope(const RopeParams& p, cudaStream_t stream);
cudaError_t qk_norm_rope(const RopeParams& p, cudaStream_t stream);
}  // namespace cuda
#endif

}  // namespace stagewise
