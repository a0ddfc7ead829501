// CUDA implementations of the stagewise ops: check arguments, guard the
// device, take the current stream, launch the kernel of csrc/cuda/.
// Compiled only when the torch being built against has CUDA. Only c10's CUDA
// headers are used (not ATen/cuda/CUDAContext.h, which also needs the
// cuBLAS/cuSPARSE/cuSOLVER headers): the glue needs a guard, the current
// stream and the multiprocessor count, nothing more.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <memory>

#include "bindings/params.h"
#include "stagewise/ring.h"

namespace stagewise::glue {
namespace {

void check_launch(const char* op, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "stagewise.", op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

#define STAGEWISE_CUDA_CALL(op, tensor, call)                      \
  do {                                                             \
    const c10::cuda::CUDAGuard guard_((tensor).device());          \
    cudaStream_t stream_ = c10::cuda::getCurrentCUDAStream();      \
    check_launch(op, call);                                        \
  } while (0)

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps,
              bool unit_offset) {
  auto p = make_rms_norm_params(out, x, weight, eps, unit_offset);
  STAGEWISE_CUDA_CALL("rms_norm", x, cuda::rms_norm(p, stream_));
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                        bool unit_offset) {
  auto p = make_fused_add_rms_norm_params(x, residual, weight, eps, unit_offset);
  STAGEWISE_CUDA_CALL("fused_add_rms_norm", x, cuda::fused_add_rms_norm(p, stream_));
}

void rope(at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
          const at::Tensor& cos_sin_cache, bool is_neox) {
  auto p = make_rope_params("rope", q, k, positions, cos_sin_cache, is_neox);
  STAGEWISE_CUDA_CALL("rope", q, cuda::rope(p, stream_));
}

void qk_norm_rope(at::Tensor& q, at::Tensor& k, const at::Tensor& q_weight,
                  const at::Tensor& k_weight, const at::Tensor& positions,
                  const at::Tensor& cos_sin_cache, double eps, bool is_neox, bool unit_offset) {
  auto p = make_qk_norm_rope_params(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox,
                                    unit_offset);
  STAGEWISE_CUDA_CALL("qk_norm_rope", q, cuda::qk_norm_rope(p, stream_));
}

void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                       at::Tensor& v_cache, const at::Tensor& slot_mapping,
                       const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  auto p = make_reshape_and_cache_params(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  STAGEWISE_CUDA_CALL("reshape_and_cache", k, cuda::reshape_and_cache(p, stream_));
}

at::Tensor slot_mapping(const at::Tensor& block_tables, const at::Tensor& seq_index,
                        const at::Tensor& positions, int64_t block_size, int64_t cp_world_size,
                        int64_t cp_rank, int64_t interleave_size) {
  at::Tensor out;  // allocated by the checks, on the device of `positions`
  auto p = make_slot_mapping_params(out, block_tables, seq_index, positions, block_size,
                                    cp_world_size, cp_rank, interleave_size);
  STAGEWISE_CUDA_CALL("slot_mapping", block_tables, cuda::slot_mapping(p, stream_));
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
  // After the checks, so a CPU tensor among the arguments gets the device message.
  const c10::cuda::CUDAGuard guard(q.device());
  TORCH_CHECK_VALUE(p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256,
                    "stagewise.decode_attention: on CUDA head_dim must be 64, 128 or 256, got ",
                    p.head_dim);
  if (p.num_splits == 0) {
    int sms = 0;
    check_launch("decode_attention",
                 cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, q.device().index()));
    p.num_splits = cuda::decode_attention_num_splits(
        p.batch, p.num_kv_heads, max_context(p), p.block_size, sms);
  }
  // Partial outputs of the splits; from the caching allocator, so capturable.
  at::Tensor workspace = at::empty(
      {static_cast<int64_t>(cuda::decode_attention_workspace_floats(p.batch, p.num_q_heads,
                                                                    p.head_dim, p.num_splits))},
      q.options().dtype(at::kFloat));
  p.workspace = workspace.data_ptr<float>();
  STAGEWISE_CUDA_CALL("decode_attention", q, cuda::decode_attention(p, stream_));
}

// No fused CUDA kernel of its own yet: each token of a run attends as a decode row over the cache
// up to itself (decode_attention's split kernel), its sequence's table row repeated and its length
// its position + 1; all on the device, without a host sync.
void extend_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                      int64_t window, const std::optional<at::Tensor>& k_scale,
                      const std::optional<at::Tensor>& v_scale) {
  make_extend_attention_params(out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, window,
                               k_scale, v_scale);  // its checks
  const int64_t T = q.size(0);
  if (T == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor starts = query_start_loc.to(at::kLong);
  // Each token's sequence: sequence i repeated by its run's length (output_size: no host sync).
  const at::Tensor seq =
      at::repeat_interleave(starts.slice(0, 1) - starts.slice(0, 0, -1), std::optional<int64_t>(T));
  const at::Tensor lens = seq_lens.to(at::kLong).index_select(0, seq) - starts.index_select(0, seq + 1) +
                          at::arange(T, starts.options()) + 1;
  at::Tensor lse = at::empty({T, q.size(1)}, q.options().dtype(at::kFloat));
  decode_attention(out, lse, q, k_cache, v_cache, block_tables.index_select(0, seq).contiguous(),
                   lens.to(at::kInt), scale, std::nullopt, std::nullopt, 0, window, k_scale, v_scale);
}

void merge_attn_states(at::Tensor& out, at::Tensor& lse, const at::Tensor& out_a,
                       const at::Tensor& lse_a, const at::Tensor& out_b, const at::Tensor& lse_b) {
  auto p = make_merge_attn_states_params(out, lse, out_a, lse_a, out_b, lse_b);
  STAGEWISE_CUDA_CALL("merge_attn_states", out_a, cuda::merge_attn_states(p, stream_));
}

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  auto p = make_token_bitmask_params(logits, bitmask, rows);
  STAGEWISE_CUDA_CALL("apply_token_bitmask", logits, cuda::apply_token_bitmask(p, stream_));
}

