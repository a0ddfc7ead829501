// CPU flash-decoding over the paged KV cache (maths in include/stagewise/attention.h).
//
// Work item = (sequence b, kv head g, split s). The G = Hq / Hk query heads of
// group g are handled together, so each cached K/V row is read (and converted
// to float32) once per group, not once per query head. A split walks its tokens
// in tiles of kTile: scores of the whole tile for all G heads, one running-max
// update and accumulator rescale per head per tile (online softmax), then p·V.
// The scattered cache rows are requested into L2 a tile ahead, in slices between
// the heads' phases (Prefetcher), since no hardware prefetcher follows them.
// A compact cache (int8 or e4m3 codes, a float16 scale per token and kv head) is read as
// codes: each row's 8-value loads convert in registers (load8), a key's scale multiplies its
// score and a value's its softmax weight, so nothing is dequantised into memory.
// Each split leaves its normalised partial output and lse in a float32
// workspace; a second pass per (b, g) folds the splits, then the new token
// (k_new/v_new), in with merge_lse_rows and writes out and lse.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "cpu/attention_codes.h"
#include "cpu/attention_rows.h"
#include "stagewise/attention.h"

namespace stagewise::cpu {
namespace {

// Cached tokens scored together: one max/rescale per head per tile; the tile's
// converted K and V rows (2 * kTile * head_dim floats) stay in L1/L2.
constexpr int64_t kTile = 32;
// decode_attention_num_splits: see there.
constexpr int64_t kMinSplitBlocks = 4;
constexpr int64_t kMinSplitTokens = 64;
constexpr int64_t kMaxSplits = 16;
// Tokens of K and V requested ahead of the tile being worked on, and the cache
// level they are requested into (1: L2).
constexpr int64_t kPrefetchAhead = 32;
constexpr int kPrefetchLocality = 1;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t seq_len_of(const DecodeAttentionParams& p, int64_t b) {
  return load_index(p.seq_lens, p.seq_lens_type, b);
}

int64_t block_id(const DecodeAttentionParams& p, int64_t b, int64_t j) {
  return load_index(p.block_tables, p.block_table_type, b * p.block_table_row_stride + j);
}

// The first cached token of sequence b in its window (0 without one).
int64_t first_token(const DecodeAttentionParams& p, int64_t b) {
  return window_first_token(seq_len_of(p, b), p.k_new != nullptr, p.window);
}

// Every length and every block id a sequence uses (those of its window) is checked
// before any work, so bad metadata raises instead of reading out of bounds, and
// leaves out/lse as they were. Table entries outside a sequence's window are never
// read (a sliding-window layer's freed blocks are -1 there).
void check_lengths_and_blocks(const DecodeAttentionParams& p) {
  const int64_t capacity = p.max_blocks_per_seq * p.block_size;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t len = seq_len_of(p, b);
    TORCH_CHECK_VALUE(len >= 0 && len <= capacity, "stagewise.decode_attention: seq_lens[", b,
                      "] = ", len, " is out of range [0, ", capacity,
                      "] (block_tables holds max_blocks_per_seq = ", p.max_blocks_per_seq,
                      " blocks of block_size = ", p.block_size, " tokens)");
    for (int64_t j = first_token(p, b) / p.block_size, n = ceil_div(len, p.block_size); j < n; ++j) {
      const int64_t id = block_id(p, b, j);
      TORCH_CHECK_INDEX(id >= 0 && id < p.num_blocks, "stagewise.decode_attention: block_tables[",
                        b, "][", j, "] = ", id, " is out of range [0, ", p.num_blocks, ")");
    }
  }
}

// Float32 scratch of one thread's chunk of work items, sized for one group.
struct Scratch {
  Scratch(int64_t G, int64_t D) : buf(static_cast<size_t>(G * D + 2 * kTile * D + G * kTile + 2 * G)) {
    q = buf.data();          // [G, D] the group's query rows
    k = q + G * D;           // [kTile, D] the tile's K rows (half dtypes only)
    v = k + kTile * D;       // [kTile, D] the tile's V rows (half dtypes only)
    p = v + kTile * D;       // [G, kTile] scores, then softmax numerators
    m = p + G * kTile;       // [G] running max
    l = m + G;               // [G] running sum of exp(score - max)
  }
  std::vector<float> buf;
  float *q, *k, *v, *p, *m, *l;
};

// Walks the cache rows of kv head g of sequence b, token by token from t0:
// yields row indices (slot * Hk + g) of k_cache/v_cache [num_blocks, block_size, Hk, D]
// (times head_dim: element offsets; a compact cache's scale index as they are),
// reading only the block table entries of the tokens it yields.
class RowCursor {
 public:
  RowCursor(const DecodeAttentionParams& p, int64_t b, int64_t g, int64_t t0)
      : p_(p), b_(b), g_(g), block_index_(t0 / p.block_size), offset_(t0 % p.block_size) {}

