#include "bindings/params.h"

#include "cpu/quant_pack.h"

#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace stagewise::glue {
namespace {

// Python's names for dtypes, so messages read as the user's code does.
const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kDouble: return "float64";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    case at::kFloat8_e4m3fn: return "float8_e4m3fn";
    default: return c10::toString(t);
  }
}

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

DType float_dtype(const char* op, const char* name, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, "stagewise.", op, ": argument '", name,
                       "' must be float32, float16 or bfloat16, got ", dtype_name(t.scalar_type()));
  }
  return DType::kFloat32;
}

IndexType index_dtype(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "stagewise.", op,
                   ": argument '", name, "' must be int32 or int64, got ", dtype_name(t.scalar_type()));
  return t.scalar_type() == at::kInt ? IndexType::kInt32 : IndexType::kInt64;
}

void check_dtype_is(const char* op, const char* name, const at::Tensor& t, at::ScalarType want,
                    const char* why) {
  TORCH_CHECK_TYPE(t.scalar_type() == want, "stagewise.", op, ": argument '", name, "' must be ",
                   dtype_name(want), " (", why, "), got ", dtype_name(t.scalar_type()));
}

void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim,
               const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == dim, "stagewise.", op, ": argument '", name, "' must have ", dim,
                    " dims ", layout, ", got ", t.dim(), " dims with shape ", shape_of(t));
}

void check_size(const char* op, const char* name, const at::Tensor& t, int64_t d, int64_t want,
                const char* what) {
  TORCH_CHECK_VALUE(t.size(d) == want, "stagewise.", op, ": argument '", name, "' dim ", d, " (",
                    what, ") must be ", want, ", got ", t.size(d), " (shape ", shape_of(t), ")");
}

void check_same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), "stagewise.", op, ": argument '", name,
                    "' must be on the device of '", ref_name, "' (", ref.device(), "), got ",
                    t.device());
}

void check_same_dtype(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                      const at::Tensor& ref) {
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), "stagewise.", op, ": argument '", name,
                   "' must have the dtype of '", ref_name, "' (", dtype_name(ref.scalar_type()),
                   "), got ", dtype_name(t.scalar_type()));
}

void check_last_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1, "stagewise.", op,
                    ": argument '", name, "' must have a contiguous last dim (stride 1), got strides ",
                    t.strides());
}

void check_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.is_contiguous(), "stagewise.", op, ": argument '", name,
                    "' must be contiguous, got shape ", shape_of(t), " with strides ", t.strides());
}

// A 1-d index tensor of n elements; `what` names its one dim, e.g. "num_tokens, as in q".
void check_index_vector(const char* op, const char* name, const at::Tensor& t, int64_t n,
                        const char* layout, const char* what, const at::Tensor& ref,
                        const char* ref_name) {
  check_dim(op, name, t, 1, layout);
  check_size(op, name, t, 0, n, what);
  check_contiguous(op, name, t);
  check_same_device(op, name, t, ref_name, ref);
}

// Rows of a tensor whose leading dims collapse into one strided row dim.
struct Rows {
  int64_t rows;
  int64_t stride;
};

Rows rows_of(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.dim() >= 1, "stagewise.", op, ": argument '", name,
                    "' must have at least 1 dim [..., hidden], got a scalar");
  check_last_contiguous(op, name, t);
  const int64_t hidden = t.size(-1);
  if (t.numel() == 0) return {t.dim() == 1 ? 1 : 0, hidden};  // nothing to read or write
  // Walk the leading dims inwards-out: each non-trivial dim must step over
  // exactly the rows inside it, so all of them collapse into one strided dim.
  int64_t rows = 1, stride = hidden, inner_rows = 1;
  bool have_stride = false;
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    rows *= t.size(d);
    if (t.size(d) == 1) continue;
    if (!have_stride) {
      stride = t.stride(d);
      have_stride = true;
    } else {
      TORCH_CHECK_VALUE(t.stride(d) == stride * inner_rows, "stagewise.", op, ": argument '", name,
                        "' must have leading dims that collapse into one strided row dim, got shape ",
                        shape_of(t), " with strides ", t.strides());
    }
    inner_rows *= t.size(d);
  }
  return {rows, stride};
}

void check_float_like(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                      const at::Tensor& ref) {
  check_same_device(op, name, t, ref_name, ref);
  check_same_dtype(op, name, t, ref_name, ref);
}

// The paged caches k_cache and v_cache (already checked to share one shape) against the activations
// `ref`: of ref's dtype, without scales; or compact (int8 or float8_e4m3fn codes, common.h's
// CacheType) with their float16 scales [num_blocks, block_size, heads], contiguous, on their device.
struct CacheArgs {
  CacheType type;
  void* k_scale;
  void* v_scale;
};

