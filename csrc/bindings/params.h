// Argument checking and params filling shared by the CPU and CUDA glue: each
// make_*_params() checks every tensor argument (dtype, device, rank, shape,
// strides) and fills the torch-free params struct of include/stagewise/.
// Errors are Python exceptions naming the op, the argument, what was expected
// and what was given: TypeError for dtypes, ValueError for shapes/strides/devices.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "stagewise/attention.h"
#include "stagewise/cache.h"
#include "stagewise/linear.h"
#include "stagewise/norm.h"
#include "stagewise/quant.h"
#include "stagewise/rope.h"
#include "stagewise/sampling.h"

namespace stagewise::glue {

RmsNormParams make_rms_norm_params(at::Tensor& out, const at::Tensor& x,
                                   const at::Tensor& weight, double eps, bool unit_offset);
FusedAddRmsNormParams make_fused_add_rms_norm_params(at::Tensor& x, at::Tensor& residual,
                                                     const at::Tensor& weight, double eps,
                                                     bool unit_offset);
RopeParams make_rope_params(const char* op, at::Tensor& q, at::Tensor& k,
                            const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                            bool is_neox);
RopeParams make_qk_norm_rope_params(at::Tensor& q, at::Tensor& k, const at::Tensor& q_weight,
                                    const at::Tensor& k_weight, const at::Tensor& positions,
                                    const at::Tensor& cos_sin_cache, double eps, bool is_neox,
                                    bool unit_offset);
ReshapeAndCacheParams make_reshape_and_cache_params(const at::Tensor& k, const at::Tensor& v,
                                                    at::Tensor& k_cache, at::Tensor& v_cache,
                                                    const at::Tensor& slot_mapping,
                                                    const std::optional<at::Tensor>& k_scale,
                                                    const std::optional<at::Tensor>& v_scale);
// Checks the inputs and allocates the output ([num_tokens] int64 on their device).
SlotMappingParams make_slot_mapping_params(at::Tensor& out, const at::Tensor& block_tables,
                                           const at::Tensor& seq_index,
                                           const at::Tensor& positions, int64_t block_size,
                                           int64_t cp_world_size, int64_t cp_rank,
                                           int64_t interleave_size);
// num_splits < 0 is an error; 0 is left for the device glue to resolve.
DecodeAttentionParams make_decode_attention_params(
    at::Tensor& out, at::Tensor& lse, const at::Tensor& q, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    double scale, const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
    int64_t num_splits, int64_t window, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale);
ExtendAttentionParams make_extend_attention_params(
    at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
    int64_t window, const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale);
// The most cached tokens a decode_attention query reads, for the split heuristics: the block
// table's capacity, or the window when that is shorter (read without touching seq_lens, which
// may live on the device).
inline int64_t max_context(const DecodeAttentionParams& p) {
  const int64_t capacity = p.max_blocks_per_seq * p.block_size;
  return p.window > 0 && p.window < capacity ? p.window : capacity;
}
// logits: [batch, vocab] float, last dim contiguous (written in place); bitmask: [num_rows,
// num_words] int32 contiguous; rows: [num_rows] int32/int64, contiguous.
TokenBitmaskParams make_token_bitmask_params(at::Tensor& logits, const at::Tensor& bitmask,
                                             const at::Tensor& rows);
MergeAttnStatesParams make_merge_attn_states_params(at::Tensor& out, at::Tensor& lse,
                                                    const at::Tensor& out_a,
                                                    const at::Tensor& lse_a,
                                                    const at::Tensor& out_b,
                                                    const at::Tensor& lse_b);
// bias: [out_features] in x's dtype, or none. Any number of rows; the caller picks the kernel
// (cpu::dense_linear) or a BLAS GEMM.
DenseLinearParams make_dense_linear_params(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                                           const std::optional<at::Tensor>& bias);
// qtype: a GGML type id (QType); bias: [out_features] in x's dtype, or none; packed: qweight is
// quant_pack_int8's panels (quant_linear_int8) rather than the GGUF rows (quant_linear).
QuantLinearParams make_quant_linear_params(at::Tensor& out, const at::Tensor& x,
                                           const at::Tensor& qweight, int64_t qtype,
                                           const std::optional<at::Tensor>& bias, bool packed = false);
// quant_pack_int8's argument: GGUF rows [rows, blocks * block bytes] of type qtype, contiguous.
struct QuantPackArgs {
  QType qtype;
  int64_t rows, in_features;
};
QuantPackArgs make_quant_pack_args(const at::Tensor& qweight, int64_t qtype);
// The GGUF name of a GGML type id the quantised ops take; ValueError naming `op` otherwise.
const char* qtype_name(const char* op, int64_t qtype);

}  // namespace stagewise::glue
