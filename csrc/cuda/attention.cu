// Flash-decoding over the paged KV cache and the LSE merge of partial
// attention results, on the GPU; maths in include/stagewise/attention.h.
//
// decode_attention runs two kernels:
//  1. decode_split_kernel, grid (batch x num_splits, num_kv_heads x head
//     chunks): one CTA computes, for one split (a contiguous token range) of
//     one sequence, the attention of up to kMaxGroup query heads that share a
//     KV head, so each K/V row is read once for the whole group. K/V tiles of
//     kTile tokens stream through shared memory with cp.async (kStages deep).
//     Per tile: scores (lane = token, the 4 warps each take a quarter of
//     head_dim, partial dots summed through shared memory), online softmax in
//     the log2 domain (one warp per head), then P.V (lane = head_dim slice, the
//     4 warps each take a quarter of the tokens). Writes the normalised
//     partial output and its LSE of each (split, head) to the workspace.
//     A compact cache (one-byte codes, attention.h) streams its codes the same
//     way, converted to float where they are read; the tokens' float16 scales
//     go to shared memory as floats beside them: a key's scale multiplies its
//     score, a value's its softmax weight in P.V (not the running sum).
//  2. decode_combine_kernel, one warp per (sequence, query head): merges the
//     splits and the new token (logit scale * q.k_new, value v_new) by LSE.
// merge_attn_states_kernel merges two partial results elementwise; it and the
// combine kernel share lse_merge(), the pairwise rule of attention.h.
#include "stagewise/attention.h"

#include <algorithm>
#include <cmath>

#include "common.cuh"

namespace stagewise::cuda {
namespace {

using detail::ceil_div;
using detail::from_float;
using detail::to_float;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int64_t kMaxGrid = int64_t{1} << 16;

// ---- pairwise LSE merge ---------------------------------------------------------
// out = wa * a + wb * b; lse = log(exp(lse_a) + exp(lse_b)). A side with
// lse -inf gets weight 0 and the other weight exactly 1, so the other side
// comes back exactly; both -inf: both weights 0 and lse -inf (out 0).
struct LseMerge {
  float wa;
  float wb;
  float lse;
};

__device__ __forceinline__ LseMerge lse_merge(float lse_a, float lse_b) {
  // A NaN comes out as NaN (torch.maximum's rule): fmaxf would drop it, and the row would pass for
  // an empty one.
  if (isnan(lse_a) || isnan(lse_b)) {
    const float nan = __int_as_float(0x7fc00000);
    return {nan, nan, nan};
  }
  const float m = fmaxf(lse_a, lse_b);
  if (m == -INFINITY) return {0.f, 0.f, -INFINITY};
  const float ea = expf(lse_a - m);
  const float eb = expf(lse_b - m);
  const float total = ea + eb;
  return {ea / total, eb / total, m + logf(total)};
}

// A side of weight 0 is dropped, not multiplied: a NaN there cannot leak out, and the other side
// (of weight exactly 1 then) comes back bit for bit, -0.0 included (-0.0 + 0.0 would be +0.0).
__device__ __forceinline__ float lse_blend(const LseMerge& w, float a, float b) {
  if (w.wb == 0.f) return w.wa == 0.f ? 0.f : w.wa * a;
  if (w.wa == 0.f) return w.wb * b;
  return w.wa * a + w.wb * b;
}

// ---- decode: per-split kernel -----------------------------------------------------

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 32;  // tokens per stage: one per lane in the score step
constexpr int kStages = 2;
constexpr int kMaxGroup = 8;  // query heads per CTA; larger groups use several CTAs

// Compile-time shape of the per-split kernel for cache element type C (the
// activations' type, or a one-byte code), head_dim D and GC query heads per CTA.
// Shared memory offsets are in bytes.
template <typename C, int D, int GC>
struct DecodeShape {
  static constexpr bool kCompact = sizeof(C) == 1;  // codes with per-token scales
  static constexpr int kVec = 16 / static_cast<int>(sizeof(C));  // elements per 16-byte chunk
  static constexpr int kChunks = D / kVec;                        // chunks per K/V row
  static constexpr int kRowBytes = D * static_cast<int>(sizeof(C));
  // K rows are padded by 16 bytes: in the score step lane t reads row t, and a
  // row stride of an odd number of 16-byte units keeps the 8 lanes of each
  // phase of those 16-byte reads on distinct banks.
  static constexpr int kKStride = kRowBytes + 16;
  static constexpr int kRowStep = kThreads / kChunks;  // tile rows one pass of the CTA copies
  static constexpr int kCopiesPerThread = kTile / kRowStep;
  static constexpr int kQkDims = D / kWarps;            // head_dim slice of a warp, score step
  static constexpr int kPvDims = D / 32;                // head_dim slice of a lane, P.V step
  static constexpr int kPvBytes = kPvDims * static_cast<int>(sizeof(C));
  static constexpr int kPvTokens = kTile / kWarps;      // tokens of a warp, P.V step
  static constexpr int kHeadsPerWarp = (GC + kWarps - 1) / kWarps;  // softmax step

