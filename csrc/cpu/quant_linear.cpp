// quant_linear on the CPU: out = x @ dequant(W).T + bias with W in GGUF blocks
// (include/stagewise/quant.h), every weight its exact float32 value.
//
// The kernels (quant_linear_isa.h) are compiled once per ISA level of cpu/isa.h: baseline,
// AVX2 (8-float vectors) and AVX-512 (16; the VNNI level adds nothing to float maths and runs
// the AVX-512 copy), and the copy cpu_isa() names runs. Few rows of x (decode steps) take the
// direct kernel, which decodes each sub-block into registers and multiplies it at once; more
// rows take the panel kernel, which dequantises a panel of weight rows into scratch once and
// runs a register-blocked micro-kernel over it (the glue sends 32 rows and more to a BLAS GEMM
// over dequantised tiles instead, csrc/bindings/ops_cpu.cpp). The row counts where the direct
// kernel stops paying are measured per level (kDirectMaxRows below).
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

// Up to this many rows of x the direct kernel runs (AVX2, AVX-512); measured with 1 thread on
// SmolLM2's shapes (Zen 4; AVX2 forced through STAGEWISE_CPU_ISA), see docs/ops.md.
constexpr int64_t kDirectMaxRows[] = {0, 4, 8, 8};

using KernelFn = void (*)(const QuantLinearParams&, const Inputs&, int64_t, int64_t);
using DequantizeFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, float*);

struct Kernels {
  KernelFn direct = nullptr;  // tiles of `direct_nr` output features; nullptr at the baseline
  int64_t direct_nr = 0;
  KernelFn panels = nullptr;  // panels of kPanel output features
};

template <QType Q, typename D>
Kernels kernels_for(Isa isa) {
#ifdef STAGEWISE_X86
  if (isa >= Isa::kAvx512) return {isa_avx512::direct<Q, D>, isa_avx512::kDirectNR, isa_avx512::panels<Q, D>};
  if (isa >= Isa::kAvx2) return {isa_avx2::direct<Q, D>, isa_avx2::kDirectNR, isa_avx2::panels<Q, D>};
#endif
  return {nullptr, 0, isa_baseline::panels<Q, D>};
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
  Kernels k;
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
    k = dispatch_qtype(p.qtype, [&](auto q) { return kernels_for<decltype(q)::value, D>(isa); });
  });
  if (k.direct != nullptr && p.rows <= kDirectMaxRows[static_cast<int>(isa)]) {
    const int64_t tiles = (p.out_features + k.direct_nr - 1) / k.direct_nr;
    at::parallel_for(0, tiles, grain_for(k.direct_nr * K * p.rows), [&](int64_t begin, int64_t end) {
      k.direct(p, in, begin, end);
    });
    return;
  }
  const int64_t num_panels = (p.out_features + kPanel - 1) / kPanel;
  at::parallel_for(0, num_panels, grain_for(kPanel * K * p.rows), [&](int64_t begin, int64_t end) {
    k.panels(p, in, begin, end);
  });
}

}  // namespace stagewise::cpu
