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

template <typename T>
void merge_attn_states_typed(const MergeAttnStatesParams& p) {
  const int64_t H = p.num_heads, D = p.head_dim;
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  T* out = static_cast<T*>(p.out);
  // Rows of (token, head); enough rows per task that a task is not all overhead.
  const int64_t grain = std::max<int64_t>(1, 4096 / D);
  at::parallel_for(0, p.num_tokens * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(3 * D));
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / H, h = r % H;
      const float* a_f = row_as_float(a + t * p.a_token_stride + h * p.a_head_stride, buf.data(), D);
      const float* b_f =
          row_as_float(b + t * p.b_token_stride + h * p.b_head_stride, buf.data() + D, D);
      T* out_row = out + t * p.out_token_stride + h * p.out_head_stride;
      if constexpr (std::is_same_v<T, float>) {
        p.lse[r] = merge_lse_rows(p.lse_a[r], a_f, p.lse_b[r], b_f, out_row, D);
      } else {
        float* o_f = buf.data() + 2 * D;
        p.lse[r] = merge_lse_rows(p.lse_a[r], a_f, p.lse_b[r], b_f, o_f, D);
        store_row(out_row, o_f, D);  // exact when o_f is a copy of a or b
      }
    }
  });
}

}  // namespace

void merge_attn_states(const MergeAttnStatesParams& p) {
  if (p.num_tokens == 0 || p.num_heads == 0) return;
  dispatch_dtype(p.dtype, [&](auto tag) { merge_attn_states_typed<decltype(tag)>(p); });
}

}  // namespace stagewise::cpu
