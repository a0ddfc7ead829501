// RMSNorm and residual-add + RMSNorm.
//
// Rounding contract (matches HF transformers' LlamaRMSNorm and the references
// in stagewise.ops.reference): statistics in float32;
//   y = T(T(x * rsqrt(mean(x^2) + eps)) * w)     with T the storage dtype.
// With unit_offset (Gemma's RMSNorm, whose weights are stored as w - 1) the
// scale is 1 + w, added in float32, and the product is rounded once:
//   y = T((x * rsqrt(mean(x^2) + eps)) * (1 + float(w))).
// fused_add_rms_norm first rounds the sum into the residual: r = T(r + x).
#pragma once
#include "stagewise/common.h"

namespace stagewise {

struct RmsNormParams {
  void* out;               // [rows, hidden], row stride out_row_stride, last dim contiguous
  int64_t out_row_stride;
  const void* x;           // [rows, hidden], row stride x_row_stride
  int64_t x_row_stride;
  const void* weight;      // [hidden] contiguous
  DType dtype;             // of out, x and weight
  int64_t rows;
  int64_t hidden;
  float eps;
  bool unit_offset;        // scale by 1 + w, rounding once (see above)
};

struct FusedAddRmsNormParams {
  void* x;                 // [rows, hidden] in: the layer output; out: the normalised residual
  int64_t x_row_stride;
  void* residual;          // [rows, hidden] in: residual stream; out: residual + x
  int64_t residual_row_stride;
  const void* weight;      // [hidden]
  DType dtype;
  int64_t rows;
  int64_t hidden;
  float eps;
  bool unit_offset;
};

namespace cpu {
void rms_norm(const RmsNormParams& p);
void fused_add_rms_norm(const FusedAddRmsNormParams& p);
}  // namespace cpu

#ifdef STAGEWISE_HAS_CUDA_DECLS
namespace cuda {
cudaError_t rms_norm(const RmsNormParams& p, cudaStream_t stream);
cudaError_t fused_add_rms_norm(const FusedAddRmsNormParams& p, cudaStream_t stream);
}  // namespace cuda
#endif

}  // namespace stagewise
