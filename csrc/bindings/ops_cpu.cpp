// CPU implementations of the stagewise ops: check arguments, fill params, run
// the C++ kernel of csrc/cpu/.
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bindings/params.h"
#include "cpu/quant_pack.h"
#include "stagewise/ring.h"

namespace stagewise::glue {
namespace {

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps,
              bool unit_offset) {
  cpu::rms_norm(make_rms_norm_params(out, x, weight, eps, unit_offset));
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                        bool unit_offset) {
  cpu::fused_add_rms_norm(make_fused_add_rms_norm_params(x, residual, weight, eps, unit_offset));
}

void rope(at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
          const at::Tensor& cos_sin_cache, bool is_neox) {
  cpu::rope(make_rope_params("rope", q, k, positions, cos_sin_cache, is_neox));
}

void qk_norm_rope(at::Tensor& q, at::Tensor& k, const at::Tensor& q_weight,
                  const at::Tensor& k_weight, const at::Tensor& positions,
                  const at::Tensor& cos_sin_cache, double eps, bool is_neox, bool unit_offset) {
  cpu::qk_norm_rope(
      make_qk_norm_rope_params(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox,
                               unit_offset));
}

void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                       at::Tensor& v_cache, const at::Tensor& slot_mapping,
                       const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  cpu::reshape_and_cache(make_reshape_and_cache_params(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale));
}

at::Tensor slot_mapping(const at::Tensor& block_tables, const at::Tensor& seq_index,
                        const at::Tensor& positions, int64_t block_size, int64_t cp_world_size,
                        int64_t cp_rank, int64_t interleave_size) {
  at::Tensor out;
  cpu::slot_mapping(make_slot_mapping_params(out, block_tables, seq_index, positions, block_size,
                                             cp_world_size, cp_rank, interleave_size));
  return out;
}

void decode_attention(at::Tensor& out, at::Tensor& lse, const at::Tensor& q,
                      const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                      const std::optional<at::Tensor>& k_new,
                      const std::optional<at::Tensor>& v_new, int64_t num_splits, int64_t window,
                      const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  DecodeAttentionParams p = make_decode_attention_params(
      out, lse, q, k_cache, v_cache, block_tables, seq_lens, scale, k_new, v_new, num_splits, window,
      k_scale, v_scale);
  if (p.num_splits == 0) {
    p.num_splits = cpu::decode_attention_num_splits(
        p.batch, p.num_kv_heads, max_context(p), p.block_size,
        at::get_num_threads());
  }
  cpu::decode_attention(p);
}

void extend_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                      int64_t window, const std::optional<at::Tensor>& k_scale,
                      const std::optional<at::Tensor>& v_scale) {
  cpu::extend_attention(make_extend_attention_params(out, q, k_cache, v_cache, block_tables, query_start_loc,
                                                     seq_lens, scale, window, k_scale, v_scale));
}

void merge_attn_states(at::Tensor& out, at::Tensor& lse, const at::Tensor& out_a,
                       const at::Tensor& lse_a, const at::Tensor& out_b, const at::Tensor& lse_b) {
  cpu::merge_attn_states(make_merge_attn_states_params(out, lse, out_a, lse_a, out_b, lse_b));
}

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  cpu::apply_token_bitmask(make_token_bitmask_params(logits, bitmask, rows));
}

// The GEMV kernel for the few float32 rows of a decode step; more rows, and float16 or bfloat16,
// through at::addmm (a BLAS GEMM, as F.linear): the one place that chooses between them.
void dense_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  const DenseLinearParams p = make_dense_linear_params(out, x, weight, bias);
  if (p.dtype == DType::kFloat32 && p.rows <= cpu::dense_linear_max_rows()) return cpu::dense_linear(p);
  if (p.rows == 0 || p.out_features == 0) return;
  const at::Tensor x2 = x.as_strided({p.rows, p.in_features}, {p.x_row_stride, 1});
  at::Tensor y = out.as_strided({p.rows, p.out_features}, {p.out_row_stride, 1});
  if (bias.has_value()) {
    at::addmm_out(y, *bias, x2, weight.t());
  } else {
    at::mm_out(y, x2, weight.t());
  }
}

