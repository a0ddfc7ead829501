// Helpers shared by the CPU kernels: storage dtypes and their float32
// conversion, dtype dispatch, the ISA copies of element-wise kernels, the
// RMSNorm rounding and index checks.
//
// How the kernels vectorise: the extension is compiled with plain -O3 (the
// baseline ISA), so kernels convert a block of elements to float32 scratch,
// do their maths there in plain loops the compiler vectorises, and convert
// back. Element-wise kernels are called through call_best_isa, which compiles
// them once per ISA level (cpu/isa.h: baseline, AVX2, AVX-512) and runs the
// copy cpu_isa() names; every helper they use is always-inline so that it is
// compiled into each copy. The copies do the same float32 operations in the
// same order (contraction into FMA is off), so they give the same bits.
// float16 <-> float32 block conversion uses the F16C instructions from the
// AVX2 level on, else exact branch-free bit arithmetic.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <c10/util/Exception.h>

#include "cpu/isa.h"
#include "stagewise/common.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define STAGEWISE_X86_F16C 1
// The element-wise copies (see call_best_isa): AVX2 8 floats wide, AVX-512 16 wide (GCC's
// generic tuning would otherwise vectorise 8 wide even there). Both ISAs carry FMA, which
// the compiler would use to fuse a multiply and an add; contraction is off so every copy
// gives the same bits.
#define STAGEWISE_CPU_AVX2 __attribute__((target("avx2,fma,f16c"), optimize("fp-contract=off")))
#define STAGEWISE_CPU_AVX512 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,prefer-vector-width=512"), \
                 optimize("fp-contract=off")))
#endif

#define STAGEWISE_ALWAYS_INLINE inline __attribute__((always_inline))