  static constexpr int kStageBytes = kTile * (kKStride + kRowBytes);  // K tile, then V tile
  static constexpr int kKvBytes = kStages * kStageBytes;
  static constexpr int kAccBytes = kWarps * GC * D * 4;  // epilogue; reuses the K/V stages
  static constexpr int kOffQ = kKvBytes > kAccBytes ? kKvBytes : kAccBytes;  // [GC][D] f32
  static constexpr int kOffRed = kOffQ + GC * D * 4;            // [kWarps][GC][kTile] f32
  static constexpr int kOffP = kOffRed + kWarps * GC * kTile * 4;  // [kTile][GC] f32
  static constexpr int kOffValid = kOffP + kTile * GC * 4;      // [kStages][kTile] int
  // Compact caches: [kStages][kTile] f32 key scales, then as many value scales.
  static constexpr int kOffCodeScale = kOffValid + kStages * kTile * 4;
  static constexpr int kOffScale = kOffCodeScale + (kCompact ? 2 * kStages * kTile * 4 : 0);  // [GC] f32
  static constexpr int kOffL = kOffScale + GC * 4;              // [GC] f32
  static constexpr int kOffM = kOffL + GC * 4;                  // [GC] f32
  static constexpr int kSmemBytes = kOffM + GC * 4;

  static_assert(kThreads % kChunks == 0 && kTile % kRowStep == 0, "copy mapping");
  static_assert((kKStride / 16) % 2 == 1, "conflict-free K rows");
  static_assert(kQkDims % kVec == 0 && kPvBytes >= 2, "head_dim slices");
  static_assert(kOffRed % 16 == 0 && kOffP % 16 == 0, "16-byte aligned shared arrays");
};

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Zero of a cache element type C: from_float for the activations' types, the
// all-zero byte for a code (codes have no from_float).
template <typename C>
__device__ __forceinline__ C cache_zero() {
  if constexpr (sizeof(C) == 1) {
    return C{};
  } else {
    return from_float<C>(0.f);
  }
}

// Copies one 16-byte chunk of a cache row (element offset src) into shared
// memory, or zero-fills it when src < 0 (masked token). With async, cp.async
// (the source must be 16-byte aligned); else element by element through registers.
template <typename C>
__device__ __forceinline__ void copy_chunk(unsigned char* dst, const C* cache, int64_t src, bool async) {
  constexpr int kN = 16 / static_cast<int>(sizeof(C));
  if (async) {
    const uint32_t dst_addr = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    const C* from = src >= 0 ? cache + src : cache;
    const int bytes = src >= 0 ? 16 : 0;  // 0 reads nothing and fills zeros
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_addr), "l"(from),
                 "r"(bytes)
                 : "memory");
  } else {
    C* to = reinterpret_cast<C*>(dst);
#pragma unroll
    for (int e = 0; e < kN; ++e) to[e] = src >= 0 ? cache[src + e] : cache_zero<C>();
  }
}

