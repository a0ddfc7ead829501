// CPU implementations of the stagewise ops: check arguments, fill params, run
// the C++ kernel of csrc/cpu/.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bindings/params.h"

namespace stagewise::glue {
namespace {

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  cpu::rms_norm(make_rms_norm_params(out, x, weight, eps));
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  cpu::fused_add_rms_norm(make_fused_add_rms_norm_params(x, residual, weight, eps));
}

void rope(at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
          const at::Tensor& cos_sin_cache, bool is_neox) {
  cpu::rope(make_rope_params("rope", q, k, positions, cos_sin_cache, is_neox));
}

void qk_norm_rope(at::Tensor& q, at::Tensor& k, const at::Tensor& q_weight,
                  const at::Tensor& k_weight, const at::Tensor& positions,
                  const at::Tensor& cos_sin_cache, double eps, bool is_neox) {
  cpu::qk_norm_rope(
      make_qk_norm_rope_params(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox));
}

void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                       at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  cpu::reshape_and_cache(make_reshape_and_cache_params(k, v, k_cache, v_cache, slot_mapping));
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
                      const std::optional<at::Tensor>& v_new, int64_t num_splits) {
  DecodeAttentionParams p = make_decode_attention_params(
      out, lse, q, k_cache, v_cache, block_tables, seq_lens, scale, k_new, v_new, num_splits);
  if (p.num_splits == 0) {
    p.num_splits = cpu::decode_attention_num_splits(
        p.batch, p.num_kv_heads, p.max_blocks_per_seq * p.block_size, p.block_size,
        at::get_num_threads());
  }
  cpu::decode_attention(p);
}

void merge_attn_states(at::Tensor& out, at::Tensor& lse, const at::Tensor& out_a,
                       const at::Tensor& lse_a, const at::Tensor& out_b, const at::Tensor& lse_b) {
  cpu::merge_attn_states(make_merge_attn_states_params(out, lse, out_a, lse_a, out_b, lse_b));
}

void quant_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, int64_t qtype,
                  const std::optional<at::Tensor>& bias) {
  cpu::quant_linear(make_quant_linear_params(out, x, qweight, qtype, bias));
}

}  // namespace

TORCH_LIBRARY_IMPL(stagewise, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rope", &rope);
  m.impl("qk_norm_rope", &qk_norm_rope);
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("slot_mapping", &slot_mapping);
  m.impl("decode_attention", &decode_attention);
  m.impl("merge_attn_states", &merge_attn_states);
  m.impl("quant_linear", &quant_linear);
}

}  // namespace stagewise::glue
