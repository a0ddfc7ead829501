// Paged KV cache writes and slot mapping on the GPU; layouts in
// include/stagewise/cache.h. Out-of-range indices are skipped, never raised:
// raising would need a host sync.
#include "stagewise/cache.h"

#include <algorithm>
#include <type_traits>

#include "common.cuh"

namespace stagewise::cuda {
namespace {

constexpr int kCopyThreads = 128;
constexpr int kSlotThreads = 256;
constexpr int64_t kMaxGrid = int64_t{1} << 16;

// Caches of the activations' dtype: one CTA per token (grid-stride) copies the
// token's [num_heads, head_dim] K and V rows into its slot, kN elements per
// access: a 16-byte vector when every pointer and stride allows it, else one
// element at a time.
template <typename T, int kN>
__global__ void reshape_and_cache_kernel(ReshapeAndCacheParams p) {
  static_assert(kN == 1 || kN * sizeof(T) == 16, "one element or one 16-byte vector");
  const int per_head = static_cast<int>(p.head_dim / kN);  // accesses per head row
  const int per_token = static_cast<int>(p.num_heads) * per_head;  // < 2^31, checked at launch
  const int64_t cache_token_stride = p.num_heads * p.head_dim;
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const int64_t slot = load_index(p.slot_mapping, p.slot_type, t);
    if (slot < 0 || slot >= p.num_slots) continue;  // padding (-1) or out of range: skip
    for (int i = threadIdx.x; i < per_token; i += blockDim.x) {
      const int64_t h = i / per_head;
      const int64_t d = int64_t{i % per_head} * kN;
      const int64_t dst = slot * cache_token_stride + h * p.head_dim + d;
      const T* k = static_cast<const T*>(p.k) + t * p.k_token_stride + h * p.k_head_stride + d;
      const T* v = static_cast<const T*>(p.v) + t * p.v_token_stride + h * p.v_head_stride + d;
      if constexpr (kN > 1) {
        uint32_t kw[4], vw[4];
        detail::load_words(k, kw);
        detail::load_words(v, vw);
        detail::store_words(static_cast<T*>(p.k_cache) + dst, kw);
        detail::store_words(static_cast<T*>(p.v_cache) + dst, vw);
      } else {
        static_cast<T*>(p.k_cache)[dst] = *k;
        static_cast<T*>(p.v_cache)[dst] = *v;
      }
    }
  }
}

// The one-byte code of x in a row of the given scale (common.h's formula): a
// true division (not x * (1 / scale)) and rintf, bit for bit as the CPU kernel.
// C is int8_t or __nv_fp8_e4m3; a zero scale (an all-zero or tiny row) or a NaN
// one (a row with a NaN) gives code 0.
template <typename C>
__device__ __forceinline__ uint8_t encode(float x, float scale) {
  if (!(scale > 0.f)) return 0;
  const float y = __fdiv_rn(x, scale);
  if constexpr (std::is_same_v<C, int8_t>) {
    return static_cast<uint8_t>(static_cast<int8_t>(fminf(fmaxf(rintf(y), -127.f), 127.f)));
  } else {
    return __nv_cvt_float_to_fp8(fminf(fmaxf(y, -448.f), 448.f), __NV_SATFINITE, __NV_E4M3);
  }
}

// max(a, b) that a NaN wins (fmaxf would drop it), so that a row with a NaN
// gets a NaN scale (and codes 0), as on the CPU and in the reference.
__device__ __forceinline__ float nan_max(float a, float b) { return a > b || isnan(a) ? a : b; }

// A row's float16 scale from its amax: amax / 127 (int8) or / 448 (e4m3),
// rounded to half, capped at half's largest finite value rather than inf (a
// NaN stays NaN: not fminf).
template <typename C>
__device__ __forceinline__ __half row_scale(float amax) {
  constexpr float kMaxCode = std::is_same_v<C, int8_t> ? 127.f : 448.f;
  const float scale = __fdiv_rn(amax, kMaxCode);
  return __float2half_rn(scale > 65504.f ? 65504.f : scale);
}

// The amax of a head row from each lane's share; all 32 lanes take part.
__device__ __forceinline__ float warp_amax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Compact caches (C = int8_t or __nv_fp8_e4m3): one CTA per token
// (grid-stride), one warp per head row at a time, K and V side by side. A
// first pass over the row takes its amax (a warp reduction), which gives the
// scale; a second pass (the row is in L1 by then) writes the codes. Lanes
// take every 32nd element: a warp reads and writes contiguous runs.
template <typename T, typename C>
__global__ void reshape_and_cache_compact_kernel(ReshapeAndCacheParams p) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const int64_t slot = load_index(p.slot_mapping, p.slot_type, t);
    if (slot < 0 || slot >= p.num_slots) continue;  // padding (-1) or out of range: skip
    for (int64_t h = warp; h < p.num_heads; h += num_warps) {  // warp-uniform
      const T* k = static_cast<const T*>(p.k) + t * p.k_token_stride + h * p.k_head_stride;
      const T* v = static_cast<const T*>(p.v) + t * p.v_token_stride + h * p.v_head_stride;
      float k_amax = 0.f, v_amax = 0.f;
      for (int64_t d = lane; d < p.head_dim; d += 32) {
        k_amax = nan_max(k_amax, fabsf(detail::to_float(k[d])));
        v_amax = nan_max(v_amax, fabsf(detail::to_float(v[d])));
      }
      const __half k_scale = row_scale<C>(warp_amax(k_amax));
      const __half v_scale = row_scale<C>(warp_amax(v_amax));
      const float k_div = __half2float(k_scale);
      const float v_div = __half2float(v_scale);
      const int64_t row = slot * p.num_heads + h;  // index of the row's scales
      uint8_t* k_codes = static_cast<uint8_t*>(p.k_cache) + row * p.head_dim;
      uint8_t* v_codes = static_cast<uint8_t*>(p.v_cache) + row * p.head_dim;
      for (int64_t d = lane; d < p.head_dim; d += 32) {
        k_codes[d] = encode<C>(detail::to_float(k[d]), k_div);
        v_codes[d] = encode<C>(detail::to_float(v[d]), v_div);
      }
      if (lane == 0) {
        static_cast<__half*>(p.k_scale)[row] = k_scale;
        static_cast<__half*>(p.v_scale)[row] = v_scale;
      }
    }
  }
}