// The kN values of C at p (shared memory, aligned to their size) as floats:
// whole 32-bit words, or one 16-bit pair of codes (head_dim 64, one byte each).
template <typename C, int kN>
__device__ __forceinline__ void load_values(const unsigned char* p, float (&f)[kN]) {
  constexpr int kBytes = kN * static_cast<int>(sizeof(C));
  if constexpr (kBytes >= 4) {
    uint32_t w[kBytes / 4];
    detail::load_words(p, w);
    detail::unpack<C>(w, f);
  } else {
    static_assert(kBytes == 2 && sizeof(C) == 1, "a pair of one-byte codes");
    const uint32_t w[1] = {*reinterpret_cast<const uint16_t*>(p)};
    float f4[4];
    detail::unpack<C>(w, f4);
    f[0] = f4[0];
    f[1] = f4[1];
  }
}

// What the host resolves once per launch, beside the params.
struct DecodeLaunch {
  int group;                       // query heads per KV head
  int head_chunks;                 // CTAs per KV head: ceil(group / GC)
  bool async_copy;                 // caches 16-byte aligned: cp.async, else plain copies
  detail::FastDivmod block_size;   // token -> (block index, offset); tokens < 2^31
};

// Workspace: partial outputs [batch, num_q_heads, num_splits, D] f32, then
// their LSEs [batch, num_q_heads, num_splits] f32 (natural log, -inf: empty).
// T: the type of q; C: the caches' element type (T, int8_t or __nv_fp8_e4m3).
template <typename T, typename C, int D, int GC>
__global__ void __launch_bounds__(kThreads) decode_split_kernel(DecodeAttentionParams p, DecodeLaunch l) {
  using S = DecodeShape<C, D, GC>;
  extern __shared__ __align__(16) unsigned char smem[];
  float* q_s = reinterpret_cast<float*>(smem + S::kOffQ);
  float* red_s = reinterpret_cast<float*>(smem + S::kOffRed);
  float* p_s = reinterpret_cast<float*>(smem + S::kOffP);
  int* valid_s = reinterpret_cast<int*>(smem + S::kOffValid);
  float* k_scale_s = reinterpret_cast<float*>(smem + S::kOffCodeScale);  // compact caches only
  float* v_scale_s = k_scale_s + kStages * kTile;
  float* scale_s = reinterpret_cast<float*>(smem + S::kOffScale);
  float* l_s = reinterpret_cast<float*>(smem + S::kOffL);
  float* m_s = reinterpret_cast<float*>(smem + S::kOffM);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int num_splits = p.num_splits;
  const int64_t b = blockIdx.x / num_splits;
  const int split = static_cast<int>(blockIdx.x % num_splits);
  const int kv_head = static_cast<int>(blockIdx.y) / l.head_chunks;
  const int head_chunk = static_cast<int>(blockIdx.y) % l.head_chunks;
  const int64_t head0 = int64_t{kv_head} * l.group + head_chunk * GC;  // first query head
  const int num_heads = min(GC, l.group - head_chunk * GC);           // valid heads of this CTA

  // This split's tokens [begin, end): tile-aligned chunks of the window's tokens
  // [first, seq_len) of the clamped length (the capacity, max_blocks_per_seq *
  // block_size, is < 2^31: checked at launch); tokens before the window, and their
  // block-table entries, are never read.
  const int64_t capacity = p.max_blocks_per_seq * p.block_size;
  const int64_t seq_len =
      min(max(load_index(p.seq_lens, p.seq_lens_type, b), int64_t{0}), capacity);
  const int64_t first = window_first_token(seq_len, p.k_new != nullptr, p.window);
  const int64_t per_split = ceil_div(ceil_div(seq_len - first, num_splits), kTile) * kTile;
  const uint32_t begin = static_cast<uint32_t>(min(first + split * per_split, seq_len));
  const uint32_t end = static_cast<uint32_t>(min(begin + per_split, seq_len));
  const int num_tiles = static_cast<int>(ceil_div(end - begin, kTile));

  // q of the CTA's heads, pre-multiplied by scale * log2(e): scores come out in
  // the log2 domain. Heads past num_heads are zero (their results are dropped).
  const float q_scale = p.scale * kLog2e;
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride;
  for (int i = tid; i < GC * D; i += kThreads) {
    const int h = i / D;
    q_s[i] = h < num_heads ? to_float(q[(head0 + h) * p.q_head_stride + i % D]) * q_scale : 0.f;
  }

  const C* k_cache = static_cast<const C*>(p.k_cache);
  const C* v_cache = static_cast<const C*>(p.v_cache);
  const int chunk_col = tid % S::kChunks;  // fixed 16-byte column of this thread's copies
  const int row0 = tid / S::kChunks;
  // Compact caches: the scales of the rows this thread copies (chunk_col 0), loaded
  // when the tile is issued and stored to shared memory by store_scales, one tile's
  // work later, so the load's latency hides behind it (cp.async moves 4 bytes or
  // more, and a scale is 2).
  __half k_scale_r[S::kCopiesPerThread];
  __half v_scale_r[S::kCopiesPerThread];
  auto issue_tile = [&](int tile, int stage) {
    unsigned char* k_tile = smem + stage * S::kStageBytes;
    unsigned char* v_tile = k_tile + kTile * S::kKStride;
#pragma unroll
    for (int r = 0; r < S::kCopiesPerThread; ++r) {
      const int t = row0 + r * S::kRowStep;
      const uint32_t token = begin + static_cast<uint32_t>(tile * kTile + t);
      int64_t row = -1;  // the token's (slot, kv head) row in the caches and scales; -1: masked
      if (token < end) {
        uint32_t block_index, offset;
        l.block_size.divmod(token, block_index, offset);
        const int64_t block = load_index(p.block_tables, p.block_table_type,
                                         b * p.block_table_row_stride + block_index);
        if (block >= 0 && block < p.num_blocks) {  // else masked, never read
          row = (block * p.block_size + offset) * p.num_kv_heads + kv_head;
        }
      }
      const int64_t src = row >= 0 ? row * D + chunk_col * S::kVec : -1;  // element offset of the chunk
      if (chunk_col == 0) {
        valid_s[stage * kTile + t] = row >= 0;
        if constexpr (S::kCompact) {
          const __half zero = __float2half_rn(0.f);
          k_scale_r[r] = row >= 0 ? static_cast<const __half*>(p.k_scale)[row] : zero;
          v_scale_r[r] = row >= 0 ? static_cast<const __half*>(p.v_scale)[row] : zero;
        }
      }
      copy_chunk(k_tile + t * S::kKStride + chunk_col * 16, k_cache, src, l.async_copy);
      copy_chunk(v_tile + t * S::kRowBytes + chunk_col * 16, v_cache, src, l.async_copy);
    }
  };
  auto store_scales = [&](int stage) {
    if constexpr (S::kCompact) {
      if (chunk_col == 0) {
#pragma unroll
        for (int r = 0; r < S::kCopiesPerThread; ++r) {
          const int t = row0 + r * S::kRowStep;
          k_scale_s[stage * kTile + t] = __half2float(k_scale_r[r]);
          v_scale_s[stage * kTile + t] = __half2float(v_scale_r[r]);
        }
      }
    }
  };

  float m_run[S::kHeadsPerWarp];  // running max (log2 domain) of the warp's softmax heads
  float l_run[S::kHeadsPerWarp];  // this lane's share of the running sum of exp2
#pragma unroll
  for (int j = 0; j < S::kHeadsPerWarp; ++j) {
    m_run[j] = -INFINITY;
    l_run[j] = 0.f;
  }
  float acc[GC][S::kPvDims] = {};  // unnormalised P.V of this warp's tokens, this lane's dims

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_tiles) {
      issue_tile(s, s);
      store_scales(s);
    }
    cp_async_commit();
  }
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = tile % kStages;
    const int next = tile + kStages - 1;
    if (next < num_tiles) issue_tile(next, next % kStages);  // its stage was freed last iteration
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    __syncthreads();  // tile `tile` (and q_s, valid_s) visible to all

    // Scores: lane = token; this warp's head_dim slice; partial dots to red_s.
    {
      const unsigned char* k_row = smem + stage * S::kStageBytes + lane * S::kKStride +
                                   warp * S::kQkDims * static_cast<int>(sizeof(C));
      const float* q_w = q_s + warp * S::kQkDims;
      float part[GC] = {};
#pragma unroll
      for (int c = 0; c < S::kQkDims / S::kVec; ++c) {
        float kf[S::kVec];
        load_values<C>(k_row + c * 16, kf);
#pragma unroll
        for (int h = 0; h < GC; ++h) {
#pragma unroll
          for (int e = 0; e < S::kVec; e += 4) {
            const float4 qv = *reinterpret_cast<const float4*>(q_w + h * D + c * S::kVec + e);
            part[h] += qv.x * kf[e] + qv.y * kf[e + 1] + qv.z * kf[e + 2] + qv.w * kf[e + 3];
          }
        }
      }
#pragma unroll
      for (int h = 0; h < GC; ++h) red_s[(warp * GC + h) * kTile + lane] = part[h];
    }
    __syncthreads();

    // Online softmax: warp owns heads warp, warp + kWarps, ...; lane = token.
    {
      const bool valid = valid_s[stage * kTile + lane] != 0;
      // Compact caches: the scales of this token's key and value (else 1, folded away).
      const float k_scale = S::kCompact ? k_scale_s[stage * kTile + lane] : 1.f;
      const float v_scale = S::kCompact ? v_scale_s[stage * kTile + lane] : 1.f;
#pragma unroll
      for (int j = 0; j < S::kHeadsPerWarp; ++j) {
        const int h = warp + j * kWarps;
        if (h < GC) {
          float s = 0.f;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) s += red_s[(w * GC + h) * kTile + lane];
          s = valid ? s * k_scale : -INFINITY;
          const float m_new = fmaxf(m_run[j], detail::warp_max(s));
          // Old max -inf: nothing accumulated yet, and exp2(-inf - -inf) would be NaN.
          const float rescale = m_run[j] == -INFINITY ? 0.f : exp2f(m_run[j] - m_new);
          const float prob = valid ? exp2f(s - m_new) : 0.f;
          l_run[j] = l_run[j] * rescale + prob;
          m_run[j] = m_new;
          p_s[lane * GC + h] = prob * v_scale;
          if (lane == 0) scale_s[h] = rescale;
        }
      }
    }
    __syncthreads();

    // P.V: warp takes tokens [warp * kPvTokens, +kPvTokens); lane = head_dim slice.
    {
#pragma unroll
      for (int h = 0; h < GC; ++h) {
        const float rescale = scale_s[h];
#pragma unroll
        for (int i = 0; i < S::kPvDims; ++i) acc[h][i] *= rescale;
      }
      const unsigned char* v_tile = smem + stage * S::kStageBytes + kTile * S::kKStride;
#pragma unroll 2
      for (int i = 0; i < S::kPvTokens; ++i) {
        const int t = warp * S::kPvTokens + i;
        if (valid_s[stage * kTile + t] == 0) continue;  // masked or past the end (warp-uniform)
        float vf[S::kPvDims];
        load_values<C>(v_tile + t * S::kRowBytes + lane * S::kPvBytes, vf);
        float prob[GC];
        if constexpr (GC % 4 == 0) {
#pragma unroll
          for (int h = 0; h < GC; h += 4) {
            const float4 pv = *reinterpret_cast<const float4*>(p_s + t * GC + h);
            prob[h] = pv.x;
            prob[h + 1] = pv.y;
            prob[h + 2] = pv.z;
            prob[h + 3] = pv.w;
          }
        } else {
#pragma unroll
          for (int h = 0; h < GC; ++h) prob[h] = p_s[t * GC + h];
        }
#pragma unroll
        for (int h = 0; h < GC; ++h) {
#pragma unroll
          for (int d = 0; d < S::kPvDims; ++d) acc[h][d] += prob[h] * vf[d];
        }
      }
    }
    if (next < num_tiles) store_scales(next % kStages);  // that stage's scales are free too
    __syncthreads();  // stage, red_s, p_s and scale_s free for the next tile
  }
  cp_async_wait<0>();  // nothing may still land in the stages reused below

  // Epilogue: sum the 4 warps' accumulators, normalise, write the partials.
