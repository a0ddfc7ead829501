// The one file of op schemas. Mutated arguments are written into the schema
// (Tensor(a!)); outputs are preallocated by the caller so a decode step can
// run without allocating (the Python wrappers in stagewise.ops allocate when
// the caller passes none). Implementations: ops_cpu.cpp, ops_cuda.cpp; fake
// (meta) implementations: python/stagewise/ops/_fake.py.
#include <torch/library.h>

TORCH_LIBRARY(stagewise, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def(
      "rope(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_sin_cache, bool is_neox) "
      "-> ()");
  m.def(
      "qk_norm_rope(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, "
      "Tensor positions, Tensor cos_sin_cache, float eps, bool is_neox) -> ()");
  m.def(
      "reshape_and_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "slot_mapping(Tensor block_tables, Tensor seq_index, Tensor positions, int block_size, "
      "int cp_world_size, int cp_rank, int interleave_size) -> Tensor");
  m.def(
      "decode_attention(Tensor(a!) out, Tensor(b!) lse, Tensor q, Tensor k_cache, "
      "Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale, Tensor? k_new, "
      "Tensor? v_new, int num_splits) -> ()");
  m.def(
      "merge_attn_states(Tensor(a!) out, Tensor(b!) lse, Tensor out_a, Tensor lse_a, "
      "Tensor out_b, Tensor lse_b) -> ()");
  m.def("quant_linear(Tensor(a!) out, Tensor x, Tensor qweight, int qtype, Tensor? bias) -> ()");
}
