// Linear layers over GGUF block-quantised weights: out = x @ dequant(W).T + bias.
//
// Weight layout (llama.cpp / GGUF, ggml-common.h): each row of W [out, in] is
// in / 32 blocks of 32 weights, stored back to back; a block is
//   Q4_0 (18 bytes): fp16 d, 16 bytes qs;  w[i] = d * (q[i] - 8)
//   Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes qs;  w[i] = d * q[i] + m
//   Q8_0 (34 bytes): fp16 d, 32 int8 qs;  w[i] = d * qs[i]
// where for the 4-bit types q[i] = qs[i] & 15 and q[i + 16] = qs[i] >> 4 (i < 16).
// The fp16 scales are little-endian IEEE half.
//
// Maths and rounding: every weight is its exact float32 dequantised value
// (d * q is exact in float32: an 11-bit by 8-bit product, so the Q4_1 "+ m"
// rounds once, as in gguf.quants.dequantize); products are summed in float32
// (the order is the kernel's own); the bias (in x's dtype) is added in float32
// and the sum is rounded once to x's dtype on store.
//
// quant_linear_int8, the reduced-precision mode (approximate, llama.cpp's CPU scheme): each
// block of 32 values of a row of x (as float32) is quantised to int8,
//   d_x = max|x| / 127 (float32),  q_x = round_half_even(x * (1 / d_x))  (q_x = 0 when d_x = 0),
// and each block of W meets it in exact integer arithmetic:
//   Q8_0: d * d_x * sum(q * q_x)      Q4_0: d * d_x * sum((q - 8) * q_x)
//   Q4_1: d * d_x * sum(q * q_x) + m * (d_x * sum(q_x))
// (d * d_x and d_x * sum(q_x) rounded to float32 once); block results are summed in float32
// in the kernel's order, then bias and rounding as above. Against the exact op the error is
// that of x's quantisation: at most d_x / 2 per value of x.
#pragma once
#include "stagewise/common.h"

namespace stagewise {

// GGML tensor type ids (ggml.h `enum ggml_type`), the block types the op accepts.
enum class QType : int32_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

inline constexpr int64_t kQuantBlock = 32;  // weights per block, every type above

// Bytes of one block of `t`; 0 for a type the op does not know.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline constexpr int64_t quant_block_bytes(QType t) {
  return t == QType::kQ4_0 ? 18 : t == QType::kQ4_1 ? 20 : t == QType::kQ8_0 ? 34 : 0;
}

struct QuantLinearParams {
  void* out;                  // [rows, out_features], row stride out_row_stride (elements), dtype
  int64_t out_row_stride;
  const void* x;              // [rows, in_features], row stride x_row_stride (elements), dtype
  int64_t x_row_stride;
  const uint8_t* qweight;     // [out_features, in_features / 32 * block bytes] contiguous
  const void* bias;           // [out_features] contiguous, dtype; nullptr: no bias
  DType dtype;                // of out, x and bias
  QType qtype;
  int64_t rows;
  int64_t in_features;        // a multiple of kQuantBlock
  int64_t out_features;
};

namespace cpu {
void quant_linear(const QuantLinearParams& p);
void quant_linear_int8(const QuantLinearParams& p);
// out [rows, in_features] float32 = the exact dequantised values of qweight's first `rows` rows.
void quant_dequantize(const uint8_t* qweight, QType qtype, int64_t rows, int64_t in_features, float* out);
}  // namespace cpu

#ifdef STAGEWISE_HAS_CUDA_DECLS
namespace cuda {
cudaError_t quant_linear(const QuantLinearParams& p, cudaStream_t stream);
}  // namespace cuda
#endif

}  // namespace stagewise