  void next(int64_t n, int64_t* rows) {
    for (int64_t i = 0; i < n; ++i, ++offset_) {
      if (offset_ == p_.block_size) {
        offset_ = 0;
        ++block_index_;
        block_ = -1;
      }
      if (block_ < 0) block_ = block_id(p_, b_, block_index_);
      rows[i] = (block_ * p_.block_size + offset_) * p_.num_kv_heads + g_;
    }
  }

 private:
  const DecodeAttentionParams& p_;
  int64_t b_, g_, block_index_, offset_, block_ = -1;
};

// Blocks are scattered, and a kv head's rows inside a block are Hk * D apart,
// so the hardware prefetcher does not see the coming tokens: ask for them, into
// L2 (prefetcht1/t2: pulling them into L1 as well evicts the tile being worked on).
template <typename T>
STAGEWISE_ALWAYS_INLINE void prefetch_rows(const T* base, const int64_t* rows, int64_t n,
                                           int64_t D) {
  constexpr int64_t kLine = 64;
  const int64_t bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < n; ++i) {
    const char* row = reinterpret_cast<const char*>(base + rows[i] * D);
    for (int64_t off = 0; off < bytes; off += kLine) __builtin_prefetch(row + off, 0, kPrefetchLocality);
  }
}

// Prefetches the rows of one cache (K or V) of kv head g of sequence b, from
// token `from` on, up to a given token.
template <typename T>
class Prefetcher {
 public:
  Prefetcher(const DecodeAttentionParams& p, const void* cache, int64_t b, int64_t g, int64_t from)
      : cache_(static_cast<const T*>(cache)), D_(p.head_dim), cursor_(p, b, g, from), at_(from) {}

  STAGEWISE_ALWAYS_INLINE void upto(int64_t end) {
    int64_t rows[kTile];
    while (at_ < end) {
      const int64_t n = std::min(kTile, end - at_);
      cursor_.next(n, rows);
      prefetch_rows(cache_, rows, n, D_);
      at_ += n;
    }
  }

 private:
  const T* cache_;
  int64_t D_;
  RowCursor cursor_;
  int64_t at_;
};

