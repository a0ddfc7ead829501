// quant_linear_int8 on the CPU: the reduced-precision mode of quant_linear, with x quantised to
// int8 per 32-block and integer block dot products (maths in include/stagewise/quant.h).
//
// The weights come packed in panels of 16 rows (cpu/quant_pack.h, made once by quant_pack_int8).
// x is quantised once per call (QuantizedX); the panels then stream through the kernel of the
// ISA level cpu_isa() names (cpu/isa.h): quant_int8_isa.h for AVX2, AVX-512 and AVX-512 VNNI,
// plain integer loops below for any other CPU. The weights are read once per call whatever the
// number of rows, in order.
#include "stagewise/quant.h"

#include <ATen/Parallel.h>

#include "cpu/cpu_utils.h"
#include "cpu/isa.h"
#include "cpu/quant_blocks.h"
#include "cpu/quant_pack.h"
#include "cpu/quant_prefetch.h"

#ifdef STAGEWISE_X86
#include <immintrin.h>
#endif

namespace stagewise::cpu {
namespace {

// x [rows, K] quantised per block of 32: q = round_half_even(x / d), d = max|x| / 127 (0 if the
// block is zero), the sums of q over each half of 16 (the weights' offsets and Q6_K's two scales)
// and d * sum(q) for the min terms.
struct QuantizedX {
  std::vector<int8_t> q;       // [rows, K]
  std::vector<float> d;        // [rows, nblocks]
  std::vector<float> ds;       // [rows, nblocks] d * sum(q) in float32
  std::vector<int32_t> sums;   // [rows, nblocks, 2] sum(q) of values 0-15 and 16-31
  int64_t K = 0, nblocks = 0;
};

// One block: the scale from max|x|, then every value times its inverse rounded to nearest even.
// d and 1 / d are single float32 operations, so every ISA copy (and the reference) gets the same q.
STAGEWISE_ALWAYS_INLINE float block_scale(float amax, float* inv) {
  const float d = amax / 127.f;
  *inv = d != 0.f ? 1.f / d : 0.f;
  return d;
}

// Stores lanes [0, n) of acc (+ bias) as out[0, n) in D.
template <typename D>
STAGEWISE_ALWAYS_INLINE void store_lanes(const float* acc, int64_t n, const float* bias, Storage<D>* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = from_float<D>(acc[j] + (bias ? bias[j] : 0.f));
}

// ---- plain integer loops (any CPU) ------------------------------------------------------

void quantize_x_scalar(const float* x, int64_t x_stride, int64_t rows, QuantizedX& qx) {
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t b = 0; b < qx.nblocks; ++b) {
      const float* xb = x + t * x_stride + b * kQuantBlock;
      float amax = 0.f, inv;
      for (int i = 0; i < kQuantBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = block_scale(amax, &inv);
      int32_t s[2] = {0, 0};
      for (int i = 0; i < kQuantBlock; ++i) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(xb[i] * inv));  // default mode: ties to even
        qx.q[t * qx.K + b * kQuantBlock + i] = static_cast<int8_t>(q);
        s[i / 16] += q;
      }
      const int64_t at = t * qx.nblocks + b;
      qx.d[at] = d;
      qx.sums[2 * at] = s[0];
      qx.sums[2 * at + 1] = s[1];
      qx.ds[at] = d * static_cast<float>(s[0] + s[1]);
    }
  }
}

// Lane l's quants q[32] (offset not taken off; Q8_0 signed) of the sub-block at `sub` (cpu/quant_pack.h).
template <QType Q>
void lane_quants(const uint8_t* sub, int l, int32_t* q) {
  const uint8_t* qs = sub + Pack<Q>::kQuants;
  for (int i = 0; i < 32; ++i) {
    const int j = i / 4, c = i % 4;
    if constexpr (Q == QType::kQ8_0) {
      q[i] = static_cast<int8_t>(qs[64 * j + 4 * l + c]);
    } else {
      const uint8_t byte = qs[64 * (j % 4) + 4 * l + c];
      q[i] = j < 4 ? byte & 15 : byte >> 4;
      if constexpr (Q == QType::kQ6_K) q[i] |= ((qs[256 + 64 * (j / 4) + 4 * l + c] >> (2 * (j % 4))) & 3) << 4;
    }
  }
}

