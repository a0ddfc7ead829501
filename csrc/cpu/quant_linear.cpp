// quant_linear on the CPU: out = x @ dequant(W).T + bias with W in GGUF blocks
// (include/stagewise/quant.h), every weight its exact float32 value.
//
// The kernels (quant_linear_isa.h) are compiled once per ISA level of cpu/isa.h: baseline,
// AVX2 (8-float vectors) and AVX-512 (16; the VNNI level adds nothing to float maths and runs
// the AVX-512 copy), and the copy cpu_isa() names runs. On AVX2 and AVX-512 the direct kernel
// decodes each sub-block into registers and multiplies it at once; the baseline copy dequantises
// a panel of weight rows into scratch and runs a register-blocked micro-kernel over it. From
// quant_linear_dense_min_rows() rows on (a prompt) the glue multiplies dequantised tiles of W
// with a BLAS GEMM instead (csrc/bindings/ops_cpu.cpp).
//
// FMAs may fuse the products and sums: the dequantisation is exact either way (quant_blocks.h),
// and the sums are float32 in the kernel's order.
#include "stagewise/quant.h"

#include <ATen/Parallel.h>

#include "cpu/cpu_utils.h"
#include "cpu/isa.h"
#include "cpu/quant_blocks.h"
#include "cpu/quant_prefetch.h"

#ifdef STAGEWISE_X86
#include <immintrin.h>
#endif

namespace stagewise::cpu {
namespace {

constexpr int64_t kPanel = 16;  // weight rows dequantised together (a multiple of every NR)

struct Inputs {
  const float* x;    // [rows, K] float32, row stride x_stride
  int64_t x_stride;
  const float* bias;  // [out_features] float32 or nullptr
};

// The ISA copies of the kernels, one namespace each.
#define STAGEWISE_Q_NS isa_baseline
#define STAGEWISE_Q_LEVEL 0
#define STAGEWISE_Q_TARGET
#include "cpu/quant_linear_isa.h"
#undef STAGEWISE_Q_NS
#undef STAGEWISE_Q_LEVEL
#undef STAGEWISE_Q_TARGET

#ifdef STAGEWISE_X86
#define STAGEWISE_Q_NS isa_avx2
#define STAGEWISE_Q_LEVEL 1
#define STAGEWISE_Q_TARGET STAGEWISE_TARGET_AVX2
#include "cpu/quant_linear_isa.h"
#undef STAGEWISE_Q_NS
#undef STAGEWISE_Q_LEVEL
#undef STAGEWISE_Q_TARGET

#define STAGEWISE_Q_NS isa_avx512
#define STAGEWISE_Q_LEVEL 2
#define STAGEWISE_Q_TARGET STAGEWISE_TARGET_AVX512
#include "cpu/quant_linear_isa.h"
#undef STAGEWISE_Q_NS
#undef STAGEWISE_Q_LEVEL
#undef STAGEWISE_Q_TARGET
#endif

// From this many rows of x the dequantised-tile GEMM beats the kernels here, per ISA level
// (baseline, AVX2, AVX-512, AVX-512 VNNI). Measured with 1 thread on SmolLM2's 30 layers of Q4_1
// linears streamed from memory (Zen 4, AVX2 forced through STAGEWISE_CPU_ISA; ms for all of them):
//   AVX-512 direct  8 rows 25.0, 24 rows 69-71, 28 rows 81.9, 32 rows 91-93 (panels: 34.5, 75.7, -, 97.8)
//   AVX2 direct     8 rows 37.6, 10 rows 46.4, 12 rows 54.8, 16 rows 71.9 (panels: 36.0, -, 58.1, 58.9)
//   GEMM            8 rows 38-39, 10 rows 46.2, 12 rows 46.9, 16 rows 55.3, 28 rows 80.5, 32 rows 88-89
// The panel kernel never won where the direct one exists; the baseline keeps the earlier 32.
constexpr int64_t kDenseMinRows[] = {32, 12, 28, 28};

using KernelFn = void (*)(const QuantLinearParams&, const Inputs&, int64_t, int64_t);
using DequantizeFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, float*);

// The kernel of an ISA level and the output features a work item of it covers.
struct Kernel {
  KernelFn fn = nullptr;
  int64_t features = 0;
};

template <QType Q, typename D>
Kernel kernel_for(Isa isa) {
#ifdef STAGEWISE_X86
  if (isa >= Isa::kAvx512) return {isa_avx512::direct<Q, D>, isa_avx512::kDirectNR};
  if (isa >= Isa::kAvx2) return {isa_avx2::direct<Q, D>, isa_avx2::kDirectNR};
#endif
  return {isa_baseline::panels<Q, D>, kPanel};
}

template <QType Q>
DequantizeFn dequantize_for(Isa isa) {
#ifdef STAGEWISE_X86
  if (isa >= Isa::kAvx512) return isa_avx512::dequantize_rows<Q>;
  if (isa >= Isa::kAvx2) return isa_avx2::dequantize_rows<Q>;
#endif
  return isa_baseline::dequantize_rows<Q>;
}

}  // namespace

int64_t quant_linear_dense_min_rows() { return kDenseMinRows[static_cast<int>(cpu_isa())]; }

void quant_dequantize(const uint8_t* qweight, QType qtype, int64_t rows, int64_t in_features, float* out) {
  const Isa isa = cpu_isa();
  const DequantizeFn fn = dispatch_qtype(qtype, [&](auto tag) { return dequantize_for<decltype(tag)::value>(isa); });
  at::parallel_for(0, rows, grain_for(in_features), [&](int64_t begin, int64_t end) {
    fn(qweight, in_features, begin, end, out);
  });
}

void quant_linear(const QuantLinearParams& p) {
  if (p.rows == 0 || p.out_features == 0) return;
  const int64_t K = p.in_features;
  const Isa isa = cpu_isa();
  std::vector<float> x_buf, bias_buf;
  Inputs in{static_cast<const float*>(p.x), p.x_row_stride, nullptr};
  Kernel k;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using D = decltype(tag);
    if constexpr (!std::is_same_v<D, F32>) {  // activations to float32 once, shared by every tile
      x_buf.resize(p.rows * K);
      for (int64_t t = 0; t < p.rows; ++t) {
        load_block<D>(static_cast<const Storage<D>*>(p.x) + t * p.x_row_stride, x_buf.data() + t * K, K);
      }
      in.x = x_buf.data();
      in.x_stride = K;
    }
    if (p.bias != nullptr) in.bias = as_float<D>(p.bias, p.out_features, bias_buf);
    k = dispatch_qtype(p.qtype, [&](auto q) { return kernel_for<decltype(q)::value, D>(isa); });
  });
  const int64_t items = (p.out_features + k.features - 1) / k.features;
  at::parallel_for(0, items, grain_for(k.features * K * p.rows), [&](int64_t begin, int64_t end) {
    k.fn(p, in, begin, end);
  });
}

}  // namespace stagewise::cpu