// Attends the G query rows sc.q [G, D] of group g of sequence b over its cached
// tokens [t0, t1), the caches' elements of type C (T, or a compact code; kIsa: the
// copy's level, 0 baseline, 1 AVX2, 2 AVX-512, which picks the compact tile loops of
// attention_codes.h). Writes out [G, D] (normalised, float32) and lse [G]; an empty
// range gives zeros and -inf.
template <typename T, typename C, int kIsa>
STAGEWISE_ALWAYS_INLINE void attend_tokens(const DecodeAttentionParams& p, int64_t b, int64_t g,
                                           int64_t t0, int64_t t1, Scratch& sc, float* out,
                                           float* lse) {
  const int64_t G = p.num_q_heads / p.num_kv_heads, D = p.head_dim;
  const C* k_cache = static_cast<const C*>(p.k_cache);
  const C* v_cache = static_cast<const C*>(p.v_cache);
  std::fill(out, out + G * D, 0.f);
  std::fill(sc.m, sc.m + G, kNegInf);
  std::fill(sc.l, sc.l + G, 0.f);
  int64_t rows[kTile];
  // The tile's rows as the dot products read them: float32 (converted into sc.k/sc.v for half
  // dtypes), or a compact cache's codes with their scales.
  using Row = std::conditional_t<kCompact<C>, C, float>;
  const Row* krows[kTile];
  const Row* vrows[kTile];
  float k_scales[kTile], v_scales[kTile];
  RowCursor cursor(p, b, g, t0);
  // The caller prefetched this range's first kPrefetchAhead tokens; the rest go
  // one slice per head and phase, kPrefetchAhead tokens ahead.
  const int64_t from = std::min(t1, t0 + kPrefetchAhead);
  Prefetcher<C> k_ahead(p, p.k_cache, b, g, from), v_ahead(p, p.v_cache, b, g, from);
  for (int64_t t = t0, n = 0; t < t1; t += n) {
    n = std::min(kTile, t1 - t);
    const auto ahead_to = [&](int64_t h) { return std::min(t1, t + kPrefetchAhead + n * (h + 1) / G); };
    cursor.next(n, rows);
    for (int64_t i = 0; i < n; ++i) {
      if constexpr (kCompact<C>) {
        krows[i] = k_cache + rows[i] * D;
        vrows[i] = v_cache + rows[i] * D;
        k_scales[i] = static_cast<float>(static_cast<const c10::Half*>(p.k_scale)[rows[i]]);
        v_scales[i] = static_cast<float>(static_cast<const c10::Half*>(p.v_scale)[rows[i]]);
      } else {
        krows[i] = row_as_float(k_cache + rows[i] * D, sc.k + i * D, D);
        vrows[i] = row_as_float(v_cache + rows[i] * D, sc.v + i * D, D);
      }
    }
    if constexpr (kCompact<C>) {  // every head at once: each code widened once for the group
      k_ahead.upto(ahead_to(G - 1));
#ifdef STAGEWISE_HAVE_AVX2_PATH
      if constexpr (kIsa == 2) {
        score_codes_avx512(sc.p, kTile, sc.q, G, krows, k_scales, n, D, p.scale);
      } else if constexpr (kIsa == 1) {
        score_codes_avx2(sc.p, kTile, sc.q, G, krows, k_scales, n, D, p.scale);
      } else
#endif
      {
        score_codes_generic(sc.p, kTile, sc.q, G, krows, k_scales, n, D, p.scale);
      }
    } else {
      for (int64_t h = 0; h < G; ++h) {
        k_ahead.upto(ahead_to(h));
        score_rows(sc.p + h * kTile, sc.q + h * D, krows, n, D, p.scale);
      }
    }
    for (int64_t h = 0; h < G; ++h) {
      float* s = sc.p + h * kTile;
      const float m_new = std::max(sc.m[h], max_of(s, n));
      const float alpha = std::exp(sc.m[h] - m_new);  // 0 on the first tile (m = -inf)
      const float sum = exp_shifted_sum(s, n, m_new);
      sc.l[h] = sc.l[h] * alpha + sum;
      sc.m[h] = m_new;
      float* acc = out + h * D;
      if (alpha != 1.f) {
        for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
      }
      if constexpr (kCompact<C>) {
        for (int64_t i = 0; i < n; ++i) s[i] *= v_scales[i];  // the weights times the values' scales
      } else {
        v_ahead.upto(ahead_to(h));
        accumulate_rows(acc, s, vrows, n, D);
      }
    }
    if constexpr (kCompact<C>) {
      v_ahead.upto(ahead_to(G - 1));
#ifdef STAGEWISE_HAVE_AVX2_PATH
      if constexpr (kIsa == 2) {
        accumulate_codes_avx512(out, sc.p, kTile, G, vrows, n, D);
      } else if constexpr (kIsa == 1) {
        accumulate_codes_avx2(out, sc.p, kTile, G, vrows, n, D);
      } else
#endif
      {
        accumulate_codes_generic(out, sc.p, kTile, G, vrows, n, D);
      }
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    if (sc.l[h] != 0.f) {  // a NaN score leaves l NaN: out and lse carry it, as the reference's
      float* acc = out + h * D;
      const float inv = 1.f / sc.l[h];
      for (int64_t d = 0; d < D; ++d) acc[d] *= inv;
      lse[h] = sc.m[h] + std::log(sc.l[h]);
    } else {
      lse[h] = kNegInf;
    }
  }
}

using AttendFn = void (*)(const DecodeAttentionParams&, int64_t, int64_t, int64_t, int64_t,
                          Scratch&, float*, float*);

template <typename T, typename C>
void attend_tokens_baseline(const DecodeAttentionParams& p, int64_t b, int64_t g, int64_t t0,
                            int64_t t1, Scratch& sc, float* out, float* lse) {
  attend_tokens<T, C, 0>(p, b, g, t0, t1, sc, out, lse);
}

#ifdef STAGEWISE_HAVE_AVX2_PATH
template <typename T, typename C>
STAGEWISE_TARGET_AVX2 void attend_tokens_avx2(const DecodeAttentionParams& p, int64_t b,
                                              int64_t g, int64_t t0, int64_t t1, Scratch& sc,
                                              float* out, float* lse) {
  attend_tokens<T, C, 1>(p, b, g, t0, t1, sc, out, lse);
}

// A compact cache's copy at AVX-512 (its codes sixteen to a register).
template <typename T, typename C>
STAGEWISE_TARGET_AVX512 void attend_tokens_avx512(const DecodeAttentionParams& p, int64_t b,
                                                  int64_t g, int64_t t0, int64_t t1, Scratch& sc,
                                                  float* out, float* lse) {
  attend_tokens<T, C, 2>(p, b, g, t0, t1, sc, out, lse);
}
#endif

template <typename T, typename C>
AttendFn pick_attend_tokens() {
#ifdef STAGEWISE_HAVE_AVX2_PATH
  if constexpr (kCompact<C>) {
    if (cpu_isa() >= Isa::kAvx512) return &attend_tokens_avx512<T, C>;
  }
  if (use_avx2_path()) return &attend_tokens_avx2<T, C>;
#endif
  return &attend_tokens_baseline<T, C>;
}

// Work item `item` = (sequence b, kv head g, split s) and its tokens [t0, t1).
struct Range {
  int64_t b, g, t0, t1;
};

Range item_range(const DecodeAttentionParams& p, int64_t item) {
  const int64_t Hk = p.num_kv_heads, S = p.num_splits;
  const int64_t b = item / (Hk * S), g = item / S % Hk, s = item % S;
  const int64_t len = seq_len_of(p, b);
  // Splits are whole blocks from the window's first block: ceil(blocks / S) each, the
  // last ones possibly empty; the first starts at the window's first token.
  const int64_t first = first_token(p, b), block0 = first / p.block_size * p.block_size;
  const int64_t split_tokens = ceil_div(ceil_div(len - block0, p.block_size), S) * p.block_size;
  const int64_t t0 = std::max(first, std::min(len, block0 + s * split_tokens));
  const int64_t t1 = std::max(t0, std::min(len, block0 + (s + 1) * split_tokens));
  return {b, g, t0, t1};
}

// The first kPrefetchAhead tokens of a work item, requested while the one before
// it runs.
template <typename T>
void prefetch_head(const DecodeAttentionParams& p, const Range& r) {
  const int64_t end = std::min(r.t1, r.t0 + kPrefetchAhead);
  Prefetcher<T>(p, p.k_cache, r.b, r.g, r.t0).upto(end);
  Prefetcher<T>(p, p.v_cache, r.b, r.g, r.t0).upto(end);
}

template <typename T, typename C>
void decode_attention_typed(const DecodeAttentionParams& p) {
  const int64_t B = p.batch, Hq = p.num_q_heads, Hk = p.num_kv_heads, G = Hq / Hk;
  const int64_t D = p.head_dim, S = p.num_splits;
  const T* q = static_cast<const T*>(p.q);
  // Per-split partial results: out [B, Hk, S, G, D], lse [B, Hk, S, G].
  std::unique_ptr<float[]> part_out(new float[B * Hq * S * D]);
  std::unique_ptr<float[]> part_lse(new float[B * Hq * S]);
  const AttendFn attend = pick_attend_tokens<T, C>();

  at::parallel_for(0, B * Hk * S, 1, [&](int64_t begin, int64_t end) {
    Scratch sc(G, D);
    for (int64_t item = begin; item < end; ++item) {
      const Range r = item_range(p, item);
      if (item == begin) prefetch_head<C>(p, r);
      if (item + 1 < end) prefetch_head<C>(p, item_range(p, item + 1));
      const int64_t b = r.b, g = r.g, t0 = r.t0, t1 = r.t1;
      for (int64_t h = 0; h < G; ++h) {
        const T* q_row = q + b * p.q_batch_stride + (g * G + h) * p.q_head_stride;
        for (int64_t d = 0; d < D; ++d) sc.q[h * D + d] = static_cast<float>(q_row[d]);
      }
      attend(p, b, g, t0, t1, sc, part_out.get() + item * G * D, part_lse.get() + item * G);
    }
  });

  T* out = static_cast<T*>(p.out);
  const T* k_new = static_cast<const T*>(p.k_new);
  const T* v_new = static_cast<const T*>(p.v_new);
  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(3 * D));
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / Hk, g = bg % Hk;
      const float *k_new_f = nullptr, *v_new_f = nullptr;
      if (k_new != nullptr) {
        k_new_f = row_as_float(k_new + b * p.k_new_batch_stride + g * p.k_new_head_stride,
                               buf.data() + D, D);
        v_new_f = row_as_float(v_new + b * p.v_new_batch_stride + g * p.v_new_head_stride,
                               buf.data() + 2 * D, D);
      }
      for (int64_t h = 0; h < G; ++h) {
        const int64_t hq = g * G + h;
        float* acc = part_out.get() + (bg * S * G + h) * D;  // split 0 collects the rest
        float lse = part_lse[bg * S * G + h];
        for (int64_t s = 1; s < S; ++s) {
          const int64_t i = (bg * S + s) * G + h;
          lse = merge_lse_rows(lse, acc, part_lse[i], part_out.get() + i * D, acc, D);
        }
        if (k_new != nullptr) {
          const float* q_f = row_as_float(q + b * p.q_batch_stride + hq * p.q_head_stride,
                                          buf.data(), D);
          const float lse_new = p.scale * dot(q_f, k_new_f, D);  // one key: lse = its score
          lse = merge_lse_rows(lse, acc, lse_new, v_new_f, acc, D);
        }
        store_row(out + b * p.out_batch_stride + hq * p.out_head_stride, acc, D);
        p.lse[b * Hq + hq] = lse;
      }
    }
  });
}

}  // namespace