// Panels [begin, end) in plain integer loops over the packed layout.
template <QType Q, typename D>
void panels_scalar(const QuantLinearParams& p, const QuantizedX& qx, const float* bias, int64_t begin, int64_t end) {
  using P = Pack<Q>;
  const int64_t nblocks = p.in_features / Block<Q>::kWeights;
  for (int64_t pi = begin; pi < end; ++pi) {
    const uint8_t* panel = p.qweight + pi * nblocks * P::kRecord;
    for (int l = 0; l < kPanelRows && pi * kPanelRows + l < p.out_features; ++l) {
      const int64_t n = pi * kPanelRows + l;
      for (int64_t t = 0; t < p.rows; ++t) {
        float acc = 0.f;
        for (int64_t b = 0; b < nblocks; ++b) {
          const uint8_t* rec = panel + b * P::kRecord;
          const float d = fp16_bits_at(rec + 2 * l);
          const float m = Block<Q>::kM >= 0 ? fp16_bits_at(rec + 32 + 2 * l) : 0.f;
          for (int sub = 0; sub < P::kSubs; ++sub) {
            const uint8_t* s = rec + P::kHeader + sub * P::kSub;
            const int64_t xb = b * P::kSubs + sub, at = t * qx.nblocks + xb;
            int32_t q[32], isum[2] = {0, 0};
            lane_quants<Q>(s, l, q);
            for (int i = 0; i < 32; ++i) isum[i / 16] += (q[i] - Block<Q>::kOffset) * qx.q[t * qx.K + xb * 32 + i];
            const float dx = qx.d[at];
            if constexpr (Q == QType::kQ6_K) {
              const int32_t whole = static_cast<int8_t>(s[l]) * isum[0] + static_cast<int8_t>(s[16 + l]) * isum[1];
              acc += d * dx * static_cast<float>(whole);
            } else if constexpr (Q == QType::kQ4_K) {
              acc += d * static_cast<float>(s[l]) * dx * static_cast<float>(isum[0] + isum[1]);
              acc += -(m * static_cast<float>(s[16 + l])) * qx.ds[at];
            } else {
              acc += d * dx * static_cast<float>(isum[0] + isum[1]);
              if constexpr (Q == QType::kQ4_1) acc += m * qx.ds[at];
            }
          }
        }
        store_lanes<D>(&acc, 1, bias ? bias + n : nullptr, static_cast<Storage<D>*>(p.out) + t * p.out_row_stride + n);
      }
    }
  }
}

// ---- the vector copies ----------------------------------------------------------------------

#ifdef STAGEWISE_X86
#define STAGEWISE_Q_NS isa_avx2
#define STAGEWISE_Q_LEVEL 1
#define STAGEWISE_Q_TARGET STAGEWISE_TARGET_AVX2
#include "cpu/quant_int8_isa.h"
#undef STAGEWISE_Q_NS
#undef STAGEWISE_Q_LEVEL
#undef STAGEWISE_Q_TARGET

#define STAGEWISE_Q_NS isa_avx512
#define STAGEWISE_Q_LEVEL 2
#define STAGEWISE_Q_TARGET STAGEWISE_TARGET_AVX512
#include "cpu/quant_int8_isa.h"
#undef STAGEWISE_Q_NS
#undef STAGEWISE_Q_LEVEL
#undef STAGEWISE_Q_TARGET