void quant_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, int64_t qtype,
                  const std::optional<at::Tensor>& bias) {
  auto p = make_quant_linear_params(out, x, qweight, qtype, bias);
  STAGEWISE_CUDA_CALL("quant_linear", x, cuda::quant_linear(p, stream_));
}

// CPU only (F.linear serves a GPU): arguments are checked as everywhere, then a clear error.
void dense_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  (void)make_dense_linear_params(out, x, weight, bias);
  TORCH_CHECK_NOT_IMPLEMENTED(false, "stagewise.dense_linear: runs on the CPU only, got x on ", x.device(),
                              "; use F.linear there");
}

// The int8 mode is a CPU kernel only: arguments are checked as everywhere, then a clear error.
void quant_linear_int8(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, int64_t qtype,
                       const std::optional<at::Tensor>& bias) {
  (void)make_quant_linear_params(out, x, qweight, qtype, bias, /*packed=*/true);
  TORCH_CHECK_NOT_IMPLEMENTED(false, "stagewise.quant_linear_int8: the int8 mode has no CUDA kernel (CPU only); "
                              "use quant_linear on ", x.device());
}

// ---- CUDA IPC activation ring (python/stagewise/transport/cuda_ipc.py) -------

at::Tensor cuda_ipc_alloc(int64_t nbytes, int64_t device) {
  TORCH_CHECK_VALUE(nbytes > 0, "stagewise.cuda_ipc_alloc: argument 'nbytes' must be > 0, got ", nbytes);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* ptr = nullptr;
  check_launch("cuda_ipc_alloc", cuda::ipc_alloc(&ptr, static_cast<uint64_t>(nbytes)));
  return at::from_blob(ptr, {nbytes}, [](void* p) { cuda::ipc_free(p); },
                       at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device));
}

// buf: the tensor cuda_ipc_alloc returned (the handle names its whole allocation).
at::Tensor cuda_ipc_handle(const at::Tensor& buf) {
  TORCH_CHECK_VALUE(buf.is_cuda() && buf.scalar_type() == at::kByte && buf.storage_offset() == 0,
                    "stagewise.cuda_ipc_handle: argument 'buf' must be a uint8 CUDA tensor from "
                    "cuda_ipc_alloc, got ", buf.scalar_type(), " on ", buf.device(), " at offset ",
                    buf.storage_offset());
  const c10::cuda::CUDAGuard guard(buf.device());
  at::Tensor handle = at::empty({cuda::kIpcHandleBytes}, at::TensorOptions().dtype(at::kByte));
  check_launch("cuda_ipc_handle", cuda::ipc_get_handle(buf.data_ptr(), handle.data_ptr<uint8_t>()));
  return handle;
}