void decode_attention(const DecodeAttentionParams& p) {
  TORCH_CHECK(p.num_splits >= 1, "stagewise.decode_attention: num_splits must be resolved to >= 1 "
              "before the CPU kernel, got ", p.num_splits);
  check_lengths_and_blocks(p);
  if (p.batch == 0 || p.num_q_heads == 0) return;
  dispatch_dtype_and_cache(p.dtype, p.cache_type, [&](auto t, auto c) {
    decode_attention_typed<decltype(t), decltype(c)>(p);
  });
}

// Splits only pay when the (batch x kv head) work items alone cannot keep every
// thread busy: aim for about two items per thread (slack for sequences of
// unequal length, since items are handed out in equal-count chunks), but keep
// each split at least kMinSplitBlocks blocks and kMinSplitTokens tokens, so
// short contexts get 1 and the per-split merge stays a small fraction of the
// work, and never more than kMaxSplits.
int decode_attention_num_splits(int64_t batch, int64_t num_kv_heads, int64_t max_context,
                                int64_t block_size, int num_threads) {
  const int64_t items = std::max<int64_t>(1, batch * num_kv_heads);
  const int64_t wanted = ceil_div(2 * std::max(1, num_threads), items);
  const int64_t min_split = std::max(kMinSplitBlocks * block_size, kMinSplitTokens);
  const int64_t by_length = std::max<int64_t>(1, max_context / min_split);
  return static_cast<int>(std::clamp<int64_t>(std::min(wanted, by_length), 1, kMaxSplits));
}

}  // namespace stagewise::cpu