#define STAGEWISE_Q_NS isa_avx512vnni
#define STAGEWISE_Q_LEVEL 3
#define STAGEWISE_Q_TARGET STAGEWISE_TARGET_AVX512VNNI
#include "cpu/quant_int8_isa.h"
#undef STAGEWISE_Q_NS
#undef STAGEWISE_Q_LEVEL
#undef STAGEWISE_Q_TARGET

// quantize_x and panels<Q, D> of one vector copy.
#define STAGEWISE_Q_COPY(ns)                                                                        \
  struct ns##_copy {                                                                                \
    static constexpr auto quantize = ns::quantize_x;                                                \
    template <QType Q, typename D>                                                                  \
    static constexpr auto panels = ns::panels<Q, D>;                                                \
  };
STAGEWISE_Q_COPY(isa_avx2)
STAGEWISE_Q_COPY(isa_avx512)
STAGEWISE_Q_COPY(isa_avx512vnni)
#undef STAGEWISE_Q_COPY

template <typename Copy, QType Q, typename D>
void run_vector(const QuantLinearParams& p, const float* x, int64_t x_stride, const float* bias, QuantizedX& qx) {
  Copy::quantize(x, x_stride, p.rows, qx);
  const int64_t panels = (p.out_features + kPanelRows - 1) / kPanelRows;
  at::parallel_for(0, panels, grain_for(kPanelRows * p.in_features * p.rows), [&](int64_t begin, int64_t end) {
    Copy::template panels<Q, D>(p, qx, bias, begin, end);
  });
}
#endif  // STAGEWISE_X86

template <QType Q, typename D>
void run(const QuantLinearParams& p, const float* x, int64_t x_stride, const float* bias, QuantizedX& qx) {
#ifdef STAGEWISE_X86
  switch (cpu_isa()) {
    case Isa::kAvx512Vnni: return run_vector<isa_avx512vnni_copy, Q, D>(p, x, x_stride, bias, qx);
    case Isa::kAvx512: return run_vector<isa_avx512_copy, Q, D>(p, x, x_stride, bias, qx);
    case Isa::kAvx2: return run_vector<isa_avx2_copy, Q, D>(p, x, x_stride, bias, qx);
    case Isa::kBaseline: break;
  }
#endif
  quantize_x_scalar(x, x_stride, p.rows, qx);
  const int64_t panels = (p.out_features + kPanelRows - 1) / kPanelRows;
  at::parallel_for(0, panels, grain_for(kPanelRows * p.in_features * p.rows), [&](int64_t begin, int64_t end) {
    panels_scalar<Q, D>(p, qx, bias, begin, end);
  });
}

}  // namespace

void quant_linear_int8(const QuantLinearParams& p) {
  if (p.rows == 0 || p.out_features == 0) return;
  const int64_t K = p.in_features;
  QuantizedX qx;
  qx.K = K;
  qx.nblocks = K / kQuantBlock;
  qx.q.resize(p.rows * K);
  qx.d.resize(p.rows * qx.nblocks);
  qx.ds.resize(p.rows * qx.nblocks);
  qx.sums.resize(p.rows * qx.nblocks * 2);
  dispatch_dtype(p.dtype, [&](auto tag) {
    using D = decltype(tag);
    std::vector<float> x_buf, bias_buf;
    const float* x = static_cast<const float*>(p.x);
    int64_t x_stride = p.x_row_stride;
    if constexpr (!std::is_same_v<D, F32>) {  // activations to float32 first
      x_buf.resize(p.rows * K);
      for (int64_t t = 0; t < p.rows; ++t) {
        load_block<D>(static_cast<const Storage<D>*>(p.x) + t * p.x_row_stride, x_buf.data() + t * K, K);
      }
      x = x_buf.data();
      x_stride = K;
    }
    const float* bias = p.bias != nullptr ? as_float<D>(p.bias, p.out_features, bias_buf) : nullptr;
    dispatch_qtype(p.qtype, [&](auto q) { run<decltype(q)::value, D>(p, x, x_stride, bias, qx); });
  });
}

}  // namespace stagewise::cpu
