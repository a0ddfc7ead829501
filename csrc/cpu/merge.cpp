// CPU merge of two partial attention results by their log-sum-exp
// (include/stagewise/attention.h); the maths is merge_lse_rows, shared with the
// split and new-token merges of decode_attention.
#include <ATen/Parallel.h>

#include <type_traits>
#include <vector>

#include "cpu/attention_rows.h"
#include "stagewise/attention.h"

namespace stagewise::cpu {
namespace {

// Rows [begin, end) of (token, head); buf holds 3 * head_dim floats.
template <typename T>
STAGEWISE_ALWAYS_INLINE void merge_rows(const MergeAttnStatesParams& p, int64_t begin,
                                        int64_t end, float* buf) {
  const int64_t H = p.num_heads, D = p.head_dim;
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  T* out = static_cast<T*>(p.out);
  for (int64_t r = begin; r < end; ++r) {
    const int64_t t = r / H, h = r % H;
    const float* a_f = row_as_float(a + t * p.a_token_stride + h * p.a_head_stride, buf, D);
    const float* b_f = row_as_float(b + t * p.b_token_stride + h * p.b_head_stride, buf + D, D);
    T* out_row = out + t * p.out_token_stride + h * p.out_head_stride;
    const float lse_a = p.lse_a[t * p.lse_a_token_stride + h * p.lse_a_head_stride];
    const float lse_b = p.lse_b[t * p.lse_b_token_stride + h * p.lse_b_head_stride];
    if constexpr (std::is_same_v<T, float>) {
      p.lse[r] = merge_lse_rows(lse_a, a_f, lse_b, b_f, out_row, D);
    } else {
      float* o_f = buf + 2 * D;
      p.lse[r] = merge_lse_rows(lse_a, a_f, lse_b, b_f, o_f, D);
      store_row(out_row, o_f, D);  // exact when o_f is a copy of a or b
    }
  }
}

using MergeRowsFn = void (*)(const MergeAttnStatesParams&, int64_t, int64_t, float*);

template <typename T>
void merge_rows_baseline(const MergeAttnStatesParams& p, int64_t begin, int64_t end, float* buf) {
  merge_rows<T>(p, begin, end, buf);
}

#ifdef STAGEWISE_HAVE_AVX2_PATH
template <typename T>
STAGEWISE_TARGET_AVX2 void merge_rows_avx2(const MergeAttnStatesParams& p, int64_t begin,
                                           int64_t end, float* buf) {
  merge_rows<T>(p, begin, end, buf);
}
#endif

template <typename T>
void merge_attn_states_typed(const MergeAttnStatesParams& p) {
  MergeRowsFn rows = &merge_rows_baseline<T>;
#ifdef STAGEWISE_HAVE_AVX2_PATH
  if (use_avx2_path()) rows = &merge_rows_avx2<T>;
#endif
  // Enough rows per task that a task is not all overhead.
  const int64_t grain = std::max<int64_t>(1, 16384 / p.head_dim);
  at::parallel_for(0, p.num_tokens * p.num_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(3 * p.head_dim));
    rows(p, begin, end, buf.data());
  });
}

}  // namespace

void merge_attn_states(const MergeAttnStatesParams& p) {
  if (p.num_tokens == 0 || p.num_heads == 0) return;
  dispatch_dtype(p.dtype, [&](auto tag) { merge_attn_states_typed<decltype(tag)>(p); });
}

}  // namespace stagewise::cpu
