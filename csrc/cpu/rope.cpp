// Rotary embedding, and per-head RMSNorm fused with it, on the CPU: one
// parallel_for over tokens; each head is loaded once into float32 scratch,
// (normalised,) rotated and stored.
#include "stagewise/rope.h"

#include <ATen/Parallel.h>

#include "cpu/cpu_utils.h"

namespace stagewise::cpu {
namespace {

// out = rotation of in by (cos, sin) for rotation pairs i in [0, half):
// NeoX pairs (i, i + half), GPT-J pairs (2i, 2i + 1).
STAGEWISE_ALWAYS_INLINE void rotate(const float* __restrict in, float* __restrict out,
                                    const float* __restrict cos, const float* __restrict sin,
                                    int64_t half, bool is_neox) {
  if (is_neox) {
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = in[i], x2 = in[i + half];
      out[i] = x1 * cos[i] - x2 * sin[i];
      out[i + half] = x2 * cos[i] + x1 * sin[i];
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = in[2 * i], x2 = in[2 * i + 1];
      out[2 * i] = x1 * cos[i] - x2 * sin[i];
      out[2 * i + 1] = x2 * cos[i] + x1 * sin[i];
    }
  }
}

// x[0, 2 * half) = D(rotation of in by (cos, sin)): rotate with the rounding
// to D done inline (kConvertInline types).
template <typename D>
STAGEWISE_ALWAYS_INLINE void rotate_store(const float* __restrict in, Storage<D>* __restrict x,
                                          const float* __restrict cos, const float* __restrict sin,
                                          int64_t half, bool is_neox) {
  if (is_neox) {
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = in[i], x2 = in[i + half];
      x[i] = from_float<D>(x1 * cos[i] - x2 * sin[i]);
      x[i + half] = from_float<D>(x2 * cos[i] + x1 * sin[i]);
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = in[2 * i], x2 = in[2 * i + 1];
      x[2 * i] = from_float<D>(x1 * cos[i] - x2 * sin[i]);
      x[2 * i + 1] = from_float<D>(x2 * cos[i] + x1 * sin[i]);
    }
  }
}

// What a head is normalised with before rope: nothing (rope), the RMSNorm of
// norm.h (Qwen3) or Gemma's unit-offset RMSNorm (the weights hold 1 + w).
enum class Norm { kNone, kPlain, kUnitOffset };

// rope_head for kConvertInline types: the same maths, each step converting
// inline, so a head takes one pass to load (and normalise) and one to rotate.
template <typename D, Norm kNorm>
STAGEWISE_ALWAYS_INLINE void rope_head_inline(Storage<D>* x, const float* __restrict w,
                                              const float* cos, const float* sin,
                                              const RopeParams& p, float* __restrict in_buf) {
  const int64_t rot = p.rotary_dim;
  if constexpr (kNorm != Norm::kNone) {
    constexpr bool kRound = kNorm == Norm::kPlain;
    const int64_t n = p.head_dim;
    float acc[kLanes] = {};
    add_squares_of<D>(x, n, acc);
    const float inv = inv_rms(sum_lanes(acc), n, p.eps);
    // The normed values as stored: rope's input below rot, the output above.
    for (int64_t i = 0; i < rot; ++i) {
      const float normed = to_float<D>(x[i]) * inv;
      in_buf[i] = round_to<D>((kRound ? round_to<D>(normed) : normed) * w[i]);
    }
    rms_norm_store<D, kRound>(x + rot, x + rot, inv, w + rot, n - rot);
  } else {
    for (int64_t i = 0; i < rot; ++i) in_buf[i] = to_float<D>(x[i]);
  }
  rotate_store<D>(in_buf, x, cos, sin, rot / 2, p.is_neox);
}