#pragma unroll
  for (int j = 0; j < S::kHeadsPerWarp; ++j) {
    const int h = warp + j * kWarps;
    if (h < GC) {
      const float l = detail::warp_sum(l_run[j]);
      if (lane == 0) {
        l_s[h] = l;
        m_s[h] = m_run[j];
      }
    }
  }
  float* acc_s = reinterpret_cast<float*>(smem);  // [kWarps][GC][D]
#pragma unroll
  for (int h = 0; h < GC; ++h) {
#pragma unroll
    for (int d = 0; d < S::kPvDims; ++d) acc_s[(warp * GC + h) * D + lane * S::kPvDims + d] = acc[h][d];
  }
  __syncthreads();
  const int64_t bh0 = b * p.num_q_heads + head0;  // (sequence, first head) row of the workspace
  float* out_part = p.workspace + (bh0 * num_splits + split) * D;
  for (int i = tid; i < num_heads * D; i += kThreads) {
    const int h = i / D;
    const int d = i % D;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += acc_s[(w * GC + h) * D + d];
    const float l = l_s[h];
    // l == 0: an empty split. A NaN score leaves l NaN, which the output and lse carry on.
    out_part[int64_t{h} * num_splits * D + d] = l != 0.f ? sum / l : 0.f;
  }
  if (tid < num_heads) {
    const float l = l_s[tid];
    float* lse_part = p.workspace + p.batch * p.num_q_heads * num_splits * D;
    lse_part[(bh0 + tid) * num_splits + split] = l != 0.f ? (m_s[tid] + log2f(l)) * kLn2 : -INFINITY;
  }
}