namespace stagewise::cpu {

// --- ISA copies -------------------------------------------------------------------

namespace detail {
template <typename Kernel, typename... Args>
void call_baseline(const Args&... args) {
  Kernel::run(args...);
}
#ifdef STAGEWISE_CPU_AVX512
template <typename Kernel, typename... Args>
STAGEWISE_CPU_AVX2 void call_avx2(const Args&... args) {
  Kernel::run(args...);
}
template <typename Kernel, typename... Args>
STAGEWISE_CPU_AVX512 void call_avx512(const Args&... args) {
  Kernel::run(args...);
}
#endif
}  // namespace detail

// Kernel::run(args...) (a static always-inline function) compiled for the ISA level
// cpu_isa() names (cpu/isa.h).
template <typename Kernel, typename... Args>
void call_best_isa(const Args&... args) {
#ifdef STAGEWISE_CPU_AVX512
  const Isa isa = cpu_isa();
  if (isa >= Isa::kAvx512) return detail::call_avx512<Kernel>(args...);
  if (isa >= Isa::kAvx2) return detail::call_avx2<Kernel>(args...);
#endif
  detail::call_baseline<Kernel>(args...);
}

// --- scalar float32 <-> storage conversion ------------------------------------

STAGEWISE_ALWAYS_INLINE uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

STAGEWISE_ALWAYS_INLINE float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// c ? a : b without a branch. A plain ?: whose arms need float maths is
// compiled as a branch (the maths may trap), which stops vectorisation.
STAGEWISE_ALWAYS_INLINE uint32_t select_bits(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return (a & mask) | (b & ~mask);
}

// Storage types, as dispatch tags. Half types are handled as raw bits
// (uint16_t), not as c10::Half/c10::BFloat16 objects: the compiler treats a
// copy of those classes as an aggregate copy and does not vectorise it.
struct F32 {
  using Storage = float;
};
struct F16 {
  using Storage = uint16_t;
};
struct BF16 {
  using Storage = uint16_t;
};
template <typename D>
using Storage = typename D::Storage;

template <typename D>
STAGEWISE_ALWAYS_INLINE float to_float(Storage<D> x);
template <typename D>
STAGEWISE_ALWAYS_INLINE Storage<D> from_float(float x);

template <>
STAGEWISE_ALWAYS_INLINE float to_float<F32>(float x) { return x; }
template <>
STAGEWISE_ALWAYS_INLINE float from_float<F32>(float x) { return x; }

template <>
STAGEWISE_ALWAYS_INLINE float to_float<BF16>(uint16_t x) { return bits_float(uint32_t{x} << 16); }

// Round to nearest even; NaN becomes the quiet NaN 0x7FC0 (as c10::BFloat16).
template <>
STAGEWISE_ALWAYS_INLINE uint16_t from_float<BF16>(float x) {
  const uint32_t u = float_bits(x);
  const uint32_t rounded = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
  return static_cast<uint16_t>(select_bits(x != x, 0x7FC0u, rounded));
}

// Exact; the algorithm of c10's non-F16C fallback with selects for branches.
template <>
STAGEWISE_ALWAYS_INLINE float to_float<F16>(uint16_t x) {
  const uint32_t w = uint32_t{x} << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  // Normal numbers, inf and NaN: move exponent and mantissa into place, then fix the bias.
  const float normal = bits_float((two_w >> 4) + (0xE0u << 23)) * bits_float(15u << 23);
  // Subnormals and zero: mantissa * 2^-24, built as a float with exponent 126 minus 0.5.
  const float subnormal = bits_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t mag = select_bits(two_w < (1u << 27), float_bits(subnormal), float_bits(normal));
  return bits_float(sign | mag);
}

// Round to nearest even, overflow to inf; c10's fallback with selects for branches.
template <>
STAGEWISE_ALWAYS_INLINE uint16_t from_float<F16>(float x) {
  const uint32_t w = float_bits(x);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t exp_bits = shl1_w & 0xFF000000u;
  const uint32_t bias = exp_bits < 0x71000000u ? 0x71000000u : exp_bits;
  // Scaling up then down lets the float adder do the rounding of the mantissa.
  float base = (std::fabs(x) * bits_float(239u << 23)) * bits_float(17u << 23);
  base = bits_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return static_cast<uint16_t>((sign >> 16) | select_bits(shl1_w > 0xFF000000u, 0x7E00u, nonsign));
}

// The value x takes when stored as D, as float.
template <typename D>
STAGEWISE_ALWAYS_INLINE float round_to(float x) {
  return to_float<D>(from_float<D>(x));
}

// --- float16 blocks through F16C ------------------------------------------------

#ifdef STAGEWISE_X86_F16C
// Whether the kernels may use F16C (the AVX2 level and above, cpu/isa.h).
inline bool cpu_has_f16c() { return cpu_isa() >= Isa::kAvx2; }

__attribute__((target("avx,f16c"))) inline void f16_to_float_f16c(const uint16_t* src, float* dst,
                                                                  int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = to_float<F16>(src[i]);
}

__attribute__((target("avx,f16c"))) inline void float_to_f16_f16c(const float* src, uint16_t* dst,
                                                                  int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = from_float<F16>(src[i]);
}

__attribute__((target("avx,f16c"))) inline void round_f16_f16c(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_ps(x + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) x[i] = round_to<F16>(x[i]);
}
#endif

// --- float32 blocks ----------------------------------------------------------------

// Floats of scratch a kernel converts at a time: 1 KiB, stays in L1.
inline constexpr int64_t kBlock = 256;

// The float32 values of src[0, n): src itself for F32, else converted into buf.
template <typename D>
STAGEWISE_ALWAYS_INLINE const float* load_block(const Storage<D>* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<D, F32>) {
    return src;
  } else {
#ifdef STAGEWISE_X86_F16C
    if constexpr (std::is_same_v<D, F16>) {
      if (cpu_has_f16c()) {
        f16_to_float_f16c(src, buf, n);
        return buf;
      }
    }
#endif
    for (int64_t i = 0; i < n; ++i) buf[i] = to_float<D>(src[i]);
    return buf;
  }
}

