// quant_linear on the GPU: out = x @ dequant(W).T + bias over GGUF blocks;
// layout, maths and rounding in include/stagewise/quant.h.
//
// One warp per output feature and chunk of kTokens rows of x: lane l takes
// the 32-weight sub-blocks l, l + 32, ... of the weight row, dequantises each block once
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

// The 32 weights of sub-block `sub` of the block at blk, exactly as the dequantisation of quant.h
// (each a single rounding: __fmaf_rn where a product and a sum meet, products alone rounded once).
template <QType Q>
__device__ __forceinline__ void dequantize_sub(const uint8_t* blk, int sub, float (&w)[kQuantBlock]) {
  if constexpr (Q == QType::kQ8_0) {
    const float d = half_at(blk);
#pragma unroll
    for (int i = 0; i < kQuantBlock; ++i) w[i] = d * static_cast<float>(static_cast<int8_t>(blk[2 + i]));
  } else if constexpr (Q == QType::kQ4_K) {
    int sc, mn;
    q4_k_scale_min(blk + 4, sub, &sc, &mn);
    const float a = __fmul_rn(half_at(blk), static_cast<float>(sc));
    const float b = -__fmul_rn(half_at(blk + 2), static_cast<float>(mn));
    const uint8_t* qs = blk + 16 + 32 * (sub / 2);
    const int shift = 4 * (sub % 2);
#pragma unroll
    for (int i = 0; i < kQuantBlock; ++i) w[i] = __fmaf_rn(static_cast<float>((qs[i] >> shift) & 15), a, b);
  } else if constexpr (Q == QType::kQ6_K) {
    const float d = half_at(blk + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const int h = sub / 4, r0 = 32 * (sub % 4);
    const uint8_t* ql = blk + 64 * h + r0 % 64;
    const uint8_t* qh = blk + 128 + 32 * h;
#pragma unroll
    for (int i = 0; i < kQuantBlock; ++i) {
      const int q = ((ql[i] >> (4 * (r0 / 64))) & 15) | (((qh[i] >> (2 * (r0 / 32))) & 3) << 4);
      const float a = __fmul_rn(d, static_cast<float>(sc[2 * sub + i / 16]));
      w[i] = __fmul_rn(a, static_cast<float>(q - 32));
    }
  } else {
    const float d = half_at(blk);
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
  constexpr int kSubs = static_cast<int>(quant_block_weights(Q) / kQuantBlock);  // sub-blocks a block
  const int64_t nsubs = in_features / kQuantBlock;
  const uint8_t* row = qweight + n * (in_features / quant_block_weights(Q)) * quant_block_bytes(Q);
  // Chunks of kTokens rows, grid-strided: any row count fits the grid's y limit.
  for (int64_t t0 = int64_t{blockIdx.y} * kTokens; t0 < rows; t0 += int64_t{gridDim.y} * kTokens) {
    const int tokens = static_cast<int>(rows - t0 < kTokens ? rows - t0 : kTokens);
    float acc[kTokens];
#pragma unroll
    for (int t = 0; t < kTokens; ++t) acc[t] = 0.f;
    for (int64_t b = lane; b < nsubs; b += 32) {  // b: the sub-block, 32 weights
      float w[kQuantBlock];
      dequantize_sub<Q>(row + b / kSubs * quant_block_bytes(Q), static_cast<int>(b % kSubs), w);
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
      case QType::kQ4_K: return launch(quant_linear_kernel<QType::kQ4_K, T>);
      case QType::kQ6_K: return launch(quant_linear_kernel<QType::kQ6_K, T>);
    }
    return cudaErrorInvalidValue;
  });
}

}  // namespace stagewise::cuda
