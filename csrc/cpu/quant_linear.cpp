// quant_linear on the CPU: out = x @ dequant(W).T + bias with W in GGUF blocks
// (include/stagewise/quant.h), every weight its exact float32 value.
//
// The kernels (quant_linear_isa.h) are compiled once per ISA level of cpu/isa.h: baseline,
// AVX2 (8-float vectors) and AVX-512 (16; the VNNI level adds nothing to float maths and runs
// the AVX-512 copy), and the copy cpu_isa() names runs. For a decode step's few rows (AVX2 and
// AVX-512) the direct kernel decodes each sub-block into registers and multiplies it at once; from
// kTileMinRows rows on (a batch, a prompt; every row count on the baseline) the tile kernel
// dequantises kTileNF weight rows at a time into an L1/L2 panel, once per block of kRowBlock rows,
// and runs those rows of x, packed transposed, against it with broadcast FMAs: no BLAS, no float32
// copy of W (at 2 threads it runs at 180-210 GFLOP/s on Zen 4, where the dequantised tiles
// through at::mm ran at 130-155).
//
// FMAs may fuse the products and sums: the dequantisation is exact either way (quant_blocks.h),
// and the sums are float32 in the kernel's order.
#include "stagewise/quant.h"

#include <ATen/Parallel.h>

#include <memory>

#include "cpu/cpu_utils.h"
#include "cpu/isa.h"
#include "cpu/quant_blocks.h"
#include "cpu/quant_prefetch.h"

#ifdef STAGEWISE_X86
#include <immintrin.h>
#endif

namespace stagewise::cpu {
namespace {

constexpr int64_t kTileKC = 256;  // k a chunk of a tile's panel: [kTileNF][kTileKC] floats

struct Inputs {
  const float* x;    // [rows, K] float32, row stride x_stride
  int64_t x_stride;
  const float* bias;  // [out_features] float32 or nullptr
  // The tile kernel's rows of x, [row_begin, row_end), packed by pack_group a group at a time.
  const float* xt = nullptr;
  int64_t row_begin = 0, row_end = 0;
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

// From this many rows of x the tile kernel beats the direct one, per ISA level (baseline, AVX2,
// AVX-512, AVX-512 VNNI; the baseline has only the tile kernel). Measured with 1 thread on
// SmolLM2's 30 layers of Q4_1 linears streamed from memory (Zen 4, AVX2 forced through
// STAGEWISE_CPU_ISA; ms for all of them, 2026-11-27):
//   AVX-512  direct  8 rows 25.4, 16 rows 47.4, 24 rows 71.5, 32 rows 92.2
//            tiles           45.6,         46.8,         75.4,         78.3  (128 rows 294)
//   AVX2     direct  8 rows 37.0, 10 rows 45.8, 12 rows 55.8, 16 rows 73.2
//            tiles           36.9,         44.5,         45.0,         44.8  (128 rows 279)
// A group of AVX-512 tiles holds 32 rows, so 24 rows leave a quarter of its lanes empty.
constexpr int64_t kTileMinRows[] = {1, 10, 28, 28};

// Rows of x the tile kernel packs and runs at a time: their packing (kRowBlock * K floats) stays
// in L2 or L3 while every tile of weights runs over it.
constexpr int64_t kRowBlock = 256;

using KernelFn = void (*)(const QuantLinearParams&, const Inputs&, int64_t, int64_t);
using PackFn = void (*)(const float*, int64_t, int64_t, int64_t, float*);

// The kernel of an ISA level for a number of rows: its function, the output features a work item
// of it covers, and for the tile kernel its packing of x and the rows of a group (0: direct).
struct Kernel {
  KernelFn fn = nullptr;
  int64_t features = 0;
  PackFn pack = nullptr;
  int64_t group_rows = 0;
};

template <QType Q, typename D>
Kernel kernel_for(Isa isa, int64_t rows) {
  const bool tiles = rows >= kTileMinRows[static_cast<int>(isa)];
#ifdef STAGEWISE_X86
  if (isa >= Isa::kAvx512) {
    return tiles ? Kernel{isa_avx512::tiles<Q, D>, isa_avx512::kTileNF, isa_avx512::pack_group,
                          isa_avx512::kGroupRows}
                 : Kernel{isa_avx512::direct<Q, D>, isa_avx512::kDirectNR};
  }
  if (isa >= Isa::kAvx2) {
    return tiles ? Kernel{isa_avx2::tiles<Q, D>, isa_avx2::kTileNF, isa_avx2::pack_group, isa_avx2::kGroupRows}
                 : Kernel{isa_avx2::direct<Q, D>, isa_avx2::kDirectNR};
  }
#endif
  (void)tiles;
  return {isa_baseline::tiles<Q, D>, isa_baseline::kTileNF, isa_baseline::pack_group, isa_baseline::kGroupRows};
}

}  // namespace

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
    k = dispatch_qtype(p.qtype, [&](auto q) { return kernel_for<decltype(q)::value, D>(isa, p.rows); });
  });
  const int64_t items = (p.out_features + k.features - 1) / k.features;
  if (k.group_rows == 0) {
    at::parallel_for(0, items, grain_for(k.features * K * p.rows), [&](int64_t begin, int64_t end) {
      k.fn(p, in, begin, end);
    });
    return;
  }
  const int64_t g = k.group_rows;
  const std::unique_ptr<float[]> xt(new float[(std::min(kRowBlock, p.rows) + g - 1) / g * g * K]);
  in.xt = xt.get();
  for (in.row_begin = 0; in.row_begin < p.rows; in.row_begin += kRowBlock) {
    in.row_end = std::min(p.rows, in.row_begin + kRowBlock);
    at::parallel_for(0, (in.row_end - in.row_begin + g - 1) / g, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = in.row_begin + i * g;
        k.pack(in.x + r * in.x_stride, in.x_stride, std::min(g, in.row_end - r), K, xt.get() + i * g * K);
      }
    });
    at::parallel_for(0, items, grain_for(k.features * K * (in.row_end - in.row_begin)),
                     [&](int64_t begin, int64_t end) { k.fn(p, in, begin, end); });
  }
}

}  // namespace stagewise::cpu