// Where to compute float32 values bound for dst: dst itself for F32, else buf
// (then store_block converts them into dst).
template <typename D>
STAGEWISE_ALWAYS_INLINE float* out_block(Storage<D>* dst, float* buf) {
  if constexpr (std::is_same_v<D, F32>) {
    return dst;
  } else {
    return buf;
  }
}

// dst[0, n) = D(src[0, n)), rounded to nearest even; nothing to do when src is dst.
template <typename D>
STAGEWISE_ALWAYS_INLINE void store_block(const float* src, Storage<D>* dst, int64_t n) {
  if constexpr (std::is_same_v<D, F32>) {
    if (src != dst) std::memcpy(dst, src, n * sizeof(float));
  } else {
#ifdef STAGEWISE_X86_F16C
    if constexpr (std::is_same_v<D, F16>) {
      if (cpu_has_f16c()) return float_to_f16_f16c(src, dst, n);
    }
#endif
    for (int64_t i = 0; i < n; ++i) dst[i] = from_float<D>(src[i]);
  }
}

// x[0, n) = float(D(x[0, n))): the values x takes when stored as D.
template <typename D>
STAGEWISE_ALWAYS_INLINE void round_block(float* x, int64_t n) {
  if constexpr (!std::is_same_v<D, F32>) {
#ifdef STAGEWISE_X86_F16C
    if constexpr (std::is_same_v<D, F16>) {
      if (cpu_has_f16c()) return round_f16_f16c(x, n);
    }
#endif
    for (int64_t i = 0; i < n; ++i) x[i] = round_to<D>(x[i]);
  }
}

// Whether kernels convert D element by element inside their maths loops
// rather than a block at a time through float32 scratch. True for float32 and
// bfloat16, whose conversions are a few integer vector ops (a bf16 load is a
// 16-bit shift), so one pass over the data beats a pass per step; false for
// float16, whose block conversion can use F16C.
template <typename D>
inline constexpr bool kConvertInline = !std::is_same_v<D, F16>;

// Calls f(D{}) with D the tag of d (F32, F16 or BF16).
template <typename F>
void dispatch_dtype(DType d, F&& f) {
  switch (d) {
    case DType::kFloat32: return f(F32{});
    case DType::kFloat16: return f(F16{});
    case DType::kBFloat16: return f(BF16{});
  }
  TORCH_CHECK(false, "stagewise: unknown DType ", static_cast<int>(d));
}

// The float32 values of src[0, n) of dtype D: src itself for F32, else converted into buf.
template <typename D>
const float* as_float(const void* src, int64_t n, std::vector<float>& buf) {
  buf.resize(std::is_same_v<D, F32> ? 0 : n);
  return load_block<D>(static_cast<const Storage<D>*>(src), buf.data(), n);
}

// --- RMSNorm pieces --------------------------------------------------------------

// Partial sums of a reduction: enough independent lanes for a vector unit,
// added in a fixed order, so the compiler vectorises without reassociating
// and every ISA copy gets the same result.
inline constexpr int kLanes = 16;

// acc[i % kLanes] += x[i]^2 for i in [0, n).
STAGEWISE_ALWAYS_INLINE void add_squares(const float* x, int64_t n, float (&acc)[kLanes]) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += x[i + j] * x[i + j];
  }
  for (int j = 0; i < n; ++i, ++j) acc[j] += x[i] * x[i];
}

// acc[i % kLanes] += float(x[i])^2 for i in [0, n): add_squares with the
// conversion from D done inline (same float32 operations, same order).
template <typename D>
STAGEWISE_ALWAYS_INLINE void add_squares_of(const Storage<D>* __restrict x, int64_t n,
                                            float (&acc)[kLanes]) {
  float a[kLanes];  // a local copy the compiler keeps in vector registers
  for (int j = 0; j < kLanes; ++j) a[j] = acc[j];
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float v = to_float<D>(x[i + j]);
      a[j] += v * v;
    }
  }
  for (int j = 0; i < n; ++i, ++j) {
    const float v = to_float<D>(x[i]);
    a[j] += v * v;
  }
  for (int j = 0; j < kLanes; ++j) acc[j] = a[j];
}