CacheArgs check_caches(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache, const char* ref_name,
                       const at::Tensor& ref, const std::optional<at::Tensor>& k_scale,
                       const std::optional<at::Tensor>& v_scale) {
  const at::ScalarType t = k_cache.scalar_type();
  const bool compact = t == at::kChar || t == at::kFloat8_e4m3fn;
  CacheArgs a{t == at::kChar ? CacheType::kInt8 : compact ? CacheType::kFp8E4M3 : CacheType::kModel, nullptr, nullptr};
  for (auto [name, c] : {std::pair<const char*, const at::Tensor*>{"k_cache", &k_cache}, {"v_cache", &v_cache}}) {
    if (compact) {
      check_same_device(op, name, *c, ref_name, ref);
      check_same_dtype(op, name, *c, "k_cache", k_cache);
    } else {
      const at::ScalarType ct = c->scalar_type();
      TORCH_CHECK_TYPE(ct == at::kFloat || ct == at::kHalf || ct == at::kBFloat16 || ct == ref.scalar_type(),
                       "stagewise.", op, ": argument '", name, "' must have the dtype of '", ref_name, "' (",
                       dtype_name(ref.scalar_type()), "), or be a compact cache (int8 or float8_e4m3fn, with "
                       "k_scale and v_scale), got ", dtype_name(ct));
      check_float_like(op, name, *c, ref_name, ref);
    }
  }
  if (!compact) {
    TORCH_CHECK_VALUE(!k_scale.has_value() && !v_scale.has_value(), "stagewise.", op,
                      ": arguments 'k_scale' and 'v_scale' belong to a compact cache (int8 or float8_e4m3fn); "
                      "k_cache is ", dtype_name(t));
    return a;
  }
  TORCH_CHECK_VALUE(k_scale.has_value() && v_scale.has_value(), "stagewise.", op, ": a compact cache (k_cache ",
                    dtype_name(t), ") needs both 'k_scale' and 'v_scale' [num_blocks, block_size, heads] float16, got ",
                    k_scale.has_value() ? "k_scale only" : v_scale.has_value() ? "v_scale only" : "neither");
  for (auto [name, s] : {std::pair<const char*, const at::Tensor*>{"k_scale", &*k_scale}, {"v_scale", &*v_scale}}) {
    check_dtype_is(op, name, *s, at::kHalf, "a compact cache's scales");
    check_dim(op, name, *s, 3, "[num_blocks, block_size, heads]");
    for (int64_t d = 0; d < 3; ++d) check_size(op, name, *s, d, k_cache.size(d), "as in k_cache");
    check_contiguous(op, name, *s);
    check_same_device(op, name, *s, "k_cache", k_cache);
  }
  a.k_scale = k_scale->data_ptr();
  a.v_scale = v_scale->data_ptr();
  return a;
}

// The query and paged caches of an attention op (decode_attention, extend_attention): q
// [rows, Hq, D], caches [num_blocks, block_size, Hk, D] of q's dtype or compact with their scales.
struct PagedQuery {
  DType dtype;
  int64_t rows, num_q_heads, num_kv_heads, head_dim;
  CacheArgs cache;
};

PagedQuery check_paged_query(const char* op, const char* q_layout, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const std::optional<at::Tensor>& k_scale,
                             const std::optional<at::Tensor>& v_scale) {
  PagedQuery a{};
  a.dtype = float_dtype(op, "q", q);
  check_dim(op, "q", q, 3, q_layout);
  check_last_contiguous(op, "q", q);
  a.rows = q.size(0), a.num_q_heads = q.size(1), a.head_dim = q.size(2);
  TORCH_CHECK_VALUE(a.head_dim >= 1, "stagewise.", op, ": argument 'q' dim 2 (head_dim) must be >= 1, got ",
                    a.head_dim, " (shape ", shape_of(q), ")");
  for (auto [name, c] : {std::pair<const char*, const at::Tensor*>{"k_cache", &k_cache}, {"v_cache", &v_cache}}) {
    check_dim(op, name, *c, 4, "[num_blocks, block_size, num_kv_heads, head_dim]");
    check_size(op, name, *c, 3, a.head_dim, "head_dim, as in q");
    check_contiguous(op, name, *c);
  }
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "stagewise.", op, ": argument 'v_cache' must have the shape "
                    "of 'k_cache' ", shape_of(k_cache), ", got ", shape_of(v_cache));
  a.cache = check_caches(op, k_cache, v_cache, "q", q, k_scale, v_scale);
  a.num_kv_heads = k_cache.size(2);
  TORCH_CHECK_VALUE(a.num_kv_heads >= 1 && a.num_q_heads % a.num_kv_heads == 0, "stagewise.", op,
                    ": num_q_heads (q dim 1) = ", a.num_q_heads, " must be a multiple of num_kv_heads (k_cache dim 2) = ",
                    a.num_kv_heads);
  TORCH_CHECK_VALUE(k_cache.size(1) >= 1, "stagewise.", op, ": argument 'k_cache' dim 1 (block_size) must be >= 1, "
                    "got ", k_cache.size(1), " (shape ", shape_of(k_cache), ")");
  return a;
}


