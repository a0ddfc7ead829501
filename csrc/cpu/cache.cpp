// Paged KV cache writes and the (context-parallel) slot mapping on the CPU.
// Both check every index in a first pass, so a bad call changes nothing.
#include "stagewise/cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

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

// The largest code of a compact cache's type: the scale maps a row's amax onto it (common.h).
template <typename C>
constexpr float kCodeMax = std::is_same_v<C, int8_t> ? 127.f : 448.f;

// Quantises one head row src[0..D) into codes dst and returns its scale, as common.h's CacheType
// says: the same bits whichever step, chunk or rank writes the row.
template <typename T, typename C>
c10::Half quantise_row(const Storage<T>* src, C* dst, int64_t D) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) {
    const float a = std::abs(to_float<T>(src[d]));
    amax = a > amax || std::isnan(a) ? a : amax;  // a NaN row keeps a NaN scale: its values read NaN
  }
  const c10::Half scale(std::min(amax / kCodeMax<C>, 65504.f));
  const float s = static_cast<float>(scale);
  if (!(s > 0.f)) {  // zero (or NaN): codes 0
    std::memset(dst, 0, D);
    return scale;
  }
  for (int64_t d = 0; d < D; ++d) {
    const float x = to_float<T>(src[d]) / s;
    if constexpr (std::is_same_v<C, int8_t>) {
      dst[d] = static_cast<int8_t>(std::clamp(std::nearbyint(x), -127.f, 127.f));
    } else {
      dst[d] = C(std::clamp(x, -448.f, 448.f));
    }
  }
  return scale;
}

// Quantises token t of src [num_tokens, num_heads, head_dim] into cache row `slot` of a compact
// cache, and its scales into scale[slot * num_heads + h].
template <typename T, typename C>
void quantise_token(const Storage<T>* src, int64_t token_stride, int64_t head_stride, C* cache, c10::Half* scale,
                    int64_t t, int64_t slot, const ReshapeAndCacheParams& p) {
  for (int64_t h = 0; h < p.num_heads; ++h) {
    const int64_t row = slot * p.num_heads + h;
    scale[row] = quantise_row<T>(src + t * token_stride + h * head_stride, cache + row * p.head_dim, p.head_dim);
  }
}

template <typename T, typename C>
void reshape_and_cache_compact(const ReshapeAndCacheParams& p) {
  const Storage<T>* k = static_cast<const Storage<T>*>(p.k);
  const Storage<T>* v = static_cast<const Storage<T>*>(p.v);
  C* k_cache = static_cast<C*>(p.k_cache);
  C* v_cache = static_cast<C*>(p.v_cache);
  c10::Half* k_scale = static_cast<c10::Half*>(p.k_scale);
  c10::Half* v_scale = static_cast<c10::Half*>(p.v_scale);
  at::parallel_for(0, p.num_tokens, grain_for(8 * p.num_heads * p.head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = load_index(p.slot_mapping, p.slot_type, t);
      if (slot == kPaddingSlot) continue;
      quantise_token<T>(k, p.k_token_stride, p.k_head_stride, k_cache, k_scale, t, slot, p);
      quantise_token<T>(v, p.v_token_stride, p.v_head_stride, v_cache, v_scale, t, slot, p);
    }
  });
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
  if (p.cache_type != CacheType::kModel) {
    return dispatch_dtype(p.dtype, [&](auto tag) {
      using T = decltype(tag);
      if (p.cache_type == CacheType::kInt8) {
        reshape_and_cache_compact<T, int8_t>(p);
      } else {
        reshape_and_cache_compact<T, c10::Float8_e4m3fn>(p);
      }
    });
  }
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
