// Flash-decoding over a paged KV cache, and the log-sum-exp merge of partial
// attention results (attention in two parts, the cached context and the new tokens, merged).
//
// For sequence b and query head h (kv head g = h / (num_q_heads / num_kv_heads)):
//   keys = the first seq_lens[b] cached tokens of b (token t lives in block
//          block_tables[b][t / block_size], offset t % block_size), then k_new[b]
//          when k_new is given; with window > 0 only the last `window` of them
//          (the query is the newest token: k_new when given, else the last cached
//          one, so it sees itself and window - 1 tokens before it; a sliding
//          window). Cached tokens before the window are never read, nor are their
//          block-table entries (a freed block may be marked -1 there);
//   s_t  = scale * dot(q[b,h], key_t[g])        (float32)
//   lse[b,h] = log(sum_t exp(s_t))                (natural log; -inf if no keys)
//   out[b,h] = sum_t softmax(s)_t * value_t[g]    (0 if no keys), rounded to dtype.
// A compact cache (cache_type int8 or fp8_e4m3) holds codes and a float16 scale per token and
// kv head: key_t = float(code) * k_scale[slot], read and scaled in registers (the scale of a
// key multiplies its score, that of a value its softmax weight); nothing is dequantised into
// memory. k_new/v_new stay in the activations' dtype.
// The cached context is cut into num_splits chunks computed independently and
// merged by LSE; the new token is a further part merged the same way.
#pragma once
#include <cstddef>
#include "stagewise/common.h"

namespace stagewise {

struct DecodeAttentionParams {
  void* out;               // [batch, num_q_heads, head_dim], last dim contiguous
  int64_t out_batch_stride;
  int64_t out_head_stride;
  float* lse;              // [batch, num_q_heads] contiguous
  const void* q;           // [batch, num_q_heads, head_dim], last dim contiguous
  int64_t q_batch_stride;
  int64_t q_head_stride;
  const void* k_cache;     // [num_blocks, block_size, num_kv_heads, head_dim] contiguous
  const void* v_cache;     // same shape as k_cache
  CacheType cache_type;    // kModel: the caches hold dtype; else one-byte codes with scales
  const void* k_scale;     // compact caches: [num_blocks, block_size, num_kv_heads] float16; else null
  const void* v_scale;
  const void* block_tables;  // [batch, max_blocks_per_seq], row stride block_table_row_stride
  IndexType block_table_type;
  int64_t block_table_row_stride;
  int64_t max_blocks_per_seq;
  const void* seq_lens;    // [batch] cached tokens per sequence
  IndexType seq_lens_type;
  const void* k_new;       // [batch, num_kv_heads, head_dim] or null (then v_new is null too)
  int64_t k_new_batch_stride;
  int64_t k_new_head_stride;
  const void* v_new;       // [batch, num_kv_heads, head_dim] or null
  int64_t v_new_batch_stride;
  int64_t v_new_head_stride;
  DType dtype;             // of out, q, k_new, v_new (and the caches when cache_type is kModel)
  int64_t batch;
  int64_t num_q_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t block_size;
  int64_t num_blocks;
  float scale;
  int num_splits;          // >= 1, resolved by the glue (0 is never passed to a kernel)
  int64_t window;          // > 0: keys a query attends to at most (sliding window); 0: all
  float* workspace;        // device kernels only: decode_attention_workspace_floats() floats
};

// The first cached token a sequence's query attends to: the window's first key,
// counting the new token (when given) as the newest; 0 without a window.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline int64_t window_first_token(int64_t seq_len, bool has_new, int64_t window) {
  if (window <= 0) return 0;
  const int64_t first = seq_len + (has_new ? 1 : 0) - window;
  return first > 0 ? first : 0;
}