// The fields DecodeAttentionParams and ExtendAttentionParams share, named alike: the query's dtype,
// the paged cache and its table, seq_lens, and the scores' scale and window (the index types are set
// by the checks that read them).
template <typename P>
void set_paged_cache(P& p, const PagedQuery& pq, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window) {
  p.dtype = pq.dtype;
  p.cache_type = pq.cache.type;
  p.k_scale = pq.cache.k_scale;
  p.v_scale = pq.cache.v_scale;
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.block_tables = block_tables.data_ptr();
  p.block_table_row_stride = block_tables.stride(0);
  p.max_blocks_per_seq = block_tables.size(1);
  p.seq_lens = seq_lens.data_ptr();
  p.num_q_heads = pq.num_q_heads;
  p.num_kv_heads = pq.num_kv_heads;
  p.head_dim = pq.head_dim;
  p.block_size = k_cache.size(1);
  p.num_blocks = k_cache.size(0);
  p.scale = static_cast<float>(scale);
  p.window = window;
}

}  // namespace

RmsNormParams make_rms_norm_params(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                                   double eps, bool unit_offset) {
  const char* op = "rms_norm";
  RmsNormParams p{};
  p.dtype = float_dtype(op, "x", x);
  const Rows xr = rows_of(op, "x", x);
  const int64_t hidden = x.size(-1);
  TORCH_CHECK_VALUE(hidden >= 1, "stagewise.rms_norm: argument 'x' must have a non-empty last dim (hidden >= 1), got shape ",
                    shape_of(x));
  check_float_like(op, "out", out, "x", x);
  TORCH_CHECK_VALUE(out.sizes() == x.sizes(), "stagewise.rms_norm: argument 'out' must have the shape of 'x' ",
                    shape_of(x), ", got ", shape_of(out));
  const Rows outr = rows_of(op, "out", out);
  check_float_like(op, "weight", weight, "x", x);
  check_dim(op, "weight", weight, 1, "[hidden]");
  check_size(op, "weight", weight, 0, hidden, "hidden");
  check_contiguous(op, "weight", weight);
  p.out = out.data_ptr();
  p.out_row_stride = outr.stride;
  p.x = x.data_ptr();
  p.x_row_stride = xr.stride;
  p.weight = weight.data_ptr();
  p.rows = xr.rows;
  p.hidden = hidden;
  p.eps = static_cast<float>(eps);
  p.unit_offset = unit_offset;
  return p;
}

FusedAddRmsNormParams make_fused_add_rms_norm_params(at::Tensor& x, at::Tensor& residual,
                                                     const at::Tensor& weight, double eps,
                                                     bool unit_offset) {
  const char* op = "fused_add_rms_norm";
  FusedAddRmsNormParams p{};
  p.dtype = float_dtype(op, "x", x);
  const Rows xr = rows_of(op, "x", x);
  const int64_t hidden = x.size(-1);
  TORCH_CHECK_VALUE(hidden >= 1, "stagewise.fused_add_rms_norm: argument 'x' must have a non-empty last dim (hidden >= 1), got shape ",
                    shape_of(x));
  check_float_like(op, "residual", residual, "x", x);
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes(), "stagewise.fused_add_rms_norm: argument 'residual' must have the shape of 'x' ",
                    shape_of(x), ", got ", shape_of(residual));
  const Rows rr = rows_of(op, "residual", residual);
  check_float_like(op, "weight", weight, "x", x);
  check_dim(op, "weight", weight, 1, "[hidden]");
  check_size(op, "weight", weight, 0, hidden, "hidden");
  check_contiguous(op, "weight", weight);
  p.x = x.data_ptr();
  p.x_row_stride = xr.stride;
  p.residual = residual.data_ptr();
  p.residual_row_stride = rr.stride;
  p.weight = weight.data_ptr();
  p.rows = xr.rows;
  p.hidden = hidden;
  p.eps = static_cast<float>(eps);
  p.unit_offset = unit_offset;
  return p;
}

