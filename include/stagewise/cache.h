// Paged KV cache writes and slot mapping.
//
// Cache layout: [num_blocks, block_size, num_heads, head_dim], contiguous;
// slot = block * block_size + offset_in_block. Slot -1 (kPaddingSlot) = skip.
// A compact cache (CacheType int8 or fp8_e4m3, common.h) holds one-byte codes in that layout and
// a float16 scale per token and head beside it, [num_blocks, block_size, num_heads] contiguous:
// the write quantises each token's head row by itself (common.h has the formula).
//
// Slot mapping with context parallelism (KV sharded along the sequence): with
// cp = cp_world_size and I = interleave_size, a virtual block spans
// block_size * cp tokens. For position x:
//   vblock = x / (block_size*cp);  off = x % (block_size*cp)
//   local_block = off / I;  owner = local_block % cp
//   local_off = (local_block / cp) * I + off % I
//   slot = block_tables[seq][vblock] * block_size + local_off   if owner == cp_rank, else -1
// With cp == 1 this is the usual paged slot. A negative position maps to -1.
// Requires block_size % I == 0.
#pragma once
#include "stagewise/common.h"

namespace stagewise {

struct ReshapeAndCacheParams {
  const void* k;           // [num_tokens, num_heads, head_dim], last dim contiguous
  int64_t k_token_stride;
  int64_t k_head_stride;
  const void* v;           // [num_tokens, num_heads, head_dim]
  int64_t v_token_stride;
  int64_t v_head_stride;
  void* k_cache;           // [num_blocks, block_size, num_heads, head_dim] contiguous
  void* v_cache;           // same shape as k_cache
  const void* slot_mapping;  // [num_tokens]
  IndexType slot_type;
  DType dtype;             // of k and v (and of the caches when cache_type is kModel)
  CacheType cache_type;
  void* k_scale;           // compact caches: [num_blocks, block_size, num_heads] float16; else null
  void* v_scale;
  int64_t num_tokens;
  int64_t num_heads;
  int64_t head_dim;
  int64_t num_slots;       // num_blocks * block_size; a slot >= num_slots is out of range
};

struct SlotMappingParams {
  int64_t* out;            // [num_tokens] contiguous
  const void* block_tables;  // [num_seqs, max_blocks], row stride block_table_row_stride
  IndexType block_table_type;
  int64_t block_table_row_stride;
  int64_t num_seqs;
  int64_t max_blocks;
  const void* seq_index;   // [num_tokens] row of block_tables of each token
  IndexType seq_index_type;
  const void* positions;   // [num_tokens]
  IndexType position_type;
  int64_t num_tokens;
  int64_t block_size;
  int64_t cp_world_size;
  int64_t cp_rank;
  int64_t interleave_size;
};

namespace cpu {
// Both raise c10::IndexError (before writing anything) on an out-of-range index.
void reshape_and_cache(const ReshapeAndCacheParams& p);
void slot_mapping(const SlotMappingParams& p);
}  // namespace cpu

#ifdef STAGEWISE_HAS_CUDA_DECLS
namespace cuda {
// Out-of-range indices are skipped on the GPU (slot -> nothing written,
// block/seq index -> slot -1): raising would need a host sync.
cudaError_t reshape_and_cache(const ReshapeAndCacheParams& p, cudaStream_t stream);
cudaError_t slot_mapping(const SlotMappingParams& p, cudaStream_t stream);
}  // namespace cuda
#endif

}  // namespace stagewise