// ---- decode: combine kernel -----------------------------------------------------------
// One warp per (sequence b, query head h); lane owns D/32 contiguous dims.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) decode_combine_kernel(DecodeAttentionParams p, int group) {
  constexpr int kDims = D / 32;
  const int lane = threadIdx.x & 31;
  const int64_t bh = int64_t{blockIdx.x} * kWarps + (threadIdx.x >> 5);
  if (bh >= p.batch * p.num_q_heads) return;  // whole warp; no barriers in this kernel
  const int64_t b = bh / p.num_q_heads;
  const int64_t h = bh % p.num_q_heads;
  const int num_splits = p.num_splits;
  const float* out_part = p.workspace + bh * num_splits * D + lane * kDims;
  const float* lse_part = p.workspace + p.batch * p.num_q_heads * num_splits * D + bh * num_splits;

  float acc[kDims] = {};
  float lse = -INFINITY;
  for (int s = 0; s < num_splits; ++s) {
    const float lse_s = lse_part[s];
    if (lse_s == -INFINITY) continue;  // empty split: nothing to merge
    uint32_t ow[kDims];
    detail::load_words(out_part + int64_t{s} * D, ow);
    float o[kDims];
    detail::unpack<float>(ow, o);
    const LseMerge w = lse_merge(lse, lse_s);
#pragma unroll
    for (int d = 0; d < kDims; ++d) acc[d] = lse_blend(w, acc[d], o[d]);
    lse = w.lse;
  }
  if (p.k_new != nullptr) {
    // The new token alone: its logit, and its value as the part's output.
    const int64_t g = h / group;
    const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + lane * kDims;
    const T* k = static_cast<const T*>(p.k_new) + b * p.k_new_batch_stride + g * p.k_new_head_stride + lane * kDims;
    const T* v = static_cast<const T*>(p.v_new) + b * p.v_new_batch_stride + g * p.v_new_head_stride + lane * kDims;
    float dot = 0.f;
#pragma unroll
    for (int d = 0; d < kDims; ++d) dot += to_float(q[d]) * to_float(k[d]);
    const LseMerge w = lse_merge(lse, detail::warp_sum(dot) * p.scale);
#pragma unroll
    for (int d = 0; d < kDims; ++d) acc[d] = lse_blend(w, acc[d], to_float(v[d]));
    lse = w.lse;
  }
  T* out = static_cast<T*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride + lane * kDims;