RopeParams make_rope_params(const char* op, at::Tensor& q, at::Tensor& k,
                            const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                            bool is_neox) {
  RopeParams p{};
  p.dtype = float_dtype(op, "q", q);
  check_dim(op, "q", q, 3, "[num_tokens, num_q_heads, head_dim]");
  check_last_contiguous(op, "q", q);
  check_float_like(op, "k", k, "q", q);
  check_dim(op, "k", k, 3, "[num_tokens, num_k_heads, head_dim]");
  check_size(op, "k", k, 0, q.size(0), "num_tokens, as in q");
  check_size(op, "k", k, 2, q.size(2), "head_dim, as in q");
  check_last_contiguous(op, "k", k);
  p.position_type = index_dtype(op, "positions", positions);
  check_index_vector(op, "positions", positions, q.size(0), "[num_tokens]", "num_tokens, as in q", q, "q");
  p.cache_dtype = float_dtype(op, "cos_sin_cache", cos_sin_cache);
  TORCH_CHECK_TYPE(p.cache_dtype == DType::kFloat32 || p.cache_dtype == p.dtype, "stagewise.", op,
                   ": argument 'cos_sin_cache' must be float32 or the dtype of 'q' (",
                   dtype_name(q.scalar_type()), "), got ", dtype_name(cos_sin_cache.scalar_type()));
  check_same_device(op, "cos_sin_cache", cos_sin_cache, "q", q);
  check_dim(op, "cos_sin_cache", cos_sin_cache, 2, "[max_position, rotary_dim]");
  check_contiguous(op, "cos_sin_cache", cos_sin_cache);
  const int64_t rotary_dim = cos_sin_cache.size(1);
  TORCH_CHECK_VALUE(rotary_dim >= 2 && rotary_dim % 2 == 0 && rotary_dim <= q.size(2), "stagewise.",
                    op, ": argument 'cos_sin_cache' dim 1 (rotary_dim) must be even and in [2, head_dim=",
                    q.size(2), "], got ", rotary_dim);
  p.q = q.data_ptr();
  p.q_token_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.k = k.data_ptr();
  p.k_token_stride = k.stride(0);
  p.k_head_stride = k.stride(1);
  p.positions = positions.data_ptr();
  p.cos_sin_cache = cos_sin_cache.data_ptr();
  p.max_position = cos_sin_cache.size(0);
  p.num_tokens = q.size(0);
  p.num_q_heads = q.size(1);
  p.num_k_heads = k.size(1);
  p.head_dim = q.size(2);
  p.rotary_dim = rotary_dim;
  p.is_neox = is_neox;
  return p;
}

RopeParams make_qk_norm_rope_params(at::Tensor& q, at::Tensor& k, const at::Tensor& q_weight,
                                    const at::Tensor& k_weight, const at::Tensor& positions,
                                    const at::Tensor& cos_sin_cache, double eps, bool is_neox,
                                    bool unit_offset) {
  const char* op = "qk_norm_rope";
  RopeParams p = make_rope_params(op, q, k, positions, cos_sin_cache, is_neox);
  for (auto [name, w] : {std::pair<const char*, const at::Tensor*>{"q_weight", &q_weight},
                         {"k_weight", &k_weight}}) {
    check_float_like(op, name, *w, "q", q);
    check_dim(op, name, *w, 1, "[head_dim]");
    check_size(op, name, *w, 0, q.size(2), "head_dim");
    check_contiguous(op, name, *w);
  }
  p.q_weight = q_weight.data_ptr();
  p.k_weight = k_weight.data_ptr();
  p.eps = static_cast<float>(eps);
  p.unit_offset = unit_offset;
  return p;
}

ReshapeAndCacheParams make_reshape_and_cache_params(const at::Tensor& k, const at::Tensor& v,
                                                    at::Tensor& k_cache, at::Tensor& v_cache,
                                                    const at::Tensor& slot_mapping,
                                                    const std::optional<at::Tensor>& k_scale,
                                                    const std::optional<at::Tensor>& v_scale) {
  const char* op = "reshape_and_cache";
  ReshapeAndCacheParams p{};
  p.dtype = float_dtype(op, "k", k);
  check_dim(op, "k", k, 3, "[num_tokens, num_heads, head_dim]");
  check_last_contiguous(op, "k", k);
  check_float_like(op, "v", v, "k", k);
  TORCH_CHECK_VALUE(v.sizes() == k.sizes(), "stagewise.reshape_and_cache: argument 'v' must have the shape of 'k' ",
                    shape_of(k), ", got ", shape_of(v));
  check_last_contiguous(op, "v", v);
  for (auto [name, c] : {std::pair<const char*, at::Tensor*>{"k_cache", &k_cache},
                         {"v_cache", &v_cache}}) {
    check_dim(op, name, *c, 4, "[num_blocks, block_size, num_heads, head_dim]");
    check_size(op, name, *c, 2, k.size(1), "num_heads, as in k");
    check_size(op, name, *c, 3, k.size(2), "head_dim, as in k");
    check_contiguous(op, name, *c);
  }
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "stagewise.reshape_and_cache: argument 'v_cache' must have the shape of 'k_cache' ",
                    shape_of(k_cache), ", got ", shape_of(v_cache));
  const CacheArgs cache = check_caches(op, k_cache, v_cache, "k", k, k_scale, v_scale);
  p.cache_type = cache.type;
  p.k_scale = cache.k_scale;
  p.v_scale = cache.v_scale;
  p.slot_type = index_dtype(op, "slot_mapping", slot_mapping);
  check_index_vector(op, "slot_mapping", slot_mapping, k.size(0), "[num_tokens]", "num_tokens, as in k", k, "k");
  p.k = k.data_ptr();
  p.k_token_stride = k.stride(0);
  p.k_head_stride = k.stride(1);
  p.v = v.data_ptr();
  p.v_token_stride = v.stride(0);
  p.v_head_stride = v.stride(1);
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr();
  p.num_tokens = k.size(0);
  p.num_heads = k.size(1);
  p.head_dim = k.size(2);
  p.num_slots = k_cache.size(0) * k_cache.size(1);
  return p;
}

