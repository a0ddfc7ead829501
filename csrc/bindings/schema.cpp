// The one file of op schemas. Mutated arguments are written into the schema
// (Tensor(a!)); outputs are preallocated by the caller so a decode step can
// run without allocating (the Python wrappers in stagewise.ops allocate when
// the caller passes none). Implementations: ops_cpu.cpp, ops_cuda.cpp; fake
// (meta) implementations: python/stagewise/ops/_fake.py.
//
// The ring_* and cuda_ipc_* ops are the activation-ring transport
// (include/stagewise/ring.h, python/stagewise/transport/): `ring` is the uint8
// tensor over a whole shared-memory segment; they have no fake implementations
// (they act on shared memory, never inside a traced graph).
#include <torch/library.h>

TORCH_LIBRARY(stagewise, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps, bool unit_offset=False) -> ()");
  m.def(
      "fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, "
      "bool unit_offset=False) -> ()");
  m.def(
      "rope(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_sin_cache, bool is_neox) "
      "-> ()");
  m.def(
      "qk_norm_rope(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, "
      "Tensor positions, Tensor cos_sin_cache, float eps, bool is_neox, bool unit_offset=False) -> ()");
  m.def(
      "reshape_and_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> ()");
  m.def(
      "slot_mapping(Tensor block_tables, Tensor seq_index, Tensor positions, int block_size, "
      "int cp_world_size, int cp_rank, int interleave_size) -> Tensor");
  m.def(
      "decode_attention(Tensor(a!) out, Tensor(b!) lse, Tensor q, Tensor k_cache, "
      "Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale, Tensor? k_new, "
      "Tensor? v_new, int num_splits, int window=0, Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def(
      "extend_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, int window=0, "
      "Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def(
      "merge_attn_states(Tensor(a!) out, Tensor(b!) lse, Tensor out_a, Tensor lse_a, "
      "Tensor out_b, Tensor lse_b) -> ()");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  m.def("dense_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
  m.def("quant_linear(Tensor(a!) out, Tensor x, Tensor qweight, int qtype, Tensor? bias) -> ()");
  m.def("quant_linear_int8(Tensor(a!) out, Tensor x, Tensor qweight, int qtype, Tensor? bias) -> ()");
  m.def("quant_pack_int8(Tensor qweight, int qtype) -> Tensor");

  // Activation ring (CPU, shared memory). Slot results: >= 0, or -1 timed out, -2 closed.
  m.def("ring_bytes(int slot_bytes, int num_slots, bool external_slots) -> int");
  m.def(
      "ring_init(Tensor(a!) ring, int slot_bytes, int num_slots, bool external_slots, "
      "int spin_us) -> ()");
  m.def("ring_attach(Tensor(a!) ring) -> ()");
  m.def("ring_info(Tensor ring) -> int[]");
  m.def("ring_reserve(Tensor(a!) ring, int timeout_us) -> int");
  m.def("ring_commit(Tensor(a!) ring, int slot, int nbytes) -> ()");
  m.def("ring_acquire(Tensor(a!) ring, int timeout_us) -> (int, int)");
  m.def("ring_release(Tensor(a!) ring, int slot) -> ()");
  m.def("ring_close(Tensor(a!) ring) -> ()");
  // Activation ring (CUDA IPC): the device allocation and stream-ordered counters.
  m.def("cuda_ipc_alloc(int nbytes, int device) -> Tensor");
  m.def("cuda_ipc_handle(Tensor buf) -> Tensor");
  m.def("cuda_ipc_open(Tensor handle, int nbytes, int device) -> Tensor");
  m.def("cuda_ring_wait(Tensor buf, int offset, int value) -> ()");
  m.def("cuda_ring_signal(Tensor(a!) buf, int offset, int value) -> ()");
}
