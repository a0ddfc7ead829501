// Device helpers shared by the CUDA kernels of csrc/cuda: float conversion of
// the storage types (and of the compact KV cache codes), packed 32-bit-word
// loads/stores (16-byte vectors), warp/block reductions, and host-side dtype and
// cache type dispatch and alignment checks.
// No torch headers: kernels take raw pointers and a stream.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "stagewise/common.h"

namespace stagewise::cuda::detail {

// ---- scalar conversion ------------------------------------------------------
// Rounding to a half type is round-to-nearest-even, as torch's .to(dtype).

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// v rounded to T and widened back: the T(...) of the rounding contracts.
template <typename T>
__device__ __forceinline__ float round_to(float v) { return to_float<T>(from_float<T>(v)); }

// ---- packed words -------------------------------------------------------------
// A run of kWords 32-bit words holds kWords * 4 / sizeof(T) values of T,
// element 0 in the lowest bits of word 0 (little endian, as in memory). T may
// also be a compact cache code, int8_t or __nv_fp8_e4m3 (unpack only).

template <typename T, int kWords>
inline constexpr int kValuesIn = kWords * 4 / static_cast<int>(sizeof(T));

// Loads kWords words from p, which must be aligned to 4 * kWords bytes (16 at most per access).
template <int kWords>
__device__ __forceinline__ void load_words(const void* p, uint32_t (&w)[kWords]) {
  static_assert(kWords == 1 || kWords == 2 || kWords % 4 == 0, "1, 2 or a multiple of 4 words");
  if constexpr (kWords == 1) {
    w[0] = *static_cast<const uint32_t*>(p);
  } else if constexpr (kWords == 2) {
    const uint2 v = *static_cast<const uint2*>(p);
    w[0] = v.x;
    w[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i) {
      const uint4 v = static_cast<const uint4*>(p)[i];
      w[4 * i] = v.x;
      w[4 * i + 1] = v.y;
      w[4 * i + 2] = v.z;
      w[4 * i + 3] = v.w;
    }
  }
}

template <int kWords>
__device__ __forceinline__ void store_words(void* p, const uint32_t (&w)[kWords]) {
  static_assert(kWords == 1 || kWords == 2 || kWords % 4 == 0, "1, 2 or a multiple of 4 words");
  if constexpr (kWords == 1) {
    *static_cast<uint32_t*>(p) = w[0];
  } else if constexpr (kWords == 2) {
    *static_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i) {
      static_cast<uint4*>(p)[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
    }
  }
}

template <typename T, int kWords>
__device__ __forceinline__ void unpack(const uint32_t (&w)[kWords], float (&f)[kValuesIn<T, kWords>]) {
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      f[i] = __uint_as_float(w[i]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      // A bfloat16 is the high half of the float32 with the same value.
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else if constexpr (std::is_same_v<T, int8_t>) {
#pragma unroll
      for (int j = 0; j < 4; ++j) f[4 * i + j] = static_cast<float>(static_cast<int8_t>(w[i] >> (8 * j)));
    } else if constexpr (std::is_same_v<T, __nv_fp8_e4m3>) {
      // Two codes at a time to half (exact: every e4m3 value is a half), then to float.
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const __half2 h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[i] >> (16 * j)), __NV_E4M3);
        const float2 v = __half22float2(h);
        f[4 * i + 2 * j] = v.x;
        f[4 * i + 2 * j + 1] = v.y;
      }
    } else {
      static_assert(std::is_same_v<T, __half>, "float, bfloat16, half, int8_t or __nv_fp8_e4m3");
      __half2 h;
      memcpy(&h, &w[i], sizeof(h));
      const float2 v = __half22float2(h);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
}

template <typename T, int kWords>
__device__ __forceinline__ void pack(const float (&f)[kValuesIn<T, kWords>], uint32_t (&w)[kWords]) {
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      w[i] = __float_as_uint(f[i]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const __nv_bfloat162 v = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
      memcpy(&w[i], &v, sizeof(v));
    } else {
      const __half2 v = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
      memcpy(&w[i], &v, sizeof(v));
    }
  }
}

// ---- reductions ---------------------------------------------------------------
// All 32 lanes of the warp must take part.

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the CTA, returned to every thread. blockDim.x must be a multiple of
// 32 (every launch in csrc/cuda rounds it up) and every thread must call it;
// scratch holds >= 32 floats. Ends with a barrier, so the scratch may be
// reused by the next call at once.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : 0.f;
  v = warp_sum(v);  // every warp reduces the partials itself: no broadcast step
  __syncthreads();
  return v;
}

// ---- division by a run-time constant -------------------------------------------
// n / d and n % d for 0 <= n < 2^31 and 1 <= d < 2^31 with a multiply-high, an
// add and a shift (the 32-bit scheme of PyTorch's IntDivider), instead of
// the ~60-instruction 64-bit division. Built on the host, passed by value.
struct FastDivmod {
  uint32_t divisor = 1;
  uint32_t multiplier = 1;
  uint32_t shift = 0;

  FastDivmod() = default;
  explicit FastDivmod(uint32_t d) : divisor(d) {
    while ((uint64_t{1} << shift) < d) ++shift;
    // m = floor(2^32 * (2^shift - d) / d) + 1 < 2^32; then n / d = (mulhi(n, m) + n) >> shift.
    multiplier = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const {
    return (__umulhi(n, multiplier) + n) >> shift;
  }
  __device__ __forceinline__ void divmod(uint32_t n, uint32_t& q, uint32_t& r) const {
    q = div(n);
    r = n - q * divisor;
  }
};

// ---- host side ----------------------------------------------------------------

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether a row/head stride of `stride` elements of `elem_bytes` keeps 16-byte alignment.
inline bool stride_aligned16(int64_t stride, int elem_bytes) { return (stride * elem_bytes) % 16 == 0; }

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Calls f(T{}) with T the storage type of d; returns what f returns.
template <typename F>
cudaError_t dispatch_dtype(DType d, F&& f) {
  switch (d) {
    case DType::kFloat32: return f(float{});
    case DType::kFloat16: return f(__half{});
    case DType::kBFloat16: return f(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

// Calls f(C{}) with C the element type of a paged KV cache of type c beside
// activations of storage type T: T itself, or a one-byte code (common.h).
template <typename T, typename F>
cudaError_t dispatch_cache(CacheType c, F&& f) {
  switch (c) {
    case CacheType::kModel: return f(T{});
    case CacheType::kInt8: return f(int8_t{});
    case CacheType::kFp8E4M3: return f(__nv_fp8_e4m3{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace stagewise::cuda::detail
