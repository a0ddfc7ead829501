// quant_linear on the CPU: out = x @ dequant(W).T + bias with W in GGUF blocks
// (include/stagewise/quant.h).
//
// Work is split over panels of kPanel weight rows (at::parallel_for). A panel
// is dequantised once into float32 scratch (kPanel x in_features, L1/L2
// resident) with the exact values of gguf.quants.dequantize, then every row of
// x is run against it by a register-blocked micro-kernel: MR rows of x times
// NR rows of the panel, each pair a W-lane float32 partial-sum vector over the
// whole row, reduced at the end. At batch 1 the panel decode dominates; at
// batch 16 the FMAs do, and the weights are read and decoded once per call.
//
// Vectors are GCC vector extensions, so one templated body serves every ISA
// copy: AVX-512 (W = 16, 4 x 4 tile), AVX2 + FMA (W = 8, 2 x 4) and the
// baseline (W = 4), picked once at run time. Products may fuse into FMAs:
// d * q is exact in float32, so the fused dequantisation d * q + m equals the
// reference's rounded product plus m; the sums are float32 in the kernel's order.
#include "stagewise/quant.h"

#include <ATen/Parallel.h>

#include "cpu/cpu_utils.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define STAGEWISE_QL_X86 1
#include <immintrin.h>
#endif

namespace stagewise::cpu {
namespace {

constexpr int64_t kPanel = 16;  // weight rows dequantised together (a multiple of every NR)

template <int W>
struct Vec {
  typedef float f32 __attribute__((vector_size(4 * W)));
};

template <int W>
STAGEWISE_ALWAYS_INLINE typename Vec<W>::f32 load_f32(const float* p) {
  typename Vec<W>::f32 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int W>
STAGEWISE_ALWAYS_INLINE void store_f32(float* p, typename Vec<W>::f32 v) {
  std::memcpy(p, &v, sizeof(v));
}

struct Inputs {
  const float* x;    // [rows, K] float32, row stride x_stride
  int64_t x_stride;
  const float* bias;  // [out_features] float32 or nullptr
};

// The ISA copies of the kernel (quant_linear_isa.h), one namespace each.
#ifdef STAGEWISE_QL_X86
#define STAGEWISE_QL_NS isa_avx512
#define STAGEWISE_QL_ISA 512
#define STAGEWISE_QL_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,prefer-vector-width=512")))
#include "cpu/quant_linear_isa.h"
#undef STAGEWISE_QL_NS
#undef STAGEWISE_QL_ISA
#undef STAGEWISE_QL_TARGET

#define STAGEWISE_QL_NS isa_avx2
#define STAGEWISE_QL_ISA 256
#define STAGEWISE_QL_TARGET __attribute__((target("avx2,fma,f16c")))
#include "cpu/quant_linear_isa.h"
#undef STAGEWISE_QL_NS
#undef STAGEWISE_QL_ISA
#undef STAGEWISE_QL_TARGET
#endif

#define STAGEWISE_QL_NS isa_baseline
#define STAGEWISE_QL_ISA 0
#define STAGEWISE_QL_TARGET
#include "cpu/quant_linear_isa.h"
#undef STAGEWISE_QL_NS
#undef STAGEWISE_QL_ISA
#undef STAGEWISE_QL_TARGET

using PanelsFn = void (*)(const QuantLinearParams&, const Inputs&, int64_t, int64_t);
using DequantizeFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, float*);

template <QType Q>
DequantizeFn best_dequantize() {
#ifdef STAGEWISE_QL_X86
  static const bool has_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  static const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                               __builtin_cpu_supports("f16c");
  if (has_avx512) return isa_avx512::dequantize_rows<Q>;
  if (has_avx2) return isa_avx2::dequantize_rows<Q>;
#endif
  return isa_baseline::dequantize_rows<Q>;
}

template <QType Q, typename D>
PanelsFn best_panels() {
#ifdef STAGEWISE_QL_X86
  static const bool has_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  static const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                               __builtin_cpu_supports("f16c");
  if (has_avx512) return isa_avx512::panels<Q, D>;
  if (has_avx2) return isa_avx2::panels<Q, D>;
#endif
  return isa_baseline::panels<Q, D>;
}

template <typename D>
PanelsFn best_panels(QType q) {
  switch (q) {
    case QType::kQ4_0: return best_panels<QType::kQ4_0, D>();
    case QType::kQ4_1: return best_panels<QType::kQ4_1, D>();
    case QType::kQ8_0: return best_panels<QType::kQ8_0, D>();
  }
  TORCH_CHECK(false, "stagewise.quant_linear: unknown qtype ", static_cast<int>(q));
  return nullptr;
}

}  // namespace

void quant_dequantize(const uint8_t* qweight, QType qtype, int64_t rows, int64_t in_features, float* out) {
  DequantizeFn fn = nullptr;
  switch (qtype) {
    case QType::kQ4_0: fn = best_dequantize<QType::kQ4_0>(); break;
    case QType::kQ4_1: fn = best_dequantize<QType::kQ4_1>(); break;
    case QType::kQ8_0: fn = best_dequantize<QType::kQ8_0>(); break;
  }
  TORCH_CHECK(fn != nullptr, "stagewise.quant_dequantize: unknown qtype ", static_cast<int>(qtype));
  at::parallel_for(0, rows, grain_for(in_features), [&](int64_t begin, int64_t end) {
    fn(qweight, in_features, begin, end, out);
  });
}

void quant_linear(const QuantLinearParams& p) {
  if (p.rows == 0 || p.out_features == 0) return;
  const int64_t K = p.in_features;
  std::vector<float> x_buf, bias_buf;
  Inputs in{static_cast<const float*>(p.x), p.x_row_stride, nullptr};
  PanelsFn panels = nullptr;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using D = decltype(tag);
    if constexpr (!std::is_same_v<D, F32>) {  // activations to float32 once, shared by every panel
      x_buf.resize(p.rows * K);
      for (int64_t t = 0; t < p.rows; ++t) {
        load_block<D>(static_cast<const Storage<D>*>(p.x) + t * p.x_row_stride, x_buf.data() + t * K, K);
      }
      in.x = x_buf.data();
      in.x_stride = K;
    }
    if (p.bias != nullptr) in.bias = as_float<D>(p.bias, p.out_features, bias_buf);
    panels = best_panels<D>(p.qtype);
  });
  const int64_t num_panels = (p.out_features + kPanel - 1) / kPanel;
  at::parallel_for(0, num_panels, grain_for(kPanel * K * p.rows), [&](int64_t begin, int64_t end) {
    panels(p, in, begin, end);
  });
}

}  // namespace stagewise::cpu