at::Tensor cuda_ipc_open(const at::Tensor& handle, int64_t nbytes, int64_t device) {
  TORCH_CHECK_VALUE(handle.device().is_cpu() && handle.scalar_type() == at::kByte &&
                        handle.is_contiguous() && handle.numel() == cuda::kIpcHandleBytes,
                    "stagewise.cuda_ipc_open: argument 'handle' must be ", cuda::kIpcHandleBytes,
                    " contiguous uint8 bytes on the CPU, got ", handle.numel(), " ", handle.scalar_type(),
                    " on ", handle.device());
  TORCH_CHECK_VALUE(nbytes > 0, "stagewise.cuda_ipc_open: argument 'nbytes' must be > 0, got ", nbytes);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* ptr = nullptr;
  check_launch("cuda_ipc_open", cuda::ipc_open(handle.data_ptr<uint8_t>(), &ptr));
  const auto unmap = [](void* p) { cuda::ipc_close(p); };
  std::unique_ptr<void, decltype(unmap)> mapping(ptr, unmap);  // unmapped if anything below throws
  int owner = -1;
  check_launch("cuda_ipc_open", cuda::pointer_device(ptr, &owner));
  if (owner != device) {
    bool reachable = false;
    check_launch("cuda_ipc_open", cuda::can_access_peer(static_cast<int>(device), owner, &reachable));
    TORCH_CHECK_VALUE(reachable, "stagewise.cuda_ipc_open: the ring's memory is on GPU ", owner,
                      ", which GPU ", device, " cannot access directly (no peer access between them); "
                      "run both stages on one GPU or on peer-capable GPUs, or use the torch (NCCL) transport");
  }
  // Labelled with this process's device, so that its streams order the ring's work; on another
  // GPU the bytes are reached through peer access (torch would otherwise insist on the owner).
  at::Tensor buf = at::for_blob(ptr, {nbytes})
                       .deleter(unmap)
                       .options(at::TensorOptions().dtype(at::kByte).device(
                           at::kCUDA, static_cast<c10::DeviceIndex>(device)))  // its dispatch key too
                       .target_device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)))
                       .make_tensor();
  mapping.release();
  return buf;
}

uint32_t* ring_counter(const char* op, const at::Tensor& buf, int64_t offset) {
  TORCH_CHECK_VALUE(buf.scalar_type() == at::kByte && buf.is_contiguous(), "stagewise.", op,
                    ": argument 'buf' must be a contiguous uint8 tensor, got ", buf.scalar_type());
  TORCH_CHECK_VALUE(offset >= 0 && offset % 4 == 0 && offset + 4 <= buf.numel(), "stagewise.", op,
                    ": argument 'offset' must be a multiple of 4 inside the buffer of ", buf.numel(),
                    " bytes, got ", offset);
  return reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(buf.data_ptr()) + offset);
}

// Enqueues on the current stream: wait until the counter reaches `value` (mod 2^32).
void cuda_ring_wait(const at::Tensor& buf, int64_t offset, int64_t value) {
  uint32_t* counter = ring_counter("cuda_ring_wait", buf, offset);
  STAGEWISE_CUDA_CALL("cuda_ring_wait", buf,
                      cuda::stream_wait_counter(stream_, counter, static_cast<uint32_t>(value)));
}

// Enqueues on the current stream: after the work before it, set the counter to `value`.
void cuda_ring_signal(at::Tensor& buf, int64_t offset, int64_t value) {
  uint32_t* counter = ring_counter("cuda_ring_signal", buf, offset);
  STAGEWISE_CUDA_CALL("cuda_ring_signal", buf,
                      cuda::stream_write_counter(stream_, counter, static_cast<uint32_t>(value)));
}

}  // namespace

TORCH_LIBRARY_IMPL(stagewise, CUDA, m) {
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
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_int8", &quant_linear_int8);
  m.impl("dense_linear", &dense_linear);
  m.impl("cuda_ring_wait", &cuda_ring_wait);
  m.impl("cuda_ring_signal", &cuda_ring_signal);
}

// Their tensor arguments (if any) are on the CPU: composite kernels serve every call.
TORCH_LIBRARY_IMPL(stagewise, CompositeExplicitAutograd, m) {
  m.impl("cuda_ipc_alloc", &cuda_ipc_alloc);
  m.impl("cuda_ipc_handle", &cuda_ipc_handle);
  m.impl("cuda_ipc_open", &cuda_ipc_open);
}

}  // namespace stagewise::glue