// One head x [head_dim] in place: with a norm, x = D(D(x * inv_rms) * w) (or
// Gemma's D(x * inv_rms * w), w = 1 + w) first; then features [0, rotary_dim)
// are rotated in float32 and rounded once.
template <typename D, Norm kNorm>
STAGEWISE_ALWAYS_INLINE void rope_head(Storage<D>* x, const float* w, const float* cos,
                                       const float* sin, const RopeParams& p, float* in_buf,
                                       float* out_buf) {
  if constexpr (kConvertInline<D>) return rope_head_inline<D, kNorm>(x, w, cos, sin, p, in_buf);
  const int64_t rot = p.rotary_dim;
  if constexpr (kNorm != Norm::kNone) {
    const int64_t n = p.head_dim;
    const float* raw = load_block<D>(x, in_buf, n);
    float acc[kLanes] = {};
    add_squares(raw, n, acc);
    rms_norm_block<D, kNorm == Norm::kPlain>(raw, in_buf, inv_rms(sum_lanes(acc), n, p.eps), w, n);
    round_block<D>(in_buf, n);  // the normed values as stored: rope's input
    store_block<D>(in_buf + rot, x + rot, n - rot);
  } else if constexpr (std::is_same_v<D, F32>) {
    std::memcpy(in_buf, x, rot * sizeof(float));  // the rotation below writes over x
  } else {
    load_block<D>(x, in_buf, rot);
  }
  float* out = out_block<D>(x, out_buf);
  rotate(in_buf, out, cos, sin, rot / 2, p.is_neox);
  store_block<D>(out, x, rot);
}

// Tokens [begin, end) of q and k; D is the dtype of q/k, C that of cos_sin_cache;
// q_w, k_w are the float32 norm weights (with a norm only).
template <typename D, typename C, Norm kNorm>
struct RopeTokens {
  static STAGEWISE_ALWAYS_INLINE void run(const RopeParams& p, const float* q_w, const float* k_w,
                                          int64_t begin, int64_t end) {
    using S = Storage<D>;
    const int64_t rot = p.rotary_dim;
    // Float32 scratch: a head's input [head_dim], its rotated part [rot], a cos/sin row [rot].
    std::vector<float> scratch(p.head_dim + 2 * rot);
    float* in_buf = scratch.data();
    float* out_buf = in_buf + p.head_dim;
    float* cos_sin_buf = out_buf + rot;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t pos = load_index(p.positions, p.position_type, t);
      const float* cos = load_block<C>(static_cast<const Storage<C>*>(p.cos_sin_cache) + pos * rot,
                                       cos_sin_buf, rot);
      const float* sin = cos + rot / 2;
      S* q = static_cast<S*>(p.q) + t * p.q_token_stride;
      for (int64_t h = 0; h < p.num_q_heads; ++h) {
        rope_head<D, kNorm>(q + h * p.q_head_stride, q_w, cos, sin, p, in_buf, out_buf);
      }
      S* k = static_cast<S*>(p.k) + t * p.k_token_stride;
      for (int64_t h = 0; h < p.num_k_heads; ++h) {
        rope_head<D, kNorm>(k + h * p.k_head_stride, k_w, cos, sin, p, in_buf, out_buf);
      }
    }
  }
};

template <Norm kNorm>
void run(const char* op, const RopeParams& p) {
  // Every position is checked before any token is written.
  check_indices_in_range(op, "positions", p.positions, p.position_type, p.num_tokens, 0,
                         p.max_position, " (rows of cos_sin_cache)");
  if (p.num_tokens == 0) return;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using D = decltype(tag);
    constexpr bool kWeights = kNorm != Norm::kNone;
    constexpr bool kUnit = kNorm == Norm::kUnitOffset;
    std::vector<float> q_w_buf, k_w_buf;
    const float* q_w = kWeights ? norm_weights<D>(p.q_weight, p.head_dim, kUnit, q_w_buf) : nullptr;
    const float* k_w = kWeights ? norm_weights<D>(p.k_weight, p.head_dim, kUnit, k_w_buf) : nullptr;
    const int64_t grain = grain_for((p.num_q_heads + p.num_k_heads) * p.head_dim);
    auto tokens = [&](auto cache_tag) {
      using C = decltype(cache_tag);
      at::parallel_for(0, p.num_tokens, grain, [&](int64_t begin, int64_t end) {
        call_best_isa<RopeTokens<D, C, kNorm>>(p, q_w, k_w, begin, end);
      });
    };
    // The cache is float32 or the dtype of q/k (checked by the glue).
    if (p.cache_dtype == DType::kFloat32) {
      tokens(F32{});
    } else {
      tokens(D{});
    }
  });
}

}  // namespace

void rope(const RopeParams& p) { run<Norm::kNone>("rope", p); }

void qk_norm_rope(const RopeParams& p) {
  if (p.unit_offset) return run<Norm::kUnitOffset>("qk_norm_rope", p);
  run<Norm::kPlain>("qk_norm_rope", p);
}

}  // namespace stagewise::cpu