SlotMappingParams make_slot_mapping_params(at::Tensor& out, const at::Tensor& block_tables,
                                           const at::Tensor& seq_index,
                                           const at::Tensor& positions, int64_t block_size,
                                           int64_t cp_world_size, int64_t cp_rank,
                                           int64_t interleave_size) {
  const char* op = "slot_mapping";
  SlotMappingParams p{};
  p.block_table_type = index_dtype(op, "block_tables", block_tables);
  check_dim(op, "block_tables", block_tables, 2, "[num_seqs, max_blocks]");
  check_last_contiguous(op, "block_tables", block_tables);
  p.position_type = index_dtype(op, "positions", positions);
  check_dim(op, "positions", positions, 1, "[num_tokens]");
  check_contiguous(op, "positions", positions);
  check_same_device(op, "positions", positions, "block_tables", block_tables);
  p.seq_index_type = index_dtype(op, "seq_index", seq_index);
  check_index_vector(op, "seq_index", seq_index, positions.size(0), "[num_tokens]",
                     "num_tokens, as in positions", block_tables, "block_tables");
  TORCH_CHECK_VALUE(block_size >= 1, "stagewise.slot_mapping: argument 'block_size' must be >= 1, got ",
                    block_size);
  TORCH_CHECK_VALUE(cp_world_size >= 1, "stagewise.slot_mapping: argument 'cp_world_size' must be >= 1, got ",
                    cp_world_size);
  TORCH_CHECK_VALUE(cp_rank >= 0 && cp_rank < cp_world_size,
                    "stagewise.slot_mapping: argument 'cp_rank' must be in [0, cp_world_size=",
                    cp_world_size, "), got ", cp_rank);
  TORCH_CHECK_VALUE(interleave_size >= 1 && block_size % interleave_size == 0,
                    "stagewise.slot_mapping: argument 'interleave_size' must divide block_size=",
                    block_size, ", got ", interleave_size);
  out = at::empty({positions.size(0)}, positions.options().dtype(at::kLong));
  p.out = out.data_ptr<int64_t>();
  p.block_tables = block_tables.data_ptr();
  p.block_table_row_stride = block_tables.stride(0);
  p.num_seqs = block_tables.size(0);
  p.max_blocks = block_tables.size(1);
  p.seq_index = seq_index.data_ptr();
  p.positions = positions.data_ptr();
  p.num_tokens = positions.size(0);
  p.block_size = block_size;
  p.cp_world_size = cp_world_size;
  p.cp_rank = cp_rank;
  p.interleave_size = interleave_size;
  return p;
}

// More splits than this only adds empty ones (and their workspace).
constexpr int64_t kMaxNumSplits = 1024;

DecodeAttentionParams make_decode_attention_params(
    at::Tensor& out, at::Tensor& lse, const at::Tensor& q, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    double scale, const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
    int64_t num_splits, int64_t window, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale) {
  const char* op = "decode_attention";
  DecodeAttentionParams p{};
  const PagedQuery pq = check_paged_query(op, "[batch, num_q_heads, head_dim]", q, k_cache, v_cache, k_scale, v_scale);
  const int64_t B = pq.rows, Hq = pq.num_q_heads, Hk = pq.num_kv_heads, D = pq.head_dim;
  p.block_table_type = index_dtype(op, "block_tables", block_tables);
  check_dim(op, "block_tables", block_tables, 2, "[batch, max_blocks_per_seq]");
  check_size(op, "block_tables", block_tables, 0, B, "batch, as in q");
  check_last_contiguous(op, "block_tables", block_tables);
  check_same_device(op, "block_tables", block_tables, "q", q);
  p.seq_lens_type = index_dtype(op, "seq_lens", seq_lens);
  check_index_vector(op, "seq_lens", seq_lens, B, "[batch]", "batch, as in q", q, "q");
  TORCH_CHECK_VALUE(k_new.has_value() == v_new.has_value(),
                    "stagewise.decode_attention: arguments 'k_new' and 'v_new' must be given together, got ",
                    k_new.has_value() ? "k_new only" : "v_new only");
  if (k_new.has_value()) {
    for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"k_new", &*k_new},
                           {"v_new", &*v_new}}) {
      check_float_like(op, name, *t, "q", q);
      check_dim(op, name, *t, 3, "[batch, num_kv_heads, head_dim]");
      check_size(op, name, *t, 0, B, "batch, as in q");
      check_size(op, name, *t, 1, Hk, "num_kv_heads, as in k_cache");
      check_size(op, name, *t, 2, D, "head_dim, as in q");
      check_last_contiguous(op, name, *t);
    }
    p.k_new = k_new->data_ptr();
    p.k_new_batch_stride = k_new->stride(0);
    p.k_new_head_stride = k_new->stride(1);
    p.v_new = v_new->data_ptr();
    p.v_new_batch_stride = v_new->stride(0);
    p.v_new_head_stride = v_new->stride(1);
  }
  check_float_like(op, "out", out, "q", q);
  TORCH_CHECK_VALUE(out.sizes() == q.sizes(), "stagewise.decode_attention: argument 'out' must have the shape of 'q' ",
                    shape_of(q), ", got ", shape_of(out));
  check_last_contiguous(op, "out", out);
  check_dtype_is(op, "lse", lse, at::kFloat, "log-sum-exp is kept in float32");
  check_same_device(op, "lse", lse, "q", q);
  TORCH_CHECK_VALUE(lse.dim() == 2 && lse.size(0) == B && lse.size(1) == Hq,
                    "stagewise.decode_attention: argument 'lse' must have shape [", B, ", ", Hq,
                    "] (batch, num_q_heads), got ", shape_of(lse));
  check_contiguous(op, "lse", lse);
  TORCH_CHECK_VALUE(num_splits >= 0 && num_splits <= kMaxNumSplits,
                    "stagewise.decode_attention: argument 'num_splits' must be in [1, ", kMaxNumSplits,
                    "] (or 0/None for the heuristic), got ", num_splits);
  TORCH_CHECK_VALUE(window >= 0, "stagewise.decode_attention: argument 'window' must be >= 0 (0: no window), got ",
                    window);
  p.out = out.data_ptr();
  p.out_batch_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.lse = lse.data_ptr<float>();
  p.q = q.data_ptr();
  p.q_batch_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  set_paged_cache(p, pq, k_cache, v_cache, block_tables, seq_lens, scale, window);
  p.batch = B;
  p.num_splits = static_cast<int>(num_splits);
  return p;
}

