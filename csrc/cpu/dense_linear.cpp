// dense_linear on the CPU: out = x @ W.T + bias in float32 for the few rows of a decode step
// (include/stagewise/linear.h).
//
// At a few rows the maths is free and the step is the time it takes to read W from memory once.
// A row of W read front to back is one stream that the hardware prefetchers follow only to the
// end of its 4 KB page (a plain read of the same bytes in 2 MB pages ran ~35% faster), and a core
// keeps too few such streams going to fill the memory's bandwidth: BLAS's GEMV, which walks a few
// adjacent rows at a time, reads ~19 GB/s where a plain read of the same bytes reaches ~26-30
// (2-vCPU AMD EPYC, Zen 4, 4 KB pages). The kernel (dense_linear_isa.h) therefore reads each
// thread's rows as 8 streams far apart (8 parts of its range, a row of each at a time) and
// requests each stream 2 KB ahead into L2. Measured in C++ on that machine, 2 threads, W from
// DRAM, in GB/s (one run; the machine is shared and runs vary by ~10%): [6144, 2048] 4 adjacent
// rows 18.9, the same + prefetch 20.3, 8 streams 22.9, 8 streams + prefetch 25.7, a plain read in
// 8 streams 25.8; 12 or 16 streams, or prefetching into L1 or non-temporally, were no better or
// worse.
//
// Copies per ISA level of cpu/isa.h: baseline (4-float vectors), AVX2 (8) and AVX-512 (16; the
// VNNI level adds nothing to float maths and runs the AVX-512 copy); the copy cpu_isa() names
// runs. Each output is one dot product summed in the kernel's order by one thread, so a result
// depends on the ISA level but not on the thread count.
#include "stagewise/linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "cpu/cpu_utils.h"
#include "cpu/isa.h"

namespace stagewise::cpu {
namespace {

constexpr int64_t kAhead = 512;  // floats (2 KB) requested ahead in each stream; 1-4 KB measure alike

// The params' operands as float32.
struct Operands {
  float* out;  // [rows, out_features], row stride out_row_stride
  int64_t out_row_stride;
  const float* x;  // [rows, in_features], row stride x_row_stride
  int64_t x_row_stride;
  const float* weight;  // [out_features, in_features]
  const float* bias;    // [out_features] or nullptr
  int64_t rows, in_features;
};

#define STAGEWISE_D_NS isa_baseline
#define STAGEWISE_D_LEVEL 0
#define STAGEWISE_D_TARGET
#include "cpu/dense_linear_isa.h"
#undef STAGEWISE_D_NS
#undef STAGEWISE_D_LEVEL
#undef STAGEWISE_D_TARGET

#ifdef STAGEWISE_X86
#define STAGEWISE_D_NS isa_avx2
#define STAGEWISE_D_LEVEL 1
#define STAGEWISE_D_TARGET STAGEWISE_TARGET_AVX2
#include "cpu/dense_linear_isa.h"
#undef STAGEWISE_D_NS
#undef STAGEWISE_D_LEVEL
#undef STAGEWISE_D_TARGET

#define STAGEWISE_D_NS isa_avx512
#define STAGEWISE_D_LEVEL 2
#define STAGEWISE_D_TARGET STAGEWISE_TARGET_AVX512
#include "cpu/dense_linear_isa.h"
#undef STAGEWISE_D_NS
#undef STAGEWISE_D_LEVEL
#undef STAGEWISE_D_TARGET
#endif

// The most rows of x the kernel takes, per ISA level (baseline, AVX2, AVX-512, AVX-512 VNNI): up to
// there it beat at::linear (torch 2.13's BLAS) on both shapes measured, W [6144, 2048] and
// [2048, 6144] from DRAM, 1 thread (2 threads favour the kernel more), in ms, kernel / at::linear:
//   AVX-512   16 rows 6.95 / 11.45, 6.23 / 8.39;  32 rows 12.80 / 15.88, 11.29 / 12.37;
//             48 rows 18.50 / 24.10, 16.51 / 16.82
//   AVX2      10 rows 6.88 / 9.39, 6.84 / 7.40;   12 rows 8.43 / 10.70, 7.94 / 7.55
//   baseline   6 rows 5.32 / 7.71, 5.17 / 5.97;    8 rows 6.67 / 7.92, 6.52 / 6.37
// Past a few rows the kernel is bound by its multiply-adds, not by memory: more rows of x pass
// over a tile from L2 kMR rows at a time.
constexpr int64_t kMaxRows[] = {6, 10, 32, 32};

using RangeFn = void (*)(const Operands&, int64_t, int64_t);

RangeFn range_for(Isa isa) {
#ifdef STAGEWISE_X86
  if (isa >= Isa::kAvx512) return isa_avx512::feature_range;
  if (isa >= Isa::kAvx2) return isa_avx2::feature_range;
#endif
  return isa_baseline::feature_range;
}

}  // namespace

int64_t dense_linear_max_rows() { return kMaxRows[static_cast<int>(cpu_isa())]; }

void dense_linear(const DenseLinearParams& p) {
  TORCH_CHECK(p.dtype == DType::kFloat32 && p.rows <= dense_linear_max_rows(), "stagewise.dense_linear: the kernel ",
              "takes float32 and up to ", dense_linear_max_rows(), " rows, got ", p.rows, " rows of dtype ",
              static_cast<int>(p.dtype));
  if (p.rows == 0 || p.out_features == 0) return;
  const Operands o{static_cast<float*>(p.out), p.out_row_stride, static_cast<const float*>(p.x), p.x_row_stride,
                   static_cast<const float*>(p.weight), static_cast<const float*>(p.bias), p.rows, p.in_features};
  const RangeFn fn = range_for(cpu_isa());
  // One contiguous range of output features per thread, each at least 32K weights.
  at::parallel_for(0, p.out_features, grain_for(p.in_features), [&](int64_t begin, int64_t end) {
    fn(o, begin, end);
  });
}

}  // namespace stagewise::cpu