#pragma unroll
  for (int d = 0; d < kDims; ++d) out[d] = from_float<T>(acc[d]);
  if (lane == 0) p.lse[bh] = lse;
}

template <typename T, typename C, int D, int GC>
cudaError_t launch_decode(const DecodeAttentionParams& p, int group, cudaStream_t stream) {
  using S = DecodeShape<C, D, GC>;
  if (p.max_blocks_per_seq * p.block_size > INT32_MAX) return cudaErrorInvalidValue;
  DecodeLaunch l;
  l.group = group;
  l.head_chunks = static_cast<int>(ceil_div(group, GC));
  // cp.async needs 16-byte aligned sources: true for any cache allocated whole.
  l.async_copy = detail::aligned16(p.k_cache) && detail::aligned16(p.v_cache);
  l.block_size = detail::FastDivmod(static_cast<uint32_t>(p.block_size));
  const int64_t grid_x = p.batch * p.num_splits;
  const int64_t grid_y = p.num_kv_heads * l.head_chunks;
  if (grid_x > INT32_MAX || grid_y > 65535) return cudaErrorInvalidConfiguration;
  auto* kernel = decode_split_kernel<T, C, D, GC>;
  if (S::kSmemBytes > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes);
    if (err != cudaSuccess) return err;
  }
  kernel<<<dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y)), kThreads,
           S::kSmemBytes, stream>>>(p, l);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int64_t combine_blocks = ceil_div(p.batch * p.num_q_heads, kWarps);
  if (combine_blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  decode_combine_kernel<T, D><<<static_cast<unsigned>(combine_blocks), kThreads, 0, stream>>>(p, group);
  return cudaGetLastError();
}

