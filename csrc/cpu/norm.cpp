// RMSNorm and residual-add + RMSNorm on the CPU: one parallel_for over rows.
// A row is read twice while it is in cache (sum of squares, then scale):
// float32 and bfloat16 convert inline in each pass, float16 a block of kBlock
// elements at a time through float32 scratch.
#include "stagewise/norm.h"

#include <ATen/Parallel.h>

#include "cpu/cpu_utils.h"

namespace stagewise::cpu {
namespace {

// out[0, n) = D(float(D(x * inv_rms)) * w), a block at a time; out may be x.
// kUnit: Gemma's D(x * inv_rms * w), w holding 1 + w.
template <typename D, bool kUnit>
STAGEWISE_ALWAYS_INLINE void normalise_row(const Storage<D>* x, Storage<D>* out, const float* w,
                                           float inv_rms, int64_t n) {
  if constexpr (kConvertInline<D>) return rms_norm_store<D, !kUnit>(x, out, inv_rms, w, n);
  float buf[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = std::min(kBlock, n - b);
    float* y = out_block<D>(out + b, buf);
    rms_norm_block<D, !kUnit>(load_block<D>(x + b, buf, m), y, inv_rms, w + b, m);
    store_block<D>(y, out + b, m);
  }
}

// res[i] = D(res[i] + x[i]); acc[j] += float(res[i])^2.
template <typename D>
STAGEWISE_ALWAYS_INLINE void add_residual(const Storage<D>* __restrict x, Storage<D>* __restrict res,
                                          int64_t i, float& acc) {
  const Storage<D> s = from_float<D>(to_float<D>(res[i]) + to_float<D>(x[i]));
  res[i] = s;
  const float v = to_float<D>(s);
  acc += v * v;
}

// res[0, n) = D(res + x) and acc[i % kLanes] += float(res[i])^2 in one pass
// (kConvertInline types): the statistics are those of the rounded sums.
template <typename D>
STAGEWISE_ALWAYS_INLINE void add_residual_row(const Storage<D>* __restrict x,
                                              Storage<D>* __restrict res, int64_t n,
                                              float (&acc)[kLanes]) {
  float a[kLanes];  // a local copy the compiler keeps in vector registers
  for (int j = 0; j < kLanes; ++j) a[j] = acc[j];
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) add_residual<D>(x, res, i + j, a[j]);
  }
  for (int j = 0; i < n; ++i, ++j) add_residual<D>(x, res, i, a[j]);
  for (int j = 0; j < kLanes; ++j) acc[j] = a[j];
}

// Rows [begin, end) of out = rms_norm(x); w is float32 [hidden] (1 + w with kUnit).
template <typename D, bool kUnit>
struct RmsNormRows {
  static STAGEWISE_ALWAYS_INLINE void run(const RmsNormParams& p, const float* w, int64_t begin,
                                          int64_t end) {
    using S = Storage<D>;
    const int64_t n = p.hidden;
    float buf[kBlock];
    for (int64_t r = begin; r < end; ++r) {
      const S* x = static_cast<const S*>(p.x) + r * p.x_row_stride;
      float acc[kLanes] = {};
      if constexpr (kConvertInline<D>) {
        add_squares_of<D>(x, n, acc);
      } else {
        for (int64_t b = 0; b < n; b += kBlock) {
          const int64_t m = std::min(kBlock, n - b);
          add_squares(load_block<D>(x + b, buf, m), m, acc);
        }
      }
      normalise_row<D, kUnit>(x, static_cast<S*>(p.out) + r * p.out_row_stride, w,
                       inv_rms(sum_lanes(acc), n, p.eps), n);
    }
  }
};

// Rows [begin, end) of residual = D(residual + x), then x = rms_norm(residual).
template <typename D, bool kUnit>
struct FusedAddRmsNormRows {
  static STAGEWISE_ALWAYS_INLINE void run(const FusedAddRmsNormParams& p, const float* w,
                                          int64_t begin, int64_t end) {
    using S = Storage<D>;
    const int64_t n = p.hidden;
    float res_buf[kBlock], x_buf[kBlock];
    for (int64_t r = begin; r < end; ++r) {
      S* x = static_cast<S*>(p.x) + r * p.x_row_stride;
      S* res = static_cast<S*>(p.residual) + r * p.residual_row_stride;
      // The statistics are those of the rounded sums, the new residual.
      float acc[kLanes] = {};
      if constexpr (kConvertInline<D>) {
        add_residual_row<D>(x, res, n, acc);
      } else {
        for (int64_t b = 0; b < n; b += kBlock) {
          const int64_t m = std::min(kBlock, n - b);
          const float* r_old = load_block<D>(res + b, res_buf, m);
          const float* add = load_block<D>(x + b, x_buf, m);
          float* sum = out_block<D>(res + b, res_buf);
          for (int64_t i = 0; i < m; ++i) sum[i] = r_old[i] + add[i];
          round_block<D>(sum, m);
          add_squares(sum, m, acc);
          store_block<D>(sum, res + b, m);
        }
      }
      normalise_row<D, kUnit>(res, x, w, inv_rms(sum_lanes(acc), n, p.eps), n);
    }
  }
};

}  // namespace

namespace {

// Rows of p through Rows<D, unit_offset>::run (D = the storage dtype), the
// weight converted to float32 (1 + w with unit_offset) once.
template <template <typename, bool> class Rows, typename Params>
void run_rows(const Params& p) {
  if (p.rows == 0) return;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using D = decltype(tag);
    std::vector<float> w_buf;
    const float* w = norm_weights<D>(p.weight, p.hidden, p.unit_offset, w_buf);
    at::parallel_for(0, p.rows, grain_for(p.hidden), [&](int64_t begin, int64_t end) {
      if (p.unit_offset) {
        call_best_isa<Rows<D, true>>(p, w, begin, end);
      } else {
        call_best_isa<Rows<D, false>>(p, w, begin, end);
      }
    });
  });
}

}  // namespace

void rms_norm(const RmsNormParams& p) { run_rows<RmsNormRows>(p); }

void fused_add_rms_norm(const FusedAddRmsNormParams& p) { run_rows<FusedAddRmsNormRows>(p); }

}  // namespace stagewise::cpu