STAGEWISE_ALWAYS_INLINE float sum_lanes(const float (&acc)[kLanes]) {
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

// 1 / sqrt(mean(x^2) + eps) from the float32 sum of squares of n values.
STAGEWISE_ALWAYS_INLINE float inv_rms(float sum_sq, int64_t n, float eps) {
  return 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
}

// y[i] = float(D(x[i] * inv_rms)) * w[i] for i in [0, n): the rounding of
// norm.h up to the final rounding to D, which the caller does. y may be x.
// kRoundNormed false (Gemma's unit-offset form, w already 1 + w): y[i] =
// x[i] * inv_rms * w[i], nothing rounded before the caller's final rounding.
template <typename D, bool kRoundNormed = true>
STAGEWISE_ALWAYS_INLINE void rms_norm_block(const float* x, float* y, float inv_rms, const float* w,
                                            int64_t n) {
  if constexpr (!kRoundNormed) {
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv_rms * w[i];
    return;
  }
#ifdef STAGEWISE_X86_F16C
  if constexpr (std::is_same_v<D, F16>) {
    if (cpu_has_f16c()) {  // the round trip as a pass of hardware conversions
      for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv_rms;
      round_block<D>(y, n);
      for (int64_t i = 0; i < n; ++i) y[i] *= w[i];
      return;
    }
  }
#endif
  for (int64_t i = 0; i < n; ++i) y[i] = round_to<D>(x[i] * inv_rms) * w[i];
}

// out[i] = D(float(D(x[i] * inv_rms)) * w[i]) for i in [0, n), converting
// inline (kConvertInline types): the whole rounding of norm.h in one pass;
// kRoundNormed false: D(x[i] * inv_rms * w[i]) (Gemma's form, w = 1 + w).
template <typename D, bool kRoundNormed = true>
STAGEWISE_ALWAYS_INLINE void rms_norm_store(const Storage<D>* x, Storage<D>* out, float inv_rms,
                                            const float* __restrict w, int64_t n) {
  static_assert(kConvertInline<D>);
  for (int64_t i = 0; i < n; ++i) {
    const float normed = to_float<D>(x[i]) * inv_rms;
    out[i] = from_float<D>((kRoundNormed ? round_to<D>(normed) : normed) * w[i]);
  }
}

// The float32 weights a norm multiplies by: w as float32, or 1 + w (added in
// float32, as Gemma's RMSNorm does) with unit_offset. Returns buf's data, or w
// itself for float32 weights without the offset.
template <typename D>
const float* norm_weights(const void* w, int64_t n, bool unit_offset, std::vector<float>& buf) {
  const float* f = as_float<D>(w, n, buf);
  if (!unit_offset) return f;
  if (buf.empty()) buf.assign(f, f + n);
  for (int64_t i = 0; i < n; ++i) buf[i] = 1.f + buf[i];
  return buf.data();
}

// --- parallel grain ------------------------------------------------------------

// Items per parallel_for chunk so that each chunk touches at least ~32K
// elements: below that, waking a second thread costs more than it saves.
inline int64_t grain_for(int64_t elements_per_item) {
  constexpr int64_t kMinElementsPerChunk = 32 * 1024;
  return std::max<int64_t>(1, kMinElementsPerChunk / std::max<int64_t>(elements_per_item, 1));
}

// --- index checks ----------------------------------------------------------------

// Raises c10::IndexError "stagewise.<op>: <arg>[i] = v is out of range [lo, hi)<detail>"
// for the first element of idx[0, n) outside [lo, hi).
inline void check_indices_in_range(const char* op, const char* arg, const void* idx, IndexType type,
                                   int64_t n, int64_t lo, int64_t hi, const char* detail = "") {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = load_index(idx, type, i);
    TORCH_CHECK_INDEX(v >= lo && v < hi, "stagewise.", op, ": ", arg, "[", i, "] = ", v,
                      " is out of range [", lo, ", ", hi, ")", detail);
  }
}

}  // namespace stagewise::cpu