// One thread per token: the interleaved context-parallel slot of cache.h, or
// -1 for a padding position, another rank's token, or a sequence / block
// index outside the block table.
__global__ void slot_mapping_kernel(SlotMappingParams p) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t t = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; t < p.num_tokens; t += stride) {
    int64_t slot = kPaddingSlot;
    const int64_t pos = load_index(p.positions, p.position_type, t);
    const int64_t seq = load_index(p.seq_index, p.seq_index_type, t);
    if (pos >= 0 && seq >= 0 && seq < p.num_seqs) {
      const int64_t cp = p.cp_world_size;
      const int64_t virtual_block_size = p.block_size * cp;
      const int64_t vblock = pos / virtual_block_size;
      const int64_t offset = pos % virtual_block_size;
      const int64_t local_block = offset / p.interleave_size;
      const int64_t owner = local_block % cp;
      const int64_t local_offset = (local_block / cp) * p.interleave_size + offset % p.interleave_size;
      if (owner == p.cp_rank && vblock < p.max_blocks) {
        const int64_t block =
            load_index(p.block_tables, p.block_table_type, seq * p.block_table_row_stride + vblock);
        if (block >= 0) slot = block * p.block_size + local_offset;
      }
    }
    p.out[t] = slot;
  }
}

}  // namespace

cudaError_t reshape_and_cache(const ReshapeAndCacheParams& p, cudaStream_t stream) {
  if (p.num_tokens <= 0 || p.num_heads <= 0 || p.head_dim <= 0) return cudaSuccess;
  if (p.num_heads * p.head_dim > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(std::min(p.num_tokens, kMaxGrid)));
  return detail::dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    return detail::dispatch_cache<T>(p.cache_type, [&](auto code_tag) {
      using C = decltype(code_tag);
      if constexpr (std::is_same_v<C, T>) {
        constexpr int kBytes = sizeof(T);
        const bool vec_ok =
            p.head_dim % (16 / kBytes) == 0 && detail::aligned16(p.k) && detail::aligned16(p.v) &&
            detail::aligned16(p.k_cache) && detail::aligned16(p.v_cache) &&
            detail::stride_aligned16(p.k_token_stride, kBytes) &&
            detail::stride_aligned16(p.k_head_stride, kBytes) &&
            detail::stride_aligned16(p.v_token_stride, kBytes) &&
            detail::stride_aligned16(p.v_head_stride, kBytes);
        if (vec_ok) {
          reshape_and_cache_kernel<T, 16 / kBytes><<<grid, kCopyThreads, 0, stream>>>(p);
        } else {
          reshape_and_cache_kernel<T, 1><<<grid, kCopyThreads, 0, stream>>>(p);
        }
      } else {
        if (p.k_scale == nullptr || p.v_scale == nullptr) return cudaErrorInvalidValue;
        reshape_and_cache_compact_kernel<T, C><<<grid, kCopyThreads, 0, stream>>>(p);
      }
      return cudaGetLastError();
    });
  });
}

cudaError_t slot_mapping(const SlotMappingParams& p, cudaStream_t stream) {
  if (p.num_tokens <= 0) return cudaSuccess;
  if (p.block_size < 1 || p.cp_world_size < 1 || p.interleave_size < 1) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(std::min(detail::ceil_div(p.num_tokens, kSlotThreads), kMaxGrid)));
  slot_mapping_kernel<<<grid, kSlotThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace stagewise::cuda
