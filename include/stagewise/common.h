// Torch-free definitions shared by the CPU kernels, the CUDA kernels and the
// torch glue. Every kernel takes a params struct of raw pointers, element
// strides and sizes (FlashInfer style); the glue in csrc/bindings fills it.
#pragma once
#include <cstdint>

#if defined(__CUDACC__) || defined(STAGEWISE_WITH_CUDA) || defined(STAGEWISE_CUDA_DECLS)
#include <cuda_runtime_api.h>
#define STAGEWISE_HAS_CUDA_DECLS 1
#endif

namespace stagewise {

// Floating point element type of activations, weights and caches.
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Element type of a paged KV cache (a run's `kv_cache_dtype`): the activations' own dtype, or a
// compact code of one byte per value with a float16 scale per token and KV head, so that a token's
// row is quantised by itself, whichever step, chunk or rank writes it:
//   amax  = max |x| over the row's head_dim values (float32)
//   int8:     scale = half(amax / 127), code = clamp(rint(x / scale), -127, 127)
//   fp8_e4m3: scale = half(amax / 448), code = e4m3(clamp(x / scale, -448, 448)), to nearest even
//   value = float(code) * float(scale)
// (rint: to nearest, ties to even; half(): to nearest even, capped at 65504). A row whose scale is
// 0 (all zeros, or amax below half's range) stores codes 0.
enum class CacheType : int32_t { kModel = 0, kInt8 = 1, kFp8E4M3 = 2 };

// Element type of an index tensor (positions, slots, block tables, lengths).
enum class IndexType : int32_t { kInt32 = 0, kInt64 = 1 };

// A slot of -1 in a slot mapping marks a padding token: nothing is written or read.
inline constexpr int64_t kPaddingSlot = -1;

// Reads element i of an int32 or int64 index array as int64.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline int64_t load_index(const void* p, IndexType t, int64_t i) {
  return t == IndexType::kInt32 ? static_cast<int64_t>(static_cast<const int32_t*>(p)[i])
                                : static_cast<const int64_t*>(p)[i];
}

inline int dtype_size(DType d) { return d == DType::kFloat32 ? 4 : 2; }

}  // namespace stagewise
