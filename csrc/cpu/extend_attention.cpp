// CPU attention of runs of new tokens over the paged KV cache that already holds them (maths in
// include/stagewise/attention.h, ExtendAttentionParams): a prompt's chunk after its cached tokens,
// the drafts a row verifies, a prompt from its first token.
//
// Work item = (sequence b, kv head g, a tile of up to kQueryTile of its run's tokens): the tile's
// tokens times the G = Hq / Hk query heads of group g are its M query rows, which share every K/V
// tile they read. Unlike decode rows, where each token would read the whole cache on its own, a
// cached row is read (and converted, for half dtypes and compact codes) once per work item. Keys
// go K at a time (NK vectors of W floats), as a small matrix product: the tile's K rows transposed
// into [D, K] (a compact key's scale folded in), then scores[m, 0..K) = sum_d q[m, d] * kt[d, :]
// for R rows at a time with each K vector loaded once per d; an online softmax per row (causal and
// window bounds as -inf); p·V from the V rows, each V vector loaded once for several rows. The
// loops are written once in vector extensions and compiled per ISA level (W = 16 floats with
// AVX-512, 8 with AVX2 and the baseline), picked at run time by cpu_isa().
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

#include "cpu/attention_rows.h"
#include "stagewise/attention.h"

namespace stagewise::cpu {
namespace {

constexpr int64_t kQueryTile = 16;    // a work item's tokens at most
constexpr int64_t kMinQueryTile = 4;  // ... and at least, when fewer items would idle threads

// W floats to a vector: 16 in the AVX-512 copy, 8 in the others (one AVX2 register, two SSE ones).
// A tile's keys are W: one vector of scores per query row.
template <int W>
struct Lanes;
template <>
struct Lanes<8> {
  typedef float V __attribute__((vector_size(32)));
  typedef int32_t I __attribute__((vector_size(32)));
};
template <>
struct Lanes<16> {
  typedef float V __attribute__((vector_size(64)));
  typedef int32_t I __attribute__((vector_size(64)));
};

template <typename V>
STAGEWISE_ALWAYS_INLINE void loadv(V& v, const float* p) { __builtin_memcpy(&v, p, sizeof(V)); }
template <typename V>
STAGEWISE_ALWAYS_INLINE void storev(float* p, const V& v) { __builtin_memcpy(p, &v, sizeof(V)); }

#if defined(__clang__)
#define STAGEWISE_SHUFFLE_W(I, a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define STAGEWISE_SHUFFLE_W(I, a, b, ...) __builtin_shuffle(a, b, I{__VA_ARGS__})
#endif
#define STAGEWISE_UNPAREN(...) __VA_ARGS__

// One stage of a WxW transpose: rows r and r + 2^K swap their column bit K with their row bit K:
// the low row takes a's columns whose bit K is 0 and, in the others, b's columns 2^K before; the
// high row a's columns 2^K after and b's own. After every stage, element (r, c) sits at (c, r).
#define STAGEWISE_TRANSPOSE_STAGE(K, LO, HI)                                                   \
  for (int r = 0; r < W; ++r) {                                                                \
    if (r & (1 << K)) continue;                                                                \
    const V a = x[r], b = x[r + (1 << K)];                                                     \
    x[r] = STAGEWISE_SHUFFLE_W(I, a, b, STAGEWISE_UNPAREN LO);                                 \
    x[r + (1 << K)] = STAGEWISE_SHUFFLE_W(I, a, b, STAGEWISE_UNPAREN HI);                      \
  }

// out[c * stride + r] = rows[r][col0 + c] for r, c < W.
template <int W>
STAGEWISE_ALWAYS_INLINE void transpose_tile(const float* const* rows, int64_t col0, float* out, int64_t stride) {
  using V = typename Lanes<W>::V;
  using I = typename Lanes<W>::I;
  V x[W];
  for (int r = 0; r < W; ++r) loadv(x[r], rows[r] + col0);
  if constexpr (W == 16) {
    STAGEWISE_TRANSPOSE_STAGE(0, (0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
                              (1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
    STAGEWISE_TRANSPOSE_STAGE(1, (0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
                              (2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
    STAGEWISE_TRANSPOSE_STAGE(2, (0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
                              (4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
    STAGEWISE_TRANSPOSE_STAGE(3, (0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                              (8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
  } else {
    STAGEWISE_TRANSPOSE_STAGE(0, (0, 8, 2, 10, 4, 12, 6, 14), (1, 9, 3, 11, 5, 13, 7, 15))
    STAGEWISE_TRANSPOSE_STAGE(1, (0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15))
    STAGEWISE_TRANSPOSE_STAGE(2, (0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15))
  }
  for (int c = 0; c < W; ++c) storev(out + c * stride, x[c]);
}
#undef STAGEWISE_TRANSPOSE_STAGE
#undef STAGEWISE_UNPAREN

struct Seq {
  int64_t start, n, base;  // the run's first q row, its tokens, the position of its first token
};

struct Item {
  int64_t b, g, i0, i1;  // sequence, kv head, the run's tokens [i0, i1)
  int64_t cost;
};

Seq seq_of(const ExtendAttentionParams& p, int64_t b) {
  const int64_t start = load_index(p.query_start_loc, p.query_start_loc_type, b);
  const int64_t n = load_index(p.query_start_loc, p.query_start_loc_type, b + 1) - start;
  return {start, n, load_index(p.seq_lens, p.seq_lens_type, b) - n};
}

int64_t first_key(const ExtendAttentionParams& p, int64_t pos) {
  return p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
}

int64_t block_id(const ExtendAttentionParams& p, int64_t b, int64_t j) {
  return load_index(p.block_tables, p.block_table_type, b * p.block_table_row_stride + j);
}

// Every run, length and block id a query reads is checked before any work, so bad metadata
// raises instead of reading out of bounds, and leaves out as it was.
void check_runs(const ExtendAttentionParams& p) {
  const auto qs = [&](int64_t i) { return load_index(p.query_start_loc, p.query_start_loc_type, i); };
  TORCH_CHECK_VALUE(qs(0) == 0 && qs(p.num_seqs) == p.num_tokens,
                    "stagewise.extend_attention: query_start_loc must run from 0 to num_tokens = ",
                    p.num_tokens, " (q dim 0), got ", qs(0), " .. ", qs(p.num_seqs));
  const int64_t capacity = p.max_blocks_per_seq * p.block_size;
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    const int64_t len = load_index(p.seq_lens, p.seq_lens_type, b), n = qs(b + 1) - qs(b);
    TORCH_CHECK_VALUE(n >= 0, "stagewise.extend_attention: query_start_loc must not decrease, got ", qs(b),
                      " then ", qs(b + 1), " at sequence ", b);
    TORCH_CHECK_VALUE(len >= n && len <= capacity, "stagewise.extend_attention: seq_lens[", b, "] = ", len,
                      " must be in [", n, ", ", capacity, "]: at least the sequence's ", n,
                      " new tokens (its run in q, already in the cache), at most what block_tables holds (",
                      p.max_blocks_per_seq, " blocks of ", p.block_size, " tokens)");
    if (n == 0) continue;
    for (int64_t j = first_key(p, len - n) / p.block_size, end = (len + p.block_size - 1) / p.block_size; j < end;
         ++j) {
      const int64_t id = block_id(p, b, j);
      TORCH_CHECK_INDEX(id >= 0 && id < p.num_blocks, "stagewise.extend_attention: block_tables[", b, "][", j,
                        "] = ", id, " is out of range [0, ", p.num_blocks, ")");
    }
  }
}

// One thread's float32 scratch, for work items of up to M query rows and tiles of up to kMaxKeys keys.
constexpr int64_t kMaxKeys = 32;
struct Scratch {
  Scratch(int64_t M, int64_t D)
      : buf(static_cast<size_t>(2 * M * D + M * kMaxKeys + 2 * M + 3 * kMaxKeys * D + D)) {
    q = buf.data();           // [M, D] the item's query rows, times the scale
    acc = q + M * D;          // [M, D] their unnormalised outputs
    s = acc + M * D;          // [M, kMaxKeys] scores, then softmax numerators
    m = s + M * kMaxKeys;        // [M] running max
    l = m + M;                // [M] running sum
    kt = l + M;               // [D, kMaxKeys] the key tile, transposed
    k = kt + D * kMaxKeys;  // [kMaxKeys, D] key rows as float32 (half dtypes, compact codes)
    v = k + kMaxKeys * D;        // [kMaxKeys, D] value rows as float32 (idem)
    zeros = v + kMaxKeys * D;    // [D] zeros: the rows past a short tile
  }
  std::vector<float> buf;
  float *q, *acc, *s, *m, *l, *kt, *k, *v, *zeros;
};

// Row `slot * Hk + g` of a cache as float32: the row itself, or converted into `buf` (a compact
// code times its scale).
template <typename C>
STAGEWISE_ALWAYS_INLINE const float* cache_row(const ExtendAttentionParams& p, const void* cache,
                                               const void* scales, int64_t row, float* buf) {
  const int64_t D = p.head_dim;
  const C* src = static_cast<const C*>(cache) + row * D;
  if constexpr (kCompact<C>) {
    const float scale = static_cast<float>(static_cast<const c10::Half*>(scales)[row]);
    int64_t d = 0;
    for (; d + kVec <= D; d += kVec) {
      VecF x;
      load8(x, src + d);
      vstore(buf + d, x * scale);
    }
    for (; d < D; ++d) buf[d] = static_cast<float>(src[d]) * scale;
    return buf;
  } else {
    return row_as_float(src, buf, D);
  }
}

// s[r, 0..K) = sum_d q[r, d] * kt[d, :] for the R rows q[0..R); K = W * NK keys, NK vectors a
// row (each kt vector loaded once per d for R rows, each q value broadcast once for NK vectors).
template <int W, int NK, int R>
STAGEWISE_ALWAYS_INLINE void score_block(float* s, const float* q, const float* kt, int64_t D) {
  using V = typename Lanes<W>::V;
  constexpr int K = W * NK;
  V acc[R][NK];
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < NK; ++n) acc[r][n] = V{};
  }
  for (int64_t d = 0; d < D; ++d) {
    V k[NK];
    for (int n = 0; n < NK; ++n) loadv(k[n], kt + d * K + n * W);
    for (int r = 0; r < R; ++r) {
      const float x = q[r * D + d];
      for (int n = 0; n < NK; ++n) acc[r][n] += x * k[n];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < NK; ++n) storev(s + r * K + n * W, acc[r][n]);
  }
}

// acc[r, c0 .. c0 + W NV) += sum_{j<n} p[r, j] * vrows[j][same columns] for the R rows (p's rows
// K apart).
template <int W, int K, int R, int NV>
STAGEWISE_ALWAYS_INLINE void pv_block(float* acc, const float* p, const float* const* vrows, int64_t n,
                                      int64_t D, int64_t c0) {
  using V = typename Lanes<W>::V;
  V a[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NV; ++c) loadv(a[r][c], acc + r * D + c0 + W * c);
  }
  for (int64_t j = 0; j < n; ++j) {
    V v[NV];
    for (int c = 0; c < NV; ++c) loadv(v[c], vrows[j] + c0 + W * c);
    for (int r = 0; r < R; ++r) {
      const float w = p[r * K + j];
      for (int c = 0; c < NV; ++c) a[r][c] += w * v[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NV; ++c) storev(acc + r * D + c0 + W * c, a[r][c]);
  }
}

// acc[r, :] += p[r, :n] · vrows for the M rows, R rows at a time, NV vectors of columns.
template <int W, int K, int R, int NV>
STAGEWISE_ALWAYS_INLINE void accumulate_values(float* acc, const float* p, const float* const* vrows,
                                               int64_t n, int64_t D, int64_t M) {
  int64_t c0 = 0;
  for (; c0 + W * NV <= D; c0 += W * NV) {
    int64_t r = 0;
    for (; r + R <= M; r += R) pv_block<W, K, R, NV>(acc + r * D, p + r * K, vrows, n, D, c0);
    for (; r < M; ++r) pv_block<W, K, 1, NV>(acc + r * D, p + r * K, vrows, n, D, c0);
  }
  for (; c0 + W <= D; c0 += W) {
    for (int64_t r = 0; r < M; ++r) pv_block<W, K, 1, 1>(acc + r * D, p + r * K, vrows, n, D, c0);
  }
  for (; c0 < D; ++c0) {
    for (int64_t r = 0; r < M; ++r) {
      float x = acc[r * D + c0];
      for (int64_t j = 0; j < n; ++j) x += p[r * K + j] * vrows[j][c0];
      acc[r * D + c0] = x;
    }
  }
}

// The work item's query rows over their keys, K = W * NK at a time, then out. R: score rows at a
// time; PR, PV: the p·V block (rows, vectors of columns), by ISA level.
template <typename T, typename C, int W, int NK, int R, int PR, int PV, bool kShuffle>
STAGEWISE_ALWAYS_INLINE void attend_item(const ExtendAttentionParams& p, const Item& it, Scratch& sc) {
  const int64_t G = p.num_q_heads / p.num_kv_heads, D = p.head_dim, Hk = p.num_kv_heads;
  const Seq seq = seq_of(p, it.b);
  const int64_t M = (it.i1 - it.i0) * G;
  const T* q = static_cast<const T*>(p.q);
  for (int64_t i = it.i0; i < it.i1; ++i) {
    for (int64_t h = 0; h < G; ++h) {
      const T* row = q + (seq.start + i) * p.q_token_stride + (it.g * G + h) * p.q_head_stride;
      float* dst = sc.q + ((i - it.i0) * G + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(row[d]) * p.scale;
    }
  }
  std::fill(sc.acc, sc.acc + M * D, 0.f);
  std::fill(sc.m, sc.m + M, kNegInf);
  std::fill(sc.l, sc.l + M, 0.f);
  const int64_t lo = first_key(p, seq.base + it.i0), hi = seq.base + it.i1;
  constexpr int64_t K = W * NK;
  const float* krows[K];
  const float* vrows[K];
  for (int64_t t0 = lo; t0 < hi; t0 += K) {
    const int64_t n = std::min<int64_t>(K, hi - t0);
    for (int64_t j = 0; j < K; ++j) {
      if (j >= n) {
        krows[j] = vrows[j] = sc.zeros;
        continue;
      }
      const int64_t t = t0 + j;
      const int64_t row = (block_id(p, it.b, t / p.block_size) * p.block_size + t % p.block_size) * Hk + it.g;
      krows[j] = cache_row<C>(p, p.k_cache, p.k_scale, row, sc.k + j * D);
      vrows[j] = cache_row<C>(p, p.v_cache, p.v_scale, row, sc.v + j * D);
    }
    int64_t c = 0;
    if constexpr (kShuffle) {  // (SSE2 has no two-source shuffle of 8 floats: element by element there)
      for (; c + W <= D; c += W) {
        for (int64_t g = 0; g < NK; ++g) transpose_tile<W>(krows + g * W, c, sc.kt + c * K + g * W, K);
      }
    }
    for (; c < D; ++c) {
      for (int64_t j = 0; j < K; ++j) sc.kt[c * K + j] = krows[j][c];
    }
    int64_t r = 0;
    for (; r + R <= M; r += R) score_block<W, NK, R>(sc.s + r * K, sc.q + r * D, sc.kt, D);
    for (; r < M; ++r) score_block<W, NK, 1>(sc.s + r * K, sc.q + r * D, sc.kt, D);
    // Online softmax per row over the keys it sees: [first of its window, itself].
    for (r = 0; r < M; ++r) {
      const int64_t pos = seq.base + it.i0 + r / G;
      const int64_t from = std::max<int64_t>(first_key(p, pos) - t0, 0), to = std::min(n, pos - t0 + 1);
      float* s = sc.s + r * K;
      if (from >= to) {  // nothing of this tile: its weights are 0
        std::fill(s, s + K, 0.f);
        continue;
      }
      for (int64_t j = 0; j < from; ++j) s[j] = kNegInf;
      for (int64_t j = to; j < K; ++j) s[j] = kNegInf;
      const float m_new = std::max(sc.m[r], max_of(s + from, to - from));
      const float alpha = std::exp(sc.m[r] - m_new);  // 0 on the row's first keys (m = -inf)
      sc.l[r] = sc.l[r] * alpha + exp_shifted_sum(s, K, m_new);
      sc.m[r] = m_new;
      if (alpha != 1.f) {
        float* a = sc.acc + r * D;
        for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
      }
    }
    accumulate_values<W, K, PR, PV>(sc.acc, sc.s, vrows, n, D, M);
  }
  T* out = static_cast<T*>(p.out);
  for (int64_t r = 0; r < M; ++r) {
    const int64_t i = it.i0 + r / G, h = r % G;
    float* a = sc.acc + r * D;
    const float inv = 1.f / sc.l[r];  // > 0: every token sees itself (a NaN score leaves it NaN)
    for (int64_t d = 0; d < D; ++d) a[d] *= inv;
    store_row(out + (seq.start + i) * p.out_token_stride + (it.g * G + h) * p.out_head_stride, a, D);
  }
}

using ItemFn = void (*)(const ExtendAttentionParams&, const Item&, Scratch&);

template <typename T, typename C>
void attend_item_baseline(const ExtendAttentionParams& p, const Item& it, Scratch& sc) {
  attend_item<T, C, 8, 1, 4, 2, 2, false>(p, it, sc);
}

#ifdef STAGEWISE_HAVE_AVX2_PATH
template <typename T, typename C>
STAGEWISE_TARGET_AVX2 void attend_item_avx2(const ExtendAttentionParams& p, const Item& it, Scratch& sc) {
  attend_item<T, C, 8, 2, 4, 4, 2, true>(p, it, sc);
}

template <typename T, typename C>
STAGEWISE_TARGET_AVX512 void attend_item_avx512(const ExtendAttentionParams& p, const Item& it, Scratch& sc) {
  attend_item<T, C, 16, 2, 8, 4, 4, true>(p, it, sc);
}
#endif

template <typename T, typename C>
ItemFn pick_attend_item() {
#ifdef STAGEWISE_HAVE_AVX2_PATH
  if (cpu_isa() >= Isa::kAvx512) return &attend_item_avx512<T, C>;
  if (use_avx2_path()) return &attend_item_avx2<T, C>;
#endif
  return &attend_item_baseline<T, C>;
}

// The work items: each sequence's run cut into tiles of `tile` tokens, times the kv heads.
std::vector<Item> work_items(const ExtendAttentionParams& p, int64_t tile) {
  std::vector<Item> items;
  const int64_t G = p.num_q_heads / p.num_kv_heads;
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    const Seq seq = seq_of(p, b);
    for (int64_t i0 = 0; i0 < seq.n; i0 += tile) {
      const int64_t i1 = std::min(seq.n, i0 + tile);
      const int64_t keys = seq.base + i1 - first_key(p, seq.base + i0);
      for (int64_t g = 0; g < p.num_kv_heads; ++g) items.push_back({b, g, i0, i1, (i1 - i0) * G * keys});
    }
  }
  return items;
}

template <typename T, typename C>
void extend_attention_typed(const ExtendAttentionParams& p) {
  const int threads = std::max(1, at::get_num_threads());
  int64_t tile = kQueryTile;
  std::vector<Item> items = work_items(p, tile);
  while (tile > kMinQueryTile && static_cast<int64_t>(items.size()) < 2 * threads) {
    tile /= 2;
    items = work_items(p, tile);
  }
  // Longest first, dealt round-robin to the threads' slots: each slot's share of the work is
  // about even, however unequal the runs (a prompt's later tokens see more keys).
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t slots = std::min<int64_t>(threads, static_cast<int64_t>(items.size()));
  const ItemFn attend = pick_attend_item<T, C>();
  const int64_t M = tile * (p.num_q_heads / p.num_kv_heads);
  at::parallel_for(0, slots, 1, [&](int64_t begin, int64_t end) {
    Scratch sc(M, p.head_dim);
    for (int64_t slot = begin; slot < end; ++slot) {
      for (size_t i = static_cast<size_t>(slot); i < items.size(); i += static_cast<size_t>(slots)) {
        attend(p, items[i], sc);
      }
    }
  });
}

}  // namespace

void extend_attention(const ExtendAttentionParams& p) {
  check_runs(p);
  if (p.num_tokens == 0 || p.num_q_heads == 0) return;
  dispatch_dtype_and_cache(p.dtype, p.cache_type, [&](auto t, auto c) {
    extend_attention_typed<decltype(t), decltype(c)>(p);
  });
}

}  // namespace stagewise::cpu