ExtendAttentionParams make_extend_attention_params(
    at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
    int64_t window, const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  const char* op = "extend_attention";
  ExtendAttentionParams p{};
  const PagedQuery pq = check_paged_query(op, "[num_tokens, num_q_heads, head_dim]", q, k_cache, v_cache, k_scale,
                                          v_scale);
  p.block_table_type = index_dtype(op, "block_tables", block_tables);
  check_dim(op, "block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]");
  check_last_contiguous(op, "block_tables", block_tables);
  check_same_device(op, "block_tables", block_tables, "q", q);
  const int64_t B = block_tables.size(0);
  p.seq_lens_type = index_dtype(op, "seq_lens", seq_lens);
  check_index_vector(op, "seq_lens", seq_lens, B, "[num_seqs]", "num_seqs, as in block_tables", q, "q");
  p.query_start_loc_type = index_dtype(op, "query_start_loc", query_start_loc);
  check_index_vector(op, "query_start_loc", query_start_loc, B + 1, "[num_seqs + 1]",
                     "num_seqs + 1, as in block_tables", q, "q");
  check_float_like(op, "out", out, "q", q);
  TORCH_CHECK_VALUE(out.sizes() == q.sizes(), "stagewise.extend_attention: argument 'out' must have the shape of "
                    "'q' ", shape_of(q), ", got ", shape_of(out));
  check_last_contiguous(op, "out", out);
  TORCH_CHECK_VALUE(window >= 0, "stagewise.extend_attention: argument 'window' must be >= 0 (0: no window), got ",
                    window);
  p.out = out.data_ptr();
  p.out_token_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.q = q.data_ptr();
  p.q_token_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  set_paged_cache(p, pq, k_cache, v_cache, block_tables, seq_lens, scale, window);
  p.query_start_loc = query_start_loc.data_ptr();
  p.num_seqs = B;
  p.num_tokens = pq.rows;
  return p;
}

TokenBitmaskParams make_token_bitmask_params(at::Tensor& logits, const at::Tensor& bitmask,
                                             const at::Tensor& rows) {
  const char* op = "apply_token_bitmask";
  TokenBitmaskParams p{};
  p.dtype = float_dtype(op, "logits", logits);
  check_dim(op, "logits", logits, 2, "[batch, vocab]");
  check_last_contiguous(op, "logits", logits);
  check_dtype_is(op, "bitmask", bitmask, at::kInt, "32 tokens to a word");
  check_dim(op, "bitmask", bitmask, 2, "[num_rows, num_words]");
  check_contiguous(op, "bitmask", bitmask);
  check_same_device(op, "bitmask", bitmask, "logits", logits);
  p.rows_type = index_dtype(op, "rows", rows);
  check_index_vector(op, "rows", rows, bitmask.size(0), "[num_rows]", "num_rows, as in bitmask", logits, "logits");
  TORCH_CHECK_VALUE(bitmask.size(0) == 0 || bitmask.size(1) >= 1, "stagewise.apply_token_bitmask: argument "
                    "'bitmask' must have at least one word a row, got shape ", shape_of(bitmask));
  p.logits = logits.data_ptr();
  p.logits_row_stride = logits.stride(0);
  p.bitmask = bitmask.data_ptr<int32_t>();
  p.rows = rows.data_ptr();
  p.batch = logits.size(0);
  p.vocab = logits.size(1);
  p.num_rows = bitmask.size(0);
  p.num_words = bitmask.size(1);
  return p;
}