template <typename T, typename C, int D>
cudaError_t dispatch_group(const DecodeAttentionParams& p, cudaStream_t stream) {
  const int group = static_cast<int>(p.num_q_heads / p.num_kv_heads);
  if (group <= 1) return launch_decode<T, C, D, 1>(p, group, stream);
  if (group <= 2) return launch_decode<T, C, D, 2>(p, group, stream);
  if (group <= 4) return launch_decode<T, C, D, 4>(p, group, stream);
  return launch_decode<T, C, D, kMaxGroup>(p, group, stream);
}

// ---- merge_attn_states --------------------------------------------------------------
// Block (tx, ty): ty (token, head) rows per block, tx threads along head_dim,
// kN elements per access (a 16-byte vector when pointers and strides allow).
template <typename T, int kN>
__global__ void merge_attn_states_kernel(MergeAttnStatesParams p) {
  static_assert(kN == 1 || kN * sizeof(T) == 16, "one element or one 16-byte vector");
  const int64_t rows = p.num_tokens * p.num_heads;
  const int vecs = static_cast<int>(p.head_dim / kN);
  const int64_t row_step = int64_t{gridDim.x} * blockDim.y;
  for (int64_t row = int64_t{blockIdx.x} * blockDim.y + threadIdx.y; row < rows; row += row_step) {
    const int64_t t = row / p.num_heads;
    const int64_t h = row % p.num_heads;
    const LseMerge w = lse_merge(p.lse_a[t * p.lse_a_token_stride + h * p.lse_a_head_stride],
                                 p.lse_b[t * p.lse_b_token_stride + h * p.lse_b_head_stride]);
    const T* a = static_cast<const T*>(p.a) + t * p.a_token_stride + h * p.a_head_stride;
    const T* b = static_cast<const T*>(p.b) + t * p.b_token_stride + h * p.b_head_stride;
    T* out = static_cast<T*>(p.out) + t * p.out_token_stride + h * p.out_head_stride;
    for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
      const int64_t d = int64_t{v} * kN;
      if constexpr (kN > 1) {
        uint32_t aw[4], bw[4];
        detail::load_words(a + d, aw);
        detail::load_words(b + d, bw);
        float af[kN], bf[kN];
        detail::unpack<T>(aw, af);
        detail::unpack<T>(bw, bf);
#pragma unroll
        for (int e = 0; e < kN; ++e) af[e] = lse_blend(w, af[e], bf[e]);
        detail::pack<T>(af, aw);
        detail::store_words(out + d, aw);
      } else {
        out[d] = from_float<T>(lse_blend(w, to_float(a[d]), to_float(b[d])));
      }
    }
    if (threadIdx.x == 0) p.lse[row] = w.lse;
  }
}

}  // namespace

