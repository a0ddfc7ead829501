// Structured output's token bitmask applied to the logits, in place.
//
// For each r < num_rows, row rows[r] of logits keeps token j (j < vocab) when bit j % 32 of
// bitmask[r][j / 32] is set (the bitmask llguidance and xgrammar compute: 32 tokens to an
// int32 word, little-endian bit order); every other token becomes -inf. Tokens past the
// mask's num_words * 32 are disallowed; words past the vocabulary are not read.
#pragma once
#include "stagewise/common.h"

namespace stagewise {

struct TokenBitmaskParams {
  void* logits;            // [batch, vocab], row stride logits_row_stride, last dim contiguous
  int64_t logits_row_stride;
  const int32_t* bitmask;  // [num_rows, num_words] contiguous
  const void* rows;        // [num_rows] indices into logits' rows
  IndexType rows_type;
  DType dtype;             // of logits
  int64_t batch;
  int64_t vocab;
  int64_t num_rows;
  int64_t num_words;
};

namespace cpu {
void apply_token_bitmask(const TokenBitmaskParams& p);
}  // namespace cpu

#ifdef STAGEWISE_HAS_CUDA_DECLS
namespace cuda {
// A row index outside [0, batch) is skipped (the CPU kernel refuses it: the glue cannot
// read device indices without a sync).
cudaError_t apply_token_bitmask(const TokenBitmaskParams& p, cudaStream_t stream);
}  // namespace cuda
#endif

}  // namespace stagewise