MergeAttnStatesParams make_merge_attn_states_params(at::Tensor& out, at::Tensor& lse,
                                                    const at::Tensor& out_a,
                                                    const at::Tensor& lse_a,
                                                    const at::Tensor& out_b,
                                                    const at::Tensor& lse_b) {
  const char* op = "merge_attn_states";
  MergeAttnStatesParams p{};
  p.dtype = float_dtype(op, "out_a", out_a);
  check_dim(op, "out_a", out_a, 3, "[num_tokens, num_heads, head_dim]");
  check_last_contiguous(op, "out_a", out_a);
  const int64_t N = out_a.size(0), H = out_a.size(1), D = out_a.size(2);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"out_b", &out_b}, {"out", &out}}) {
    check_float_like(op, name, *t, "out_a", out_a);
    TORCH_CHECK_VALUE(t->sizes() == out_a.sizes(), "stagewise.merge_attn_states: argument '", name,
                      "' must have the shape of 'out_a' ", shape_of(out_a), ", got ", shape_of(*t));
    check_last_contiguous(op, name, *t);
  }
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"lse_a", &lse_a},
                         {"lse_b", &lse_b}, {"lse", &lse}}) {
    check_dtype_is(op, name, *t, at::kFloat, "log-sum-exp is kept in float32");
    check_same_device(op, name, *t, "out_a", out_a);
    TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == N && t->size(1) == H, "stagewise.merge_attn_states: argument '",
                      name, "' must have shape [", N, ", ", H, "] (num_tokens, num_heads), got ",
                      shape_of(*t));
  }
  check_contiguous(op, "lse", lse);  // the inputs' LSEs may be strided views (a gathered buffer's)
  p.out = out.data_ptr();
  p.out_token_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.lse = lse.data_ptr<float>();
  p.a = out_a.data_ptr();
  p.a_token_stride = out_a.stride(0);
  p.a_head_stride = out_a.stride(1);
  p.lse_a = lse_a.data_ptr<float>();
  p.lse_a_token_stride = lse_a.stride(0);
  p.lse_a_head_stride = lse_a.stride(1);
  p.b = out_b.data_ptr();
  p.b_token_stride = out_b.stride(0);
  p.b_head_stride = out_b.stride(1);
  p.lse_b = lse_b.data_ptr<float>();
  p.lse_b_token_stride = lse_b.stride(0);
  p.lse_b_head_stride = lse_b.stride(1);
  p.num_tokens = N;
  p.num_heads = H;
  p.head_dim = D;
  return p;
}

}  // namespace stagewise::glue

