// quant_linear on the GPU: out = x @ dequant(W).T + bias over GGUF blocks;
// layout, maths and rounding in include/stagewise/quant.h.
//
// One warp per output feature and chunk of kTokens rows of x: lane l takes
// the blocks l, l + 32, ... of the weight row, dequantises each block once
// into registers and runs it against every row of the chunk, then the warp
// reduces the kTokens partial sums. Simple and bandwidth-friendly at decode
// batch sizes (each weight byte is read once per chunk of rows); not a
// tensor-core GEMM for long prompts.
#include "stagewise/quant.h"

#include "common.cuh"

namespace stagewise::cuda {
namespace {

constexpr int kTokens = 8;          // rows of x per warp
constexpr int kWarpsPerBlock = 4;   // output features per CTA

__device__ __forceinline__ float half_at(const uint8_t* p) {
  const uint16_t bits = static_cast<uint16_t>(p[0]) | static_cast<uint16_t>(p[1]) << 8;
  return __half2float(__ushort_as_half(bits));
}

// The 32 weights of one block, exactly as the dequantisation of quant.h.
template <QType Q>
__device__ __forceinline__ void dequantize_block(const uint8_t* blk, float (&w)[kQuantBlock]) {
  const float d = half_at(blk);
  if constexpr (Q == QType::kQ8_0) {
#pragma unroll
    for (int i = 0; i < kQuantBlock; ++i) w[i] = d * static_cast<float>(static_cast<int8_t>(blk[2 + i]));
  } else {
    const uint8_t* qs = blk + (Q == QType::kQ4_1 ? 4 : 2);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int lo = qs[i] & 15, hi = qs[i] >> 4;
      if constexpr (Q == QType::kQ4_1) {
        const float m = half_at(blk + 2);
        w[i] = __fadd_rn(__fmul_rn(d, static_cast<float>(lo)), m);
        w[i + 16] = __fadd_rn(__fmul_rn(d, static_cast<float>(hi)), m);
      } else {
        w[i] = d * static_cast<float>(lo - 8);
        w[i + 16] = d * static_cast<float>(hi - 8);
      }
    }
  }
}

template <QType Q, typename T>
__global__ void quant_linear_kernel(T* out, int64_t out_stride, const T* x, int64_t x_stride,
                                    const uint8_t* qweight, const T* bias, int64_t rows,
                                    int64_t in_features, int64_t out_features) {
  const int lane = threadIdx.x & 31;
  const int64_t n = int64_t{blockIdx.x} * kWarpsPerBlock + (threadIdx.x >> 5);
  if (n >= out_features) return;  // whole warps only: no barrier below
  const int64_t nblocks = in_features / kQuantBlock;
  const uint8_t* row = qweight + n * nblocks * quant_block_bytes(Q);
  // Chunks of kTokens rows, grid-strided: any row count fits the grid's y limit.
  for (int64_t t0 = int64_t{blockIdx.y} * kTokens; t0 < rows; t0 += int64_t{gridDim.y} * kTokens) {
    const int tokens = static_cast<int>(rows - t0 < kTokens ? rows - t0 : kTokens);
    float acc[kTokens];
#pragma unroll
    for (int t = 0; t < kTokens; ++t) acc[t] = 0.f;
    for (int64_t b = lane; b < nblocks; b += 32) {
      float w[kQuantBlock];
      dequantize_block<Q>(row + b * quant_block_bytes(Q), w);
#pragma unroll
      for (int t = 0; t < kTokens; ++t) {
        if (t < tokens) {
          const T* xr = x + (t0 + t) * x_stride + b * kQuantBlock;
          float s = 0.f;
#pragma unroll
          for (int i = 0; i < kQuantBlock; ++i) s = fmaf(detail::to_float<T>(xr[i]), w[i], s);
          acc[t] += s;
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      const float s = detail::warp_sum(acc[t]);
      if (lane == 0 && t < tokens) {
        const float b = bias != nullptr ? detail::to_float<T>(bias[n]) : 0.f;
        out[(t0 + t) * out_stride + n] = detail::from_float<T>(s + b);
      }
    }
  }
}

}  // namespace

cudaError_t quant_linear(const QuantLinearParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.out_features == 0) return cudaSuccess;
  const int64_t grid_x = detail::ceil_div(p.out_features, kWarpsPerBlock);
  if (grid_x > INT32_MAX) return cudaErrorInvalidConfiguration;
  const int64_t chunks = detail::ceil_div(p.rows, kTokens);  // the kernel strides over the rest
  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(chunks < 65535 ? chunks : 65535));
  return detail::dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto kernel) {
      kernel<<<grid, 32 * kWarpsPerBlock, 0, stream>>>(
          static_cast<T*>(p.out), p.out_row_stride, static_cast<const T*>(p.x), p.x_row_stride,
          p.qweight, static_cast<const T*>(p.bias), p.rows, p.in_features, p.out_features);
      return cudaGetLastError();
    };
    switch (p.qtype) {
      case QType::kQ4_0: return launch(quant_linear_kernel<QType::kQ4_0, T>);
      case QType::kQ4_1: return launch(quant_linear_kernel<QType::kQ4_1, T>);
      case QType::kQ8_0: return launch(quant_linear_kernel<QType::kQ8_0, T>);
    }
    return cudaErrorInvalidValue;
  });
}

}  // namespace stagewise::cuda