// Attention of runs of new tokens over a paged cache that already holds them: a prompt's chunk
// after its request's cached tokens (a later chunk, a prefix-cache hit), the drafts a row verifies,
// a prompt from its first token. Sequence b's run is the q rows [query_start_loc[b],
// query_start_loc[b + 1]) (n_b tokens), the last n_b of its seq_lens[b] cached tokens; its token i,
// at position pos = seq_lens[b] - n_b + i, attends over the cached tokens [first, pos] (first =
// max(0, pos - window + 1) with window > 0, else 0): causal, a sliding window's keys only. Scores,
// softmax and a compact cache's codes as decode_attention's; out[t, h] rounded to dtype.
struct ExtendAttentionParams {
  void* out;               // [num_tokens, num_q_heads, head_dim], last dim contiguous
  int64_t out_token_stride;
  int64_t out_head_stride;
  const void* q;           // [num_tokens, num_q_heads, head_dim], last dim contiguous
  int64_t q_token_stride;
  int64_t q_head_stride;
  const void* k_cache;     // [num_blocks, block_size, num_kv_heads, head_dim] contiguous
  const void* v_cache;
  CacheType cache_type;
  const void* k_scale;     // compact caches: [num_blocks, block_size, num_kv_heads] float16; else null
  const void* v_scale;
  const void* block_tables;  // [num_seqs, max_blocks_per_seq], row stride block_table_row_stride
  IndexType block_table_type;
  int64_t block_table_row_stride;
  int64_t max_blocks_per_seq;
  const void* query_start_loc;  // [num_seqs + 1]: 0, then each run's end row, ending at num_tokens
  IndexType query_start_loc_type;
  const void* seq_lens;    // [num_seqs] cached tokens per sequence, its run included
  IndexType seq_lens_type;
  DType dtype;             // of out and q (and the caches when cache_type is kModel)
  int64_t num_seqs;
  int64_t num_tokens;
  int64_t num_q_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t block_size;
  int64_t num_blocks;
  float scale;
  int64_t window;          // > 0: keys a query attends to at most, itself included; 0: all before it
};

struct MergeAttnStatesParams {
  void* out;               // [num_tokens, num_heads, head_dim], last dim contiguous
  int64_t out_token_stride;
  int64_t out_head_stride;
  float* lse;              // [num_tokens, num_heads] contiguous
  const void* a;           // [num_tokens, num_heads, head_dim]
  int64_t a_token_stride;
  int64_t a_head_stride;
  const float* lse_a;      // [num_tokens, num_heads], any strides
  int64_t lse_a_token_stride;
  int64_t lse_a_head_stride;
  const void* b;
  int64_t b_token_stride;
  int64_t b_head_stride;
  const float* lse_b;
  int64_t lse_b_token_stride;
  int64_t lse_b_head_stride;
  DType dtype;             // of out, a and b
  int64_t num_tokens;
  int64_t num_heads;
  int64_t head_dim;
};

namespace cpu {
// Raises c10::IndexError before computing anything when a block id needed by a
// sequence (in its window) is outside [0, num_blocks) or seq_lens[b] exceeds the
// block table.
void decode_attention(const DecodeAttentionParams& p);
void merge_attn_states(const MergeAttnStatesParams& p);
// Raises before computing anything when the runs, lengths or block ids (in each query's window)
// are out of range.
void extend_attention(const ExtendAttentionParams& p);
// Heuristic split count: enough (batch x kv head x split) work items for the
// thread pool, never more than the context (the window, when there is one) has
// blocks.
int decode_attention_num_splits(int64_t batch, int64_t num_kv_heads, int64_t max_context,
                                int64_t block_size, int num_threads);
}  // namespace cpu

#ifdef STAGEWISE_HAS_CUDA_DECLS
namespace cuda {
int decode_attention_num_splits(int64_t batch, int64_t num_kv_heads, int64_t max_context,
                                int64_t block_size, int num_sms);
size_t decode_attention_workspace_floats(int64_t batch, int64_t num_q_heads, int64_t head_dim,
                                         int num_splits);
// Out-of-range block ids and lengths are clamped/skipped on the GPU (no host sync).
cudaError_t decode_attention(const DecodeAttentionParams& p, cudaStream_t stream);
cudaError_t merge_attn_states(const MergeAttnStatesParams& p, cudaStream_t stream);
}  // namespace cuda
#endif

}  // namespace stagewise
