// Paged KV cache writes and the (context-parallel) slot mapping on the CPU.
// Both check every index in a first pass, so a bad call changes nothing.
#include "stagewise/cache.h"

#include <cstring>

#include <ATen/Parallel.h>

#include "cpu/cpu_utils.h"

namespace stagewise::cpu {
namespace {

// Copies token t of src [num_tokens, num_heads, head_dim] into cache row `slot`
// ([num_heads, head_dim] contiguous). Strides in elements, sizes in bytes.
inline void copy_token(const char* src, int64_t token_stride, int64_t head_stride, char* cache,
                       int64_t t, int64_t slot, const ReshapeAndCacheParams& p, int64_t elem) {
  const int64_t head_bytes = p.head_dim * elem;
  const char* from = src + t * token_stride * elem;
  char* to = cache + slot * p.num_heads * head_bytes;
  if (head_stride == p.head_dim) {
    std::memcpy(to, from, p.num_heads * head_bytes);
    return;
  }
  for (int64_t h = 0; h < p.num_heads; ++h) {
    std::memcpy(to + h * head_bytes, from + h * head_stride * elem, head_bytes);
  }
}

// Where position pos (>= 0) lives under the context-parallel interleaved layout (cache.h).
struct Placement {
  int64_t vblock;     // column of block_tables
  int64_t local_off;  // offset inside this rank's block
  bool owned;         // whether p.cp_rank stores it
};

inline Placement place(int64_t pos, const SlotMappingParams& p) {
  const int64_t cp = p.cp_world_size, interleave = p.interleave_size;
  const int64_t virtual_block_size = p.block_size * cp;
  const int64_t off = pos % virtual_block_size;
  const int64_t local_block = off / interleave;
  return {pos / virtual_block_size, (local_block / cp) * interleave + off % interleave,
          local_block % cp == p.cp_rank};
}

inline int64_t block_id(const SlotMappingParams& p, int64_t seq, int64_t vblock) {
  return load_index(p.block_tables, p.block_table_type, seq * p.block_table_row_stride + vblock);
}

// Raises c10::IndexError for the first token whose seq_index, position or
// (owned) block id is out of range.
void check_slot_mapping_indices(const SlotMappingParams& p) {
  const int64_t virtual_block_size = p.block_size * p.cp_world_size;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t seq = load_index(p.seq_index, p.seq_index_type, t);
    TORCH_CHECK_INDEX(seq >= 0 && seq < p.num_seqs, "stagewise.slot_mapping: seq_index[", t, "] = ", seq,
                      " is out of range [0, ", p.num_seqs, ") (rows of block_tables)");
    const int64_t pos = load_index(p.positions, p.position_type, t);
    if (pos < 0) continue;  // padding token
    const Placement at = place(pos, p);
    TORCH_CHECK_INDEX(at.vblock < p.max_blocks, "stagewise.slot_mapping: positions[", t, "] = ", pos,
                      " is out of range [0, ", p.max_blocks * virtual_block_size, ") of block_tables (",
                      p.max_blocks, " blocks of block_size ", p.block_size, " x cp_world_size ",
                      p.cp_world_size, " positions; a negative position is padding)");
    if (!at.owned) continue;
    const int64_t block = block_id(p, seq, at.vblock);
    TORCH_CHECK_INDEX(block >= 0, "stagewise.slot_mapping: block_tables[", seq, ", ", at.vblock,
                      "] = ", block, " is out of range [0, inf): it holds positions[", t, "] = ", pos,
                      " of seq_index[", t, "] = ", seq, ", stored by cp_rank ", p.cp_rank);
  }
}

}  // namespace

void reshape_and_cache(const ReshapeAndCacheParams& p) {
  check_indices_in_range("reshape_and_cache", "slot_mapping", p.slot_mapping, p.slot_type,
                         p.num_tokens, kPaddingSlot, p.num_slots, " (-1 = padding)");
  const int64_t elem = dtype_size(p.dtype);
  const char* k = static_cast<const char*>(p.k);
  const char* v = static_cast<const char*>(p.v);
  char* k_cache = static_cast<char*>(p.k_cache);
  char* v_cache = static_cast<char*>(p.v_cache);
  at::parallel_for(0, p.num_tokens, grain_for(2 * p.num_heads * p.head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = load_index(p.slot_mapping, p.slot_type, t);
      if (slot == kPaddingSlot) continue;  // padding token: nothing to write
      copy_token(k, p.k_token_stride, p.k_head_stride, k_cache, t, slot, p, elem);
      copy_token(v, p.v_token_stride, p.v_head_stride, v_cache, t, slot, p, elem);
    }
  });
}

void slot_mapping(const SlotMappingParams& p) {
  check_slot_mapping_indices(p);
  at::parallel_for(0, p.num_tokens, grain_for(64), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t pos = load_index(p.positions, p.position_type, t);
      int64_t slot = kPaddingSlot;
      if (pos >= 0) {
        const Placement at = place(pos, p);
        if (at.owned) {
          const int64_t seq = load_index(p.seq_index, p.seq_index_type, t);
          slot = block_id(p, seq, at.vblock) * p.block_size + at.local_off;
        }
      }
      p.out[t] = slot;
    }
  });
}

}  // namespace stagewise::cpu