void quant_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, int64_t qtype,
                  const std::optional<at::Tensor>& bias) {
  cpu::quant_linear(make_quant_linear_params(out, x, qweight, qtype, bias));
}

void quant_linear_int8(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, int64_t qtype,
                       const std::optional<at::Tensor>& bias) {
  cpu::quant_linear_int8(make_quant_linear_params(out, x, qweight, qtype, bias, /*packed=*/true));
}

// The GGUF rows [N, row bytes] regrouped into quant_linear_int8's panels [ceil(N / 16), panel bytes].
at::Tensor quant_pack_int8(const at::Tensor& qweight, int64_t qtype) {
  const QuantPackArgs a = make_quant_pack_args(qweight, qtype);
  at::Tensor packed = at::empty({(a.rows + cpu::kPanelRows - 1) / cpu::kPanelRows,
                                 a.in_features / quant_block_weights(a.qtype) * cpu::quant_pack_record_bytes(a.qtype)},
                                qweight.options());
  cpu::quant_pack_int8(qweight.data_ptr<uint8_t>(), a.qtype, a.rows, a.in_features, packed.data_ptr<uint8_t>());
  return packed;
}


// ---- activation ring: `ring` is a uint8 tensor over the whole segment -------

RingHeader* ring_header(const char* op, const at::Tensor& ring) {
  TORCH_CHECK_TYPE(ring.scalar_type() == at::kByte, "stagewise.", op,
                   ": argument 'ring' must be a uint8 tensor, got ", ring.scalar_type());
  TORCH_CHECK_VALUE(ring.dim() == 1 && ring.is_contiguous(), "stagewise.", op,
                    ": argument 'ring' must be a contiguous 1-D tensor, got shape ", ring.sizes(),
                    " and strides ", ring.strides());
  const char* why = ring_check(ring.data_ptr(), static_cast<uint64_t>(ring.numel()));
  TORCH_CHECK_VALUE(why == nullptr, "stagewise.", op, ": argument 'ring' is not a valid ring: ", why);
  return static_cast<RingHeader*>(ring.data_ptr());
}

int64_t ring_bytes(int64_t slot_bytes, int64_t num_slots, bool external_slots) {
  TORCH_CHECK_VALUE(slot_bytes > 0 && slot_bytes <= (int64_t{1} << 40),
                    "stagewise.ring_bytes: argument 'slot_bytes' must be in [1, 2^40], got ", slot_bytes);
  TORCH_CHECK_VALUE(num_slots > 0 && num_slots <= (int64_t{1} << 20),
                    "stagewise.ring_bytes: argument 'num_slots' must be in [1, 2^20], got ", num_slots);
  return static_cast<int64_t>(
      ring_layout(slot_bytes, num_slots, external_slots ? kRingExternalSlots : 0).total_bytes);
}

void ring_init(at::Tensor& ring, int64_t slot_bytes, int64_t num_slots, bool external_slots,
               int64_t spin_us) {
  const int64_t need = ring_bytes(slot_bytes, num_slots, external_slots);
  TORCH_CHECK_TYPE(ring.scalar_type() == at::kByte,
                   "stagewise.ring_init: argument 'ring' must be a uint8 tensor, got ", ring.scalar_type());
  TORCH_CHECK_VALUE(ring.dim() == 1 && ring.is_contiguous() && ring.numel() >= need,
                    "stagewise.ring_init: argument 'ring' must be a contiguous 1-D tensor of at least ",
                    need, " bytes, got shape ", ring.sizes());
  TORCH_CHECK_VALUE(spin_us >= 0, "stagewise.ring_init: argument 'spin_us' must be >= 0, got ", spin_us);
  cpu::ring_init(ring.data_ptr(), slot_bytes, num_slots, external_slots ? kRingExternalSlots : 0,
                 spin_us * 1000);
}

void ring_attach(at::Tensor& ring) { cpu::ring_attach(ring_header("ring_attach", ring)); }