int decode_attention_num_splits(int64_t batch, int64_t num_kv_heads, int64_t max_context,
                                int64_t block_size, int num_sms) {
  constexpr int64_t kMaxSplits = 32;
  constexpr int64_t kMinSplitTokens = 256;  // several tiles and blocks: fixed costs stay small
  constexpr int64_t kCtasPerSm = 4;         // resident split CTAs per SM, roughly
  const int64_t items = std::max<int64_t>(1, batch * num_kv_heads);
  const int64_t min_tokens = std::max<int64_t>(kMinSplitTokens, 4 * std::max<int64_t>(1, block_size));
  const int64_t by_length = max_context / min_tokens;
  const int64_t wanted = ceil_div(2 * std::max(1, num_sms) * kCtasPerSm, items);  // ~2 waves
  return static_cast<int>(std::clamp<int64_t>(std::min(wanted, by_length), 1, kMaxSplits));
}

size_t decode_attention_workspace_floats(int64_t batch, int64_t num_q_heads, int64_t head_dim,
                                         int num_splits) {
  return static_cast<size_t>(batch * num_q_heads * num_splits * (head_dim + 1));
}

cudaError_t decode_attention(const DecodeAttentionParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.num_q_heads <= 0) return cudaSuccess;
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0 || p.num_splits < 1 ||
      p.block_size < 1 || p.workspace == nullptr ||
      (p.cache_type != CacheType::kModel && (p.k_scale == nullptr || p.v_scale == nullptr))) {
    return cudaErrorInvalidValue;
  }
  return detail::dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    return detail::dispatch_cache<T>(p.cache_type, [&](auto code_tag) {
      using C = decltype(code_tag);
      switch (p.head_dim) {
        case 64: return dispatch_group<T, C, 64>(p, stream);
        case 128: return dispatch_group<T, C, 128>(p, stream);
        case 256: return dispatch_group<T, C, 256>(p, stream);
        default: return cudaErrorInvalidValue;
      }
    });
  });
}

cudaError_t merge_attn_states(const MergeAttnStatesParams& p, cudaStream_t stream) {
  const int64_t rows = p.num_tokens * p.num_heads;
  if (rows <= 0 || p.head_dim <= 0) return cudaSuccess;
  if (p.head_dim > INT32_MAX) return cudaErrorInvalidValue;
  return detail::dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kBytes = sizeof(T);
    constexpr int kN = 16 / kBytes;
    const bool vec_ok =
        p.head_dim % kN == 0 && detail::aligned16(p.out) && detail::aligned16(p.a) &&
        detail::aligned16(p.b) && detail::stride_aligned16(p.out_token_stride, kBytes) &&
        detail::stride_aligned16(p.out_head_stride, kBytes) &&
        detail::stride_aligned16(p.a_token_stride, kBytes) &&
        detail::stride_aligned16(p.a_head_stride, kBytes) &&
        detail::stride_aligned16(p.b_token_stride, kBytes) &&
        detail::stride_aligned16(p.b_head_stride, kBytes);
    const int64_t vecs = vec_ok ? p.head_dim / kN : p.head_dim;
    int tx = 1;
    while (tx < vecs && tx < 32) tx *= 2;
    const dim3 block(tx, kThreads / tx);
    const dim3 grid(static_cast<unsigned>(std::min(ceil_div(rows, block.y), kMaxGrid)));
    if (vec_ok) {
      merge_attn_states_kernel<T, kN><<<grid, block, 0, stream>>>(p);
    } else {
      merge_attn_states_kernel<T, 1><<<grid, block, 0, stream>>>(p);
    }
    return cudaGetLastError();
  });
}

}  // namespace stagewise::cuda
