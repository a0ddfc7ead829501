// Float32 row helpers of the CPU attention kernels (attention.cpp, merge.cpp):
// dtype <-> float32 rows, dot products and p·V accumulation over a tile of
// rows, exp of softmax numerators, and the pairwise log-sum-exp merge of two
// partial attention results (the one merge both kernels use).
//
// Everything here is force-inlined so that a caller compiled for a wider ISA
// (see STAGEWISE_TARGET_AVX2 in attention.cpp) gets these loops vectorised for
// that ISA too.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "stagewise/common.h"

// The hot loops are compiled twice: for the baseline ISA and, on x86-64, for
// AVX2+FMA (STAGEWISE_TARGET_AVX2 of cpu/isa.h), picked at run time by
// cpu_isa() (so STAGEWISE_CPU_ISA=baseline selects the baseline), and the
// build needs no -march flag.
#include "cpu/isa.h"
#ifdef STAGEWISE_X86
#define STAGEWISE_HAVE_AVX2_PATH 1
#endif

#if defined(__GNUC__) || defined(__clang__)
#define STAGEWISE_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define STAGEWISE_ALWAYS_INLINE inline
#endif

namespace stagewise::cpu {

#ifdef STAGEWISE_HAVE_AVX2_PATH
inline bool use_avx2_path() { return cpu_isa() >= Isa::kAvx2; }
#endif

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Eight floats: one AVX2 register, two SSE/NEON registers. GCC/Clang vector
// extensions keep the loops below vectorised for whatever ISA the caller is
// compiled for. Vectors only live in locals and references, never as by-value
// parameters (their ABI depends on the ISA).
typedef float VecF __attribute__((vector_size(32)));
typedef uint32_t VecU __attribute__((vector_size(32)));
typedef int32_t VecI __attribute__((vector_size(32)));
typedef uint16_t VecH __attribute__((vector_size(16)));
inline constexpr int64_t kVec = 8;

STAGEWISE_ALWAYS_INLINE void vload(VecF& v, const float* p) { __builtin_memcpy(&v, p, sizeof(VecF)); }
STAGEWISE_ALWAYS_INLINE void vstore(float* p, const VecF& v) { __builtin_memcpy(p, &v, sizeof(VecF)); }
STAGEWISE_ALWAYS_INLINE float hsum(const VecF& v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

#if defined(__clang__)
#define STAGEWISE_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define STAGEWISE_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, VecI{__VA_ARGS__})
#endif

// out[i] = sum of the lanes of v[i] for i < 8: a transposing add tree (7 adds)
// instead of 8 separate horizontal sums.
STAGEWISE_ALWAYS_INLINE void hsum8(const VecF* v, float* out) {
  VecF pair[4], quad[2];
  for (int k = 0; k < 4; ++k) {  // lane 2m + r: lanes 2m, 2m+1 of row 2k + r
    pair[k] = STAGEWISE_SHUFFLE(v[2 * k], v[2 * k + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
              STAGEWISE_SHUFFLE(v[2 * k], v[2 * k + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  }
  for (int k = 0; k < 2; ++k) {  // lane 4m + r: lanes 4m..4m+3 of row 4k + r
    quad[k] = STAGEWISE_SHUFFLE(pair[2 * k], pair[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
              STAGEWISE_SHUFFLE(pair[2 * k], pair[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  const VecF sums = STAGEWISE_SHUFFLE(quad[0], quad[1], 0, 1, 2, 3, 8, 9, 10, 11) +
                    STAGEWISE_SHUFFLE(quad[0], quad[1], 4, 5, 6, 7, 12, 13, 14, 15);
  vstore(out, sums);
}

// out[i] = exp(x[i]) for 8 values x <= 0 (softmax numerators), about 2 ulp
// (Cephes' expf: Cody-Waite reduction by ln 2, degree-6 polynomial, 2^n from
// the exponent bits); below -87 the result would be subnormal and is 0.
STAGEWISE_ALWAYS_INLINE void exp8_nonpositive(const float* x, float* out) {
  VecF v;
  vload(v, x);
  const VecU underflow = (VecU)(v < -87.f);
  v = (VecF)(((VecU)v & ~underflow) | ((VecU)(VecF{} - 87.f) & underflow));
  // v = n ln2 + r, |r| <= ln2 / 2; v <= 0, so truncating fx - 0.5 rounds to nearest.
  const VecF fx = v * 1.44269504088896341f - 0.5f;
  const VecI n = __builtin_convertvector(fx, VecI);
  const VecF nf = __builtin_convertvector(n, VecF);
  const VecF r = (v - nf * 0.693359375f) + nf * 2.12194440e-4f;
  VecF p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const VecF pow2n = (VecF)((n + 127) << 23);  // n >= -126: a normal number
  const VecU bits = (VecU)(p * pow2n) & ~underflow;
  __builtin_memcpy(out, &bits, sizeof(VecU));
}

// max of x[0..n), n >= 1; eight lanes at a time.
STAGEWISE_ALWAYS_INLINE float max_of(const float* x, int64_t n) {
  float m = x[0];
  int64_t i = 0;
  if (n >= kVec) {
    VecF acc, v;
    vload(acc, x);
    for (i = kVec; i + kVec <= n; i += kVec) {
      vload(v, x + i);
      acc = acc > v ? acc : v;
    }
    for (int k = 0; k < kVec; ++k) m = std::max(m, acc[k]);
  }
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// x[i] = exp(x[i] - shift) for i < n (every x[i] <= shift: softmax numerators);
// returns their sum, eight lanes at a time.
STAGEWISE_ALWAYS_INLINE float exp_shifted_sum(float* x, int64_t n, float shift) {
  VecF acc{}, v;
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) {
    vload(v, x + i);
    vstore(x + i, v - shift);
    exp8_nonpositive(x + i, x + i);
    vload(v, x + i);
    acc += v;
  }
  float sum = hsum(acc);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    sum += x[i];
  }
  return sum;
}

// Calls fn(T{}) with T the storage type of `dtype`.
template <typename Fn>
void dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: fn(float{}); break;
    case DType::kBFloat16: fn(c10::BFloat16{}); break;
    case DType::kFloat16: fn(c10::Half{}); break;
  }
}

// IEEE half -> float32 for 8 values at once, in integer vector ops (c10::Half's
// conversion only vectorises with -mf16c). Same algorithm as c10's
// fp16_ieee_to_fp32_value: exact for every input, subnormals, inf and nan included.
STAGEWISE_ALWAYS_INLINE void half8_to_float(const c10::Half* src, float* dst) {
  VecH h;
  __builtin_memcpy(&h, src, sizeof(VecH));
  const VecU w = __builtin_convertvector(h, VecU) << 16;
  const VecU sign = w & 0x80000000u;
  const VecU two_w = w + w;
  // Normal numbers (and inf/nan): shift into place and rebias the exponent by 2^-112.
  const VecF normal = (VecF)((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  // Subnormals: put the mantissa under the exponent of 0.5, then subtract 0.5.
  const VecF subnormal = (VecF)((two_w >> 17) | (126u << 23)) - 0.5f;
  const VecU is_subnormal = (VecU)(two_w < (1u << 27));
  const VecU bits = sign | ((VecU)subnormal & is_subnormal) | ((VecU)normal & ~is_subnormal);
  __builtin_memcpy(dst, &bits, sizeof(VecU));
}

// A compact cache's code types (common.h's CacheType): one byte a value, a float16 scale per
// token and kv head beside them.
using Fp8 = c10::Float8_e4m3fn;
template <typename C>
inline constexpr bool kCompact = std::is_same_v<C, int8_t> || std::is_same_v<C, Fp8>;

// Calls fn(T{}, C{}) with T the storage type of `dtype` and C the element type of a paged KV cache
// of type `cache` beside it: T itself, or a one-byte code.
template <typename Fn>
void dispatch_dtype_and_cache(DType dtype, CacheType cache, Fn&& fn) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    switch (cache) {
      case CacheType::kModel: fn(T{}, T{}); break;
      case CacheType::kInt8: fn(T{}, int8_t{}); break;
      case CacheType::kFp8E4M3: fn(T{}, Fp8{}); break;
    }
  });
}

// 8 int8 codes as float32 (sign-extended and converted: vpmovsxbd + vcvtdq2ps under AVX2).
STAGEWISE_ALWAYS_INLINE void load8(VecF& out, const int8_t* src) {
  typedef int8_t VecB __attribute__((vector_size(8)));
  VecB b;
  __builtin_memcpy(&b, src, sizeof(VecB));
  out = __builtin_convertvector(b, VecF);
}

// 8 e4m3 codes as float32, exactly, in integer vector ops: a normal code's exponent and mantissa
// move into place with the exponent rebiased (127 - 7); a subnormal one (exponent 0) is m * 2^-9.
// Never NaN: a compact cache's codes stop at +-448 (0x7E).
STAGEWISE_ALWAYS_INLINE void load8(VecF& out, const Fp8* src) {
  typedef uint8_t VecUB __attribute__((vector_size(8)));
  VecUB b;
  __builtin_memcpy(&b, src, sizeof(VecUB));
  const VecU w = __builtin_convertvector(b, VecU);
  const VecU magnitude = w & 0x7Fu;
  const VecU normal = (magnitude << 20) + (120u << 23);
  const VecF subnormal = __builtin_convertvector((VecI)(magnitude & 7u), VecF) * 0x1.0p-9f;
  const VecU is_subnormal = (VecU)(magnitude < 8u);
  const VecU bits = ((w & 0x80u) << 24) | ((VecU)subnormal & is_subnormal) | (normal & ~is_subnormal);
  __builtin_memcpy(&out, &bits, sizeof(VecU));
}

STAGEWISE_ALWAYS_INLINE void load8(VecF& out, const float* src) { vload(out, src); }

// src[0..n) as float32. For float input the row itself is returned (no copy);
// otherwise it is converted into `buf` (n floats) and `buf` is returned.
template <typename T>
STAGEWISE_ALWAYS_INLINE const float* row_as_float(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    int64_t i = 0;
    for (; i + kVec <= n; i += kVec) half8_to_float(src + i, buf + i);
    for (; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}

// dst[0..n) = src rounded to T (round to nearest even, as torch's .to(dtype)).
template <typename T>
STAGEWISE_ALWAYS_INLINE void store_row(T* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// out[i] = dot(q, rows[i][0..n)) for i < NR (1 or 8). Eight rows keep eight
// independent FMA chains in flight (enough to hide the FMA latency) and load
// q once per step for all of them.
template <int NR, typename R>
STAGEWISE_ALWAYS_INLINE void dot_rows(const float* q, const R* const* rows, int64_t n,
                                      float* out) {
  static_assert(NR == 1 || NR == 8, "dot_rows: 1 or 8 rows");
  VecF acc[NR];
  for (int i = 0; i < NR; ++i) acc[i] = VecF{};
  int64_t d = 0;
  for (; d + kVec <= n; d += kVec) {
    VecF qv, kv;
    vload(qv, q + d);
    for (int i = 0; i < NR; ++i) {
      load8(kv, rows[i] + d);
      acc[i] += qv * kv;
    }
  }
  if constexpr (NR == 8) {
    hsum8(acc, out);
  } else {
    out[0] = hsum(acc[0]);
  }
  for (; d < n; ++d) {
    for (int i = 0; i < NR; ++i) out[i] += q[d] * static_cast<float>(rows[i][d]);
  }
}

STAGEWISE_ALWAYS_INLINE float dot(const float* a, const float* b, int64_t n) {
  float s;
  dot_rows<1, float>(a, &b, n, &s);
  return s;
}

// acc[d0, d0 + NV * kVec) += sum_{i<n} w[i] * rows[i][same columns], the NV
// vectors held in registers across the n rows.
template <int NV, typename R>
STAGEWISE_ALWAYS_INLINE void accumulate_columns(float* acc, const float* w,
                                                const R* const* rows, int64_t n, int64_t d0) {
  VecF r[NV], x;
  for (int j = 0; j < NV; ++j) vload(r[j], acc + d0 + j * kVec);
  for (int64_t i = 0; i < n; ++i) {
    const float wi = w[i];
    for (int j = 0; j < NV; ++j) {
      load8(x, rows[i] + d0 + j * kVec);
      r[j] += wi * x;
    }
  }
  for (int j = 0; j < NV; ++j) vstore(acc + d0 + j * kVec, r[j]);
}

// acc[0..D) += sum_{i<n} w[i] * rows[i][0..D). Eight vectors of columns at a
// time: eight independent FMA chains hide the FMA latency.
template <typename R>
STAGEWISE_ALWAYS_INLINE void accumulate_rows(float* acc, const float* w, const R* const* rows,
                                             int64_t n, int64_t D) {
  int64_t d = 0;
  for (; d + 8 * kVec <= D; d += 8 * kVec) accumulate_columns<8>(acc, w, rows, n, d);
  for (; d + 2 * kVec <= D; d += 2 * kVec) accumulate_columns<2>(acc, w, rows, n, d);
  for (; d + kVec <= D; d += kVec) accumulate_columns<1>(acc, w, rows, n, d);
  for (; d < D; ++d) {
    float r = acc[d];
    for (int64_t i = 0; i < n; ++i) r += w[i] * static_cast<float>(rows[i][d]);
    acc[d] = r;
  }
}

// s[i] = scale * dot(q, rows[i]) for i < n, eight rows at a time.
template <typename R>
STAGEWISE_ALWAYS_INLINE void score_rows(float* s, const float* q, const R* const* rows,
                                        int64_t n, int64_t D, float scale) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) dot_rows<8, R>(q, rows + i, D, s + i);
  for (; i < n; ++i) dot_rows<1, R>(q, rows + i, D, s + i);
  for (i = 0; i < n; ++i) s[i] *= scale;
}

// Pairwise LSE merge of two partial attention results over disjoint key sets:
//   w_x = exp(lse_x - max(lse_a, lse_b)),
//   out = (w_a * a + w_b * b) / (w_a + w_b),   returns max + log(w_a + w_b),
// the maths of reference.merge_attn_states. A side with lse = -inf attended to
// nothing: the other side is copied bit for bit, whatever the empty side holds
// (its row is never read); both empty gives out = 0 and -inf. A NaN lse on either
// side gives NaN out and lse (torch.maximum's rule; never taken for an empty side).
// `out` may alias `a` or `b` (element-wise).
STAGEWISE_ALWAYS_INLINE float merge_lse_rows(float lse_a, const float* a, float lse_b,
                                             const float* b, float* out, int64_t n) {
  if (std::isnan(lse_a) || std::isnan(lse_b)) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::fill(out, out + n, nan);
    return nan;
  }
  if (lse_b == kNegInf || lse_a == kNegInf) {
    const bool a_empty = lse_a == kNegInf;
    if (a_empty && lse_b == kNegInf) {
      std::fill(out, out + n, 0.f);
      return kNegInf;
    }
    const float* src = a_empty ? b : a;
    if (out != src) std::copy(src, src + n, out);
    return a_empty ? lse_b : lse_a;
  }
  const float m = std::max(lse_a, lse_b);
  const float wa = std::exp(lse_a - m);
  const float wb = std::exp(lse_b - m);
  const float total = wa + wb;
  const float sa = wa / total, sb = wb / total;
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] * sa + b[i] * sb;
  return m + std::log(total);
}

}  // namespace stagewise::cpu
