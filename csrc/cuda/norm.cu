// RMSNorm and residual-add + RMSNorm on the GPU; maths and rounding in
// include/stagewise/norm.h:  y = T(T(x * rsqrt(mean(x^2) + eps)) * w), or with
// unit_offset (kUnit, Gemma) y = T(x * rsqrt(mean(x^2) + eps) * (1 + w));
// fused: r = T(r + x) first, then y = rms_norm(r) written over x.
//
// Two kernels, each a grid-stride loop over rows:
//  * vectorised: every pointer, row stride and `hidden` allow 16-byte accesses
//    and the row fits in registers (kVecsPerThread vectors per thread); the row
//    is read once, all its loads issued before the first use. A row of at most
//    32 * kVecsPerThread vectors takes one warp (kWarpsPerBlock rows per CTA,
//    shuffle reduction, no barrier), a longer one a whole CTA;
//  * scalar: anything else (hidden 7, 83, ..., odd strides, huge rows), one
//    CTA per row; two passes over the row, the second mostly served from cache.
#include "stagewise/norm.h"

#include <algorithm>
#include <climits>
#include <type_traits>

#include "common.cuh"

namespace stagewise::cuda {
namespace {

using detail::block_sum;
using detail::from_float;
using detail::round_to;
using detail::to_float;

constexpr int kVecsPerThread = 4;
constexpr int kMaxThreads = 1024;
constexpr int kWarpsPerBlock = 4;  // rows per CTA in warp-per-row mode
constexpr int kScalarThreads = 256;
constexpr int64_t kMaxGrid = int64_t{1} << 20;  // more rows loop inside the kernel
constexpr int kWords = 4;                       // one 16-byte vector

// The normalised value before its final rounding: T(v * inv_rms) * w, or Gemma's
// v * inv_rms * (1 + w) (kUnit), every step rounded to float32 as the CPU does it.
template <typename T, bool kUnit>
__device__ __forceinline__ float normed(float v, float inv_rms, float w) {
  if constexpr (kUnit) return __fmul_rn(__fmul_rn(v, inv_rms), __fadd_rn(1.f, w));
  return round_to<T>(v * inv_rms) * w;
}

// out may alias x (rms_norm in place, and always for the fused op), so no
// __restrict__: each element is read before the same thread writes it.
// residual is null unless kFused. Rows: [rows, hidden] with the given strides.
// kWarpPerRow: each warp owns its rows (its trip count may differ from its
// neighbours': no barrier in that mode); else the CTA owns a row.
template <typename T, bool kFused, bool kWarpPerRow, bool kUnit>
__global__ void rms_norm_vec_kernel(T* out, int64_t out_stride, const T* x, int64_t x_stride,
                                    T* residual, int64_t residual_stride, const T* weight,
                                    int64_t rows, int hidden, float eps) {
  constexpr int kN = detail::kValuesIn<T, kWords>;
  __shared__ float scratch[32];
  const int num_vecs = hidden / kN;
  const int row_thread = kWarpPerRow ? threadIdx.x & 31 : threadIdx.x;
  const int row_threads = kWarpPerRow ? 32 : blockDim.x;
  const int64_t first_row = kWarpPerRow ? int64_t{blockIdx.x} * kWarpsPerBlock + (threadIdx.x >> 5)
                                        : int64_t{blockIdx.x};
  const int64_t row_step = kWarpPerRow ? int64_t{gridDim.x} * kWarpsPerBlock : int64_t{gridDim.x};
  for (int64_t row = first_row; row < rows; row += row_step) {
    const T* x_row = x + row * x_stride;
    T* r_row = kFused ? residual + row * residual_stride : nullptr;
    uint32_t xw[kVecsPerThread][kWords];
    uint32_t rw[kVecsPerThread][kWords];
    uint32_t ww[kVecsPerThread][kWords];
    // Issue every load of this thread before using any of them.
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int j = row_thread + i * row_threads;
      if (j < num_vecs) {
        detail::load_words(x_row + j * kN, xw[i]);
        if constexpr (kFused) detail::load_words(r_row + j * kN, rw[i]);
        detail::load_words(weight + j * kN, ww[i]);
      }
    }
    float sum_sq = 0.f;
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int j = row_thread + i * row_threads;
      if (j < num_vecs) {
        float v[kN];
        detail::unpack<T>(xw[i], v);
        if constexpr (kFused) {
          float r[kN];
          detail::unpack<T>(rw[i], r);
#pragma unroll
          for (int e = 0; e < kN; ++e) v[e] = round_to<T>(r[e] + v[e]);
          detail::pack<T>(v, xw[i]);  // xw now holds the new residual, rounded
          detail::store_words(r_row + j * kN, xw[i]);
        }
#pragma unroll
        for (int e = 0; e < kN; ++e) sum_sq += v[e] * v[e];
      }
    }
    const float total = kWarpPerRow ? detail::warp_sum(sum_sq) : block_sum(sum_sq, scratch);
    const float inv_rms = rsqrtf(total / static_cast<float>(hidden) + eps);
    T* out_row = out + row * out_stride;
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int j = row_thread + i * row_threads;
      if (j < num_vecs) {
        float v[kN], w[kN];
        detail::unpack<T>(xw[i], v);
        detail::unpack<T>(ww[i], w);
#pragma unroll
        for (int e = 0; e < kN; ++e) v[e] = normed<T, kUnit>(v[e], inv_rms, w[e]);
        uint32_t yw[kWords];
        detail::pack<T>(v, yw);
        detail::store_words(out_row + j * kN, yw);
      }
    }
  }
}