namespace stagewise::glue {

namespace {

struct LinearOut {
  Rows out_rows;
  const void* bias;  // nullptr without a bias
};

// A linear's out [x's leading dims, n] and optional bias [n] (x's dtype; checked by the caller for out).
LinearOut linear_out(const char* op, const at::Tensor& x, const at::Tensor& out,
                     const std::optional<at::Tensor>& bias, int64_t n) {
  std::vector<int64_t> want(x.sizes().begin(), x.sizes().end());
  want.back() = n;
  TORCH_CHECK_VALUE(out.sizes() == at::IntArrayRef(want), "stagewise.", op, ": argument 'out' must have shape ",
                    at::IntArrayRef(want), " (x's leading dims, out_features), got ", shape_of(out));
  LinearOut o{rows_of(op, "out", out), nullptr};
  if (bias.has_value()) {
    check_float_like(op, "bias", *bias, "x", x);
    check_dim(op, "bias", *bias, 1, "[out_features]");
    check_size(op, "bias", *bias, 0, n, "out_features");
    check_contiguous(op, "bias", *bias);
    o.bias = bias->data_ptr();
  }
  return o;
}

// x, out and bias of a linear's params (DenseLinearParams, QuantLinearParams).
template <class Params>
void set_linear_io(Params& p, const LinearOut& o, const at::Tensor& out, const at::Tensor& x, const Rows& xr) {
  p.bias = o.bias;
  p.out = out.data_ptr();
  p.out_row_stride = o.out_rows.stride;
  p.x = x.data_ptr();
  p.x_row_stride = xr.stride;
  p.rows = xr.rows;
}

}  // namespace

DenseLinearParams make_dense_linear_params(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                                           const std::optional<at::Tensor>& bias) {
  const char* op = "dense_linear";
  DenseLinearParams p{};
  p.dtype = float_dtype(op, "x", x);
  const Rows xr = rows_of(op, "x", x);
  check_float_like(op, "weight", weight, "x", x);
  check_dim(op, "weight", weight, 2, "[out_features, in_features]");
  check_size(op, "weight", weight, 1, x.size(-1), "in_features, x's last dim");
  TORCH_CHECK_VALUE(weight.size(1) > 0, "stagewise.", op, ": argument 'weight' must have in_features >= 1, got shape ",
                    shape_of(weight));
  check_contiguous(op, "weight", weight);
  const int64_t n = weight.size(0);
  check_float_like(op, "out", out, "x", x);
  set_linear_io(p, linear_out(op, x, out, bias, n), out, x, xr);
  p.weight = weight.data_ptr();
  p.in_features = weight.size(1);
  p.out_features = n;
  return p;
}

QuantLinearParams make_quant_linear_params(at::Tensor& out, const at::Tensor& x,
                                           const at::Tensor& qweight, int64_t qtype,
                                           const std::optional<at::Tensor>& bias, bool packed) {
  const char* op = packed ? "quant_linear_int8" : "quant_linear";
  QuantLinearParams p{};
  p.dtype = float_dtype(op, "x", x);
  const Rows xr = rows_of(op, "x", x);
  const char* qname = qtype_name(op, qtype);
  p.qtype = static_cast<QType>(qtype);
  const int64_t in = x.size(-1), block = quant_block_weights(p.qtype);
  TORCH_CHECK_VALUE(in > 0 && in % block == 0, "stagewise.", op, ": argument 'x' last dim ",
                    "(in_features) must be a positive multiple of ", qname, "'s block of ", block,
                    " weights, got shape ", shape_of(x));
  check_dtype_is(op, "qweight", qweight, at::kByte, packed ? "the packed panels of quant_pack_int8" : "the raw GGUF blocks");
  check_same_device(op, "qweight", qweight, "x", x);
  check_dim(op, "qweight", qweight, 2, packed ? "[panels, bytes_per_panel]" : "[out_features, bytes_per_row]");
  check_float_like(op, "out", out, "x", x);
  TORCH_CHECK_VALUE(out.dim() == x.dim(), "stagewise.", op, ": argument 'out' must have x's ", x.dim(),
                    " dims (x's leading dims, out_features), got shape ", shape_of(out));
  const int64_t n = packed ? out.size(-1) : qweight.size(0);
  if (packed) {
    const int64_t panel_bytes = in / block * cpu::quant_pack_record_bytes(p.qtype);
    const int64_t panels = (n + cpu::kPanelRows - 1) / cpu::kPanelRows;
    TORCH_CHECK_VALUE(qweight.size(0) == panels && qweight.size(1) == panel_bytes, "stagewise.", op,
                      ": argument 'qweight' must be the packed panels [ceil(out_features / ", cpu::kPanelRows,
                      "), in_features / ", block, " * ", cpu::quant_pack_record_bytes(p.qtype), "] = [", panels,
                      ", ", panel_bytes, "] for ", qname, " with in_features=", in, " and out_features=", n,
                      " (out's last dim), got shape ", shape_of(qweight));
  } else {
    const int64_t row_bytes = in / block * quant_block_bytes(p.qtype);
    TORCH_CHECK_VALUE(qweight.size(1) == row_bytes, "stagewise.", op, ": argument 'qweight' dim 1 ",
                      "(bytes per row) must be in_features / ", block, " * ", quant_block_bytes(p.qtype), " = ",
                      row_bytes, " for ", qname, " with in_features=", in, ", got ", qweight.size(1), " (shape ",
                      shape_of(qweight), ")");
  }
  check_contiguous(op, "qweight", qweight);
  set_linear_io(p, linear_out(op, x, out, bias, n), out, x, xr);
  p.qweight = qweight.data_ptr<uint8_t>();
  p.in_features = in;
  p.out_features = n;
  return p;
}

QuantPackArgs make_quant_pack_args(const at::Tensor& qweight, int64_t qtype) {
  constexpr const char* op = "quant_pack_int8";
  const char* qname = qtype_name(op, qtype);
  const QType q = static_cast<QType>(qtype);
  check_dtype_is(op, "qweight", qweight, at::kByte, "the raw GGUF blocks");
  TORCH_CHECK_VALUE(qweight.dim() == 2 && qweight.is_contiguous() && qweight.size(1) % quant_block_bytes(q) == 0,
                    "stagewise.", op, ": argument 'qweight' must be contiguous [rows, blocks * ", quant_block_bytes(q),
                    "] (", qname, " blocks), got shape ", shape_of(qweight), " and strides ", qweight.strides());
  return {q, qweight.size(0), qweight.size(1) / quant_block_bytes(q) * quant_block_weights(q)};
}

const char* qtype_name(const char* op, int64_t qtype) {
  const char* name = qtype == 2 ? "Q4_0" : qtype == 3 ? "Q4_1" : qtype == 8 ? "Q8_0"
                   : qtype == 12 ? "Q4_K" : qtype == 14 ? "Q6_K" : nullptr;
  TORCH_CHECK_VALUE(name != nullptr, "stagewise.", op, ": argument 'qtype' must be a GGML type id of ",
                    "Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12) or Q6_K (14), got ", qtype);
  return name;
}

}  // namespace stagewise::glue