// [slot_bytes, num_slots, slot_stride, data_offset, flags, head, tail, closed, user_offset,
//  creator_pid, attacher_pid, wait_ns[0], wait_ns[1], waiting]; user_offset: where the header's
// kRingUserBytes opaque bytes start; attacher_pid: 0 until the peer attached; wait_ns: how long
// the consumer waited for its last two messages that kept it waiting (0: not known), which pace
// its waits; waiting: 1 while a wait of the consumer's is under way.
std::vector<int64_t> ring_info(const at::Tensor& ring) {
  const RingHeader* h = ring_header("ring_info", ring);
  const int64_t user_offset = reinterpret_cast<const uint8_t*>(h->user) - reinterpret_cast<const uint8_t*>(h);
  return {static_cast<int64_t>(h->slot_bytes), static_cast<int64_t>(h->num_slots),
          static_cast<int64_t>(h->slot_stride), static_cast<int64_t>(h->data_offset),
          static_cast<int64_t>(h->flags), static_cast<int64_t>(h->head.load()),
          static_cast<int64_t>(h->tail.load()), static_cast<int64_t>(h->closed.load()), user_offset,
          h->creator_pid, h->attacher_pid.load(), h->wait_ns[0], h->wait_ns[1], h->wait_start_ns != 0};
}

int64_t ring_reserve(at::Tensor& ring, int64_t timeout_us) {
  return cpu::ring_reserve(ring_header("ring_reserve", ring), timeout_us);
}

void ring_commit(at::Tensor& ring, int64_t slot, int64_t nbytes) {
  RingHeader* h = ring_header("ring_commit", ring);
  TORCH_CHECK_VALUE(nbytes >= 0, "stagewise.ring_commit: argument 'nbytes' must be >= 0, got ", nbytes);
  const RingStatus s = cpu::ring_commit(h, slot, static_cast<uint64_t>(nbytes));
  TORCH_CHECK_VALUE(s == RingStatus::kOk, ring_status_message("ring_commit", s, h, slot, nbytes));
}

std::tuple<int64_t, int64_t> ring_acquire(at::Tensor& ring, int64_t timeout_us) {
  uint64_t nbytes = 0;
  const int64_t slot = cpu::ring_acquire(ring_header("ring_acquire", ring), timeout_us, &nbytes);
  return {slot, static_cast<int64_t>(nbytes)};
}

void ring_release(at::Tensor& ring, int64_t slot) {
  RingHeader* h = ring_header("ring_release", ring);
  const RingStatus s = cpu::ring_release(h, slot);
  TORCH_CHECK_VALUE(s == RingStatus::kOk, ring_status_message("ring_release", s, h, slot, 0));
}

void ring_close(at::Tensor& ring) { cpu::ring_close(ring_header("ring_close", ring)); }

}  // namespace

TORCH_LIBRARY_IMPL(stagewise, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rope", &rope);
  m.impl("qk_norm_rope", &qk_norm_rope);
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("slot_mapping", &slot_mapping);
  m.impl("decode_attention", &decode_attention);
  m.impl("extend_attention", &extend_attention);
  m.impl("merge_attn_states", &merge_attn_states);
  m.impl("apply_token_bitmask", &apply_token_bitmask);
  m.impl("dense_linear", &dense_linear);
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_int8", &quant_linear_int8);
  m.impl("quant_pack_int8", &quant_pack_int8);
  m.impl("ring_init", &ring_init);
  m.impl("ring_attach", &ring_attach);
  m.impl("ring_info", &ring_info);
  m.impl("ring_reserve", &ring_reserve);
  m.impl("ring_commit", &ring_commit);
  m.impl("ring_acquire", &ring_acquire);
  m.impl("ring_release", &ring_release);
  m.impl("ring_close", &ring_close);
}

// No tensor argument to dispatch on: the composite kernel serves every call.
TORCH_LIBRARY_IMPL(stagewise, CompositeExplicitAutograd, m) { m.impl("ring_bytes", &ring_bytes); }

}  // namespace stagewise::glue
