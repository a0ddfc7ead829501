// CPU token bitmask (include/stagewise/sampling.h): a word whose 32 tokens are all allowed is
// skipped, one with none allowed is a run of -inf, others go bit by bit. A grammar's mask is
// mostly zero words (JSON allows few tokens at each point), so this is about a memset of the
// disallowed part of each row.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>

#include "cpu/cpu_utils.h"
#include "stagewise/sampling.h"

namespace stagewise::cpu {
namespace {

template <typename D>
void bitmask_rows(const TokenBitmaskParams& p, int64_t begin, int64_t end) {
  using S = Storage<D>;
  const S ninf = from_float<D>(-std::numeric_limits<float>::infinity());
  const int64_t covered = std::min(p.vocab, p.num_words * 32);
  for (int64_t r = begin; r < end; ++r) {
    const int64_t row = load_index(p.rows, p.rows_type, r);
    TORCH_CHECK_VALUE(row >= 0 && row < p.batch, "stagewise.apply_token_bitmask: rows[", r, "] = ", row,
                      " is not a row of logits (batch ", p.batch, ")");
    S* out = static_cast<S*>(p.logits) + row * p.logits_row_stride;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(p.bitmask + r * p.num_words);
    for (int64_t j0 = 0; j0 < covered; j0 += 32) {
      const uint32_t w = words[j0 / 32];
      const int64_t n = std::min<int64_t>(32, covered - j0);
      if (w == 0xffffffffu) continue;
      if (w == 0) {
        std::fill(out + j0, out + j0 + n, ninf);
        continue;
      }
      for (int64_t b = 0; b < n; ++b) {
        if (!((w >> b) & 1u)) out[j0 + b] = ninf;
      }
    }
    std::fill(out + covered, out + p.vocab, ninf);
  }
}

}  // namespace

void apply_token_bitmask(const TokenBitmaskParams& p) {
  if (p.num_rows == 0 || p.vocab == 0) return;
  dispatch_dtype(p.dtype, [&](auto tag) {
    // A row is ~vocab / 32 words: rows are the tasks.
    at::parallel_for(0, p.num_rows, 1, [&](int64_t begin, int64_t end) {
      bitmask_rows<decltype(tag)>(p, begin, end);
    });
  });
}

}  // namespace stagewise::cpu
