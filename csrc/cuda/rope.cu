// Rotary embedding and per-head RMSNorm + rotary (Qwen3, Gemma) on the GPU; maths in
// include/stagewise/rope.h.
//
// One warp per (token, head) item, q heads first then k heads; a grid-stride
// loop over items. Lane l owns rotation pairs l, l + 32, ... (NeoX: x[i] and
// x[i + rot/2]; GPT-J: x[2i] and x[2i + 1]), so a warp touches contiguous
// elements and every element is read and written by one lane. With the norm,
// a first pass sums x^2 over the whole head (warp reduction; all lanes' loads
// have returned before any lane gets the sum, so the second pass may write in
// place). A token whose position is outside [0, max_position) is left untouched.
#include "stagewise/rope.h"

#include <algorithm>

#include "common.cuh"

namespace stagewise::cuda {
namespace {

using detail::from_float;
using detail::round_to;
using detail::to_float;

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int64_t kMaxGrid = int64_t{1} << 16;

// What a head is normalised with before rope: nothing (rope), norm.h's RMSNorm
// (Qwen3) or Gemma's unit-offset one, y = T(x * inv_rms * (1 + w)).
enum class Norm { kNone, kPlain, kUnitOffset };

// The normalised value of norm.h, widened back to float for the rotation.
template <typename T, Norm kNorm>
__device__ __forceinline__ float prepare(T x, const T* weight, int j, float inv_rms) {
  if constexpr (kNorm == Norm::kPlain) {
    return round_to<T>(round_to<T>(to_float(x) * inv_rms) * to_float(weight[j]));
  } else if constexpr (kNorm == Norm::kUnitOffset) {
    return round_to<T>(__fmul_rn(__fmul_rn(to_float(x), inv_rms), __fadd_rn(1.f, to_float(weight[j]))));
  }
  return to_float(x);
}

// T: q/k dtype; C: cos_sin_cache dtype (float or T).
template <typename T, typename C, Norm kNorm>
__global__ void rope_kernel(RopeParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t heads = p.num_q_heads + p.num_k_heads;
  const int64_t num_items = p.num_tokens * heads;
  const int64_t warps_total = int64_t{gridDim.x} * kWarpsPerBlock;
  const int head_dim = static_cast<int>(p.head_dim);
  const int half = static_cast<int>(p.rotary_dim / 2);
  for (int64_t item = int64_t{blockIdx.x} * kWarpsPerBlock + (threadIdx.x >> 5); item < num_items;
       item += warps_total) {
    const int64_t token = item / heads;
    const int64_t head = item % heads;
    const int64_t pos = load_index(p.positions, p.position_type, token);
    if (pos < 0 || pos >= p.max_position) continue;  // warp-uniform: nothing written
    const bool is_q = head < p.num_q_heads;
    T* x = is_q ? static_cast<T*>(p.q) + token * p.q_token_stride + head * p.q_head_stride
                : static_cast<T*>(p.k) + token * p.k_token_stride +
                      (head - p.num_q_heads) * p.k_head_stride;
    const T* weight = static_cast<const T*>(is_q ? p.q_weight : p.k_weight);

    float inv_rms = 1.f;
    if constexpr (kNorm != Norm::kNone) {
      float sum_sq = 0.f;
      for (int j = lane; j < head_dim; j += 32) {
        const float v = to_float(x[j]);
        sum_sq += v * v;
      }
      inv_rms = rsqrtf(detail::warp_sum(sum_sq) / static_cast<float>(head_dim) + p.eps);
    }

    const C* cos = static_cast<const C*>(p.cos_sin_cache) + pos * p.rotary_dim;
    const C* sin = cos + half;
    for (int i = lane; i < half; i += 32) {
      const int i1 = p.is_neox ? i : 2 * i;
      const int i2 = p.is_neox ? i + half : 2 * i + 1;
      const float x1 = prepare<T, kNorm>(x[i1], weight, i1, inv_rms);
      const float x2 = prepare<T, kNorm>(x[i2], weight, i2, inv_rms);
      const float c = to_float(cos[i]);
      const float s = to_float(sin[i]);
      // Explicit roundings (no fused multiply-add), as the float32 reference computes it.
      x[i1] = from_float<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
      x[i2] = from_float<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
    }
    if constexpr (kNorm != Norm::kNone) {
      // Features past rotary_dim are normalised but not rotated.
      for (int j = 2 * half + lane; j < head_dim; j += 32) {
        x[j] = from_float<T>(prepare<T, kNorm>(x[j], weight, j, inv_rms));
      }
    }
  }
}

template <Norm kNorm>
cudaError_t launch(const RopeParams& p, cudaStream_t stream) {
  const int64_t num_items = p.num_tokens * (p.num_q_heads + p.num_k_heads);
  if (num_items <= 0 || p.head_dim <= 0) return cudaSuccess;
  if (p.head_dim > (int64_t{1} << 30) || p.rotary_dim > p.head_dim || p.rotary_dim % 2 != 0 ||
      (kNorm != Norm::kNone && (p.q_weight == nullptr || p.k_weight == nullptr))) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(std::min(detail::ceil_div(num_items, kWarpsPerBlock), kMaxGrid)));
  return detail::dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (p.cache_dtype == DType::kFloat32) {
      rope_kernel<T, float, kNorm><<<grid, kThreads, 0, stream>>>(p);
    } else if (p.cache_dtype == p.dtype) {
      rope_kernel<T, T, kNorm><<<grid, kThreads, 0, stream>>>(p);
    } else {
      return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t rope(const RopeParams& p, cudaStream_t stream) { return launch<Norm::kNone>(p, stream); }

cudaError_t qk_norm_rope(const RopeParams& p, cudaStream_t stream) {
  return p.unit_offset ? launch<Norm::kUnitOffset>(p, stream) : launch<Norm::kPlain>(p, stream);
}

}  // namespace stagewise::cuda