// Any hidden size, stride and alignment. Thread t owns elements t, t + blockDim,
// ... in both passes, so the fused op reads back only what it wrote itself.
template <typename T, bool kFused, bool kUnit>
__global__ void rms_norm_scalar_kernel(T* out, int64_t out_stride, const T* x, int64_t x_stride,
                                       T* residual, int64_t residual_stride, const T* weight,
                                       int64_t rows, int hidden, float eps) {
  __shared__ float scratch[32];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* x_row = x + row * x_stride;
    T* r_row = kFused ? residual + row * residual_stride : nullptr;
    float sum_sq = 0.f;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
      float v = to_float(x_row[j]);
      if constexpr (kFused) {
        const T r = from_float<T>(to_float(r_row[j]) + v);
        r_row[j] = r;
        v = to_float(r);
      }
      sum_sq += v * v;
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / static_cast<float>(hidden) + eps);
    T* out_row = out + row * out_stride;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
      const float v = kFused ? to_float(r_row[j]) : to_float(x_row[j]);
      out_row[j] = from_float<T>(normed<T, kUnit>(v, inv_rms, to_float(weight[j])));
    }
  }
}

int round_up_warp(int64_t n) { return static_cast<int>(std::max<int64_t>(32, (n + 31) / 32 * 32)); }

template <typename T, bool kFused, bool kUnit>
cudaError_t launch(T* out, int64_t out_stride, const T* x, int64_t x_stride, T* residual,
                   int64_t residual_stride, const T* weight, int64_t rows, int64_t hidden, float eps,
                   cudaStream_t stream) {
  if (rows <= 0 || hidden <= 0) return cudaSuccess;
  if (hidden > INT_MAX) return cudaErrorInvalidValue;
  constexpr int kN = detail::kValuesIn<T, kWords>;
  constexpr int kBytes = sizeof(T);
  const int64_t num_vecs = hidden / kN;
  const bool vec_ok =
      hidden % kN == 0 && num_vecs <= int64_t{kVecsPerThread} * kMaxThreads &&
      detail::aligned16(out) && detail::aligned16(x) && detail::aligned16(weight) &&
      detail::stride_aligned16(out_stride, kBytes) && detail::stride_aligned16(x_stride, kBytes) &&
      (!kFused || (detail::aligned16(residual) && detail::stride_aligned16(residual_stride, kBytes)));
  const dim3 grid(static_cast<unsigned>(std::min(rows, kMaxGrid)));
  if (vec_ok && num_vecs <= 32 * kVecsPerThread) {
    const dim3 warp_grid(static_cast<unsigned>(std::min(detail::ceil_div(rows, kWarpsPerBlock), kMaxGrid)));
    rms_norm_vec_kernel<T, kFused, true, kUnit><<<warp_grid, 32 * kWarpsPerBlock, 0, stream>>>(
        out, out_stride, x, x_stride, residual, residual_stride, weight, rows,
        static_cast<int>(hidden), eps);
  } else if (vec_ok) {
    const int threads = round_up_warp(detail::ceil_div(num_vecs, kVecsPerThread));
    rms_norm_vec_kernel<T, kFused, false, kUnit><<<grid, threads, 0, stream>>>(
        out, out_stride, x, x_stride, residual, residual_stride, weight, rows,
        static_cast<int>(hidden), eps);
  } else {
    const int threads = std::min(kScalarThreads, round_up_warp(hidden));
    rms_norm_scalar_kernel<T, kFused, kUnit><<<grid, threads, 0, stream>>>(
        out, out_stride, x, x_stride, residual, residual_stride, weight, rows,
        static_cast<int>(hidden), eps);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t rms_norm(const RmsNormParams& p, cudaStream_t stream) {
  return detail::dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    auto run = [&](auto unit) {
      return launch<T, false, decltype(unit)::value>(
          static_cast<T*>(p.out), p.out_row_stride, static_cast<const T*>(p.x), p.x_row_stride, nullptr, 0,
          static_cast<const T*>(p.weight), p.rows, p.hidden, p.eps, stream);
    };
    return p.unit_offset ? run(std::true_type{}) : run(std::false_type{});
  });
}

cudaError_t fused_add_rms_norm(const FusedAddRmsNormParams& p, cudaStream_t stream) {
  return detail::dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    T* x = static_cast<T*>(p.x);
    auto run = [&](auto unit) {
      return launch<T, true, decltype(unit)::value>(
          x, p.x_row_stride, x, p.x_row_stride, static_cast<T*>(p.residual), p.residual_row_stride,
          static_cast<const T*>(p.weight), p.rows, p.hidden, p.eps, stream);
    };
    return p.unit_offset ? run(std::true_type{}) : run(std::false_type{});
  });
}

}  // namespace stagewise::cuda
