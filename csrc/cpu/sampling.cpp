// CPU token bitmask (include/stagewise/sampling.h): a word whose 32 tokens are all allowed is
// skipped, one with none allowed is a run of -inf, others go bit by bit. A grammar's mask is
// mostly zero words (JSON allows few tokens at each point), so this is about a memset of the
// disallowed part of each row.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu/cpu_utils.h"
#include "stagewise/sampling.h"

namespace stagewise::cpu {
namespace {

// The storage's bits as an unsigned integer of its width.
template <typename D>
using Bits = std::conditional_t<sizeof(Storage<D>) == 4, uint32_t, uint16_t>;

// out[b] for b < n: kept where bit b of w is set, else ninf. Branch-free integer selects on a
// copy of the values, which the compiler turns into vector shifts and blends.
template <typename D>
STAGEWISE_ALWAYS_INLINE void select_word(Storage<D>* out, uint32_t w, Bits<D> ninf, int64_t n) {
  using U = Bits<D>;
  U v[32];
  std::memcpy(v, out, sizeof(U) * n);
  for (int64_t b = 0; b < n; ++b) {
    const U keep = static_cast<U>(U{0} - static_cast<U>((w >> b) & 1u));
    v[b] = static_cast<U>((v[b] & keep) | (ninf & static_cast<U>(~keep)));
  }
  std::memcpy(out, v, sizeof(U) * n);
}

template <typename D>
void bitmask_rows(const TokenBitmaskParams& p, int64_t begin, int64_t end) {
  using S = Storage<D>;
  const S ninf = from_float<D>(-std::numeric_limits<float>::infinity());
  Bits<D> ninf_bits;
  std::memcpy(&ninf_bits, &ninf, sizeof(S));
  const int64_t covered = std::min(p.vocab, p.num_words * 32);
  for (int64_t r = begin; r < end; ++r) {
    const int64_t row = load_index(p.rows, p.rows_type, r);
    S* out = static_cast<S*>(p.logits) + row * p.logits_row_stride;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(p.bitmask + r * p.num_words);
    int64_t j0 = 0;
    for (; j0 + 32 <= covered; j0 += 32) {
      const uint32_t w = words[j0 / 32];
      if (w == 0xffffffffu) continue;
      if (w == 0) {
        std::fill(out + j0, out + j0 + 32, ninf);
        continue;
      }
      select_word<D>(out + j0, w, ninf_bits, 32);
    }
    if (j0 < covered) select_word<D>(out + j0, words[j0 / 32], ninf_bits, covered - j0);
    std::fill(out + covered, out + p.vocab, ninf);
  }
}

}  // namespace

void apply_token_bitmask(const TokenBitmaskParams& p) {
  // Every row index checked before any is written: a refused call changes nothing.
  for (int64_t r = 0; r < p.num_rows; ++r) {
    const int64_t row = load_index(p.rows, p.rows_type, r);
    TORCH_CHECK_VALUE(row >= 0 && row < p.batch, "stagewise.apply_token_bitmask: rows[", r, "] = ", row,
                      " is not a row of logits (batch ", p.batch, ")");
  }
  if (p.num_rows == 0 || p.vocab == 0) return;
  dispatch_dtype(p.dtype, [&](auto tag) {
    // A row is ~vocab / 32 words: rows are the tasks.
    at::parallel_for(0, p.num_rows, 1, [&](int64_t begin, int64_t end) {
      bitmask_rows<decltype(tag)>(p, begin, end);
    });
  });
}

}  // namespace stagewise::cpu
